from comfy_api.latest import io, ui

from ..core.quant.fp8 import DEFAULT_LAYOUT, GRANULARITIES, LAYOUTS, SCOPES, Fp8Config
from ..core.quant.patch import apply_fp8
from . import ids


class QuantizeFP8(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id=ids.QUANTIZE_FP8,
            display_name="Quantize FP8 (FluxAccel)",
            category=ids.CATEGORY,
            description="FP8 dynamic-activation + FP8-weight quantization (torchao) of a FLUX model's Linear "
                        "layers, for this branch only. Needs an NVIDIA GPU of compute capability 8.9+.",
            inputs=[
                io.Model.Input("model", tooltip="A FLUX.1, FLUX.2 or Chroma model loaded in bf16 (UNETLoader weight_dtype 'default')."),
                io.Combo.Input("granularity", options=list(GRANULARITIES), default="per_row",
                               tooltip="per_row: one scale per weight row and per activation token (more "
                                       "accurate). per_tensor: one scale per tensor (fewer scaling ops)."),
                io.Combo.Input("scope", options=list(SCOPES), default="blocks",
                               tooltip="blocks: Linears in the double/single blocks except modulation. "
                                       "blocks+modulation: also modulation (FLUX.1's per-block, FLUX.2's three shared, "
                                       "Chroma's distilled guidance network). all_linear: also embedders and final layer."),
                io.Combo.Input("layout", options=list(LAYOUTS), default=DEFAULT_LAYOUT, optional=True,
                               tooltip="plain (default): FP8 data and scales held as plain tensors, torchao's own "
                                       "math; a compiled model has no tensor-subclass inputs to unwrap on each call "
                                       "(measured faster on an H200). subclass: weights stay torchao Float8Tensors "
                                       "(same numbers in eager mode)."),
                io.Boolean.Input("fuse_gelu", default=True, optional=True,
                                 tooltip="Compute each MLP's GELU and the FP8 quantization of its output in one pass "
                                         "(one kernel instead of a reduction that reads the activations twice): the "
                                         "same numbers up to the last bit of a few values, faster on the GPU. "
                                         "Applies with granularity per_row and layout plain; otherwise the text "
                                         "below says it is kept separate, and why. FLUX.1 and Chroma."),
                io.Boolean.Input("fuse_silu_gate", default=True, optional=True,
                                 tooltip="FLUX.2's MLPs: compute the SiLU gate (SiLU of one half times the other) and "
                                         "the FP8 quantization of its output in one pass, as fuse_gelu does for GELU "
                                         "(same numbers up to the last bit of a few values). Applies with "
                                         "granularity per_row and layout plain; otherwise the text below says why."),
            ],
            outputs=[io.Model.Output(tooltip="The model with FP8 Linears; the input model is unchanged.")],
        )

    @classmethod
    def execute(cls, model, granularity, scope, layout=DEFAULT_LAYOUT, fuse_gelu=True,
                fuse_silu_gate=True) -> io.NodeOutput:
        clone, report = apply_fp8(model, Fp8Config(granularity=granularity, scope=scope, layout=layout,
                                                   fuse_gelu=fuse_gelu, fuse_silu_gate=fuse_silu_gate))
        return io.NodeOutput(clone, ui=ui.PreviewText(report.summary()))
