from comfy_api.latest import io, ui

from ..core.inputs import node_defaults
from ..core.quant.fp8 import GRANULARITIES, SCOPES, Fp8Config
from ..core.quant.patch import NODE, apply_fp8
from . import ids

_D = node_defaults(Fp8Config)  # {field: (default, advanced)}: the config dataclass is the one home of defaults


class QuantizeFP8(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id=ids.QUANTIZE_FP8,
            display_name=NODE,
            category=ids.CATEGORY,
            description="FP8 dynamic-activation + FP8-weight quantization (torchao) of a FLUX model's Linear "
                        "layers, for this branch only. Needs an NVIDIA GPU of compute capability 8.9+.",
            inputs=[
                io.Model.Input("model", tooltip="A FLUX.1, FLUX.2 or Chroma model loaded in bf16 (UNETLoader weight_dtype 'default')."),
                io.Combo.Input("granularity", options=list(GRANULARITIES), default=_D["granularity"][0],
                               tooltip="per_row: one scale per weight row and per activation token (more accurate, "
                                       "and the MLP activation fused into the quantization). per_tensor: one scale "
                                       "per tensor."),
                io.Combo.Input("scope", options=list(SCOPES), default=_D["scope"][0],
                               tooltip="blocks: the Linears of the double/single blocks except modulation. "
                                       "blocks+modulation: also the modulations. all_linear: also embedders and the "
                                       "final layer."),
            ],
            outputs=[io.Model.Output(tooltip="The model with FP8 Linears; the input model is unchanged.")],
            accept_all_inputs=True,  # inputs this node no longer has reach execute: said in the log, left to FluxAccel
        )

    @classmethod
    def execute(cls, model, **inputs) -> io.NodeOutput:
        clone, report = apply_fp8(model, Fp8Config.from_inputs(inputs, NODE))
        return io.NodeOutput(clone, ui=ui.PreviewText(report.summary()))
