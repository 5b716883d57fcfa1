from comfy_api.latest import io

from ..core.compile.config import ATTENTIONS, MODES, POLICIES, SHAPES_LIMIT, CompileConfig
from ..core.compile.patch import NODE, apply_compile
from ..core.inputs import node_defaults
from . import ids
from .events import compiled_notifier, compiled_state, progress_text

_D = node_defaults(CompileConfig)  # {field: (default, advanced)}: the config dataclass is the one home of defaults


class Compile(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id=ids.COMPILE,
            display_name=NODE,
            category=ids.CATEGORY,
            description="Compiles each kind of FLUX block once (torch.compile) and captures every model call into a "
                        "CUDA graph. Put it after Quantize FP8; add Warmup to compile before the first prompt. The "
                        "node's text says what runs here and why.",
            inputs=[
                io.Model.Input("model", tooltip="A FLUX.1, FLUX.2 or Chroma model, optionally FP8-quantized by FluxAccel."),
                io.Combo.Input("resolution_policy", options=list(POLICIES), default=_D["resolution_policy"][0],
                               tooltip="recompile: each new size or prompt length compiles (beside the running "
                                       "model), up to max_shapes; more run uncompiled. strict: another shape is an "
                                       "error. eager_fallback: only the first compiles."),
                io.Int.Input("max_shapes", default=_D["max_shapes"][0], min=1, max=SHAPES_LIMIT, optional=True,
                             advanced=_D["max_shapes"][1],
                             tooltip="How many shapes this model may compile (recompile policy, Warmup)."),
                io.Combo.Input("attention", options=list(ATTENTIONS), default=_D["attention"][0], optional=True,
                               advanced=_D["attention"][1],
                               tooltip="cudnn: bf16 attention through PyTorch SDPA. fp8: FlashAttention-3's FP8 kernel "
                                       "(Hopper GPUs, pip install fa3-fwd): faster, slightly less exact."),
                io.Combo.Input("mode", options=list(MODES), default=_D["mode"][0], optional=True,
                               advanced=_D["mode"][1],
                               tooltip="default: fast compile. tuned-kernels: tunes the generated kernels at first "
                                       "use (longer compile). max-autotune: also benchmarks GEMM choices (much longer)."),
            ],
            outputs=[io.Model.Output(tooltip="The model, compiled on first use; the input model is unchanged.")],
            hidden=[io.Hidden.unique_id],
            accept_all_inputs=True,  # inputs this node no longer has reach execute: said in the log, left to FluxAccel
        )

    @classmethod
    def execute(cls, model, **inputs) -> io.NodeOutput:
        clone, compiled = apply_compile(model, CompileConfig.from_inputs(inputs, NODE))
        compiled.on_compiled = compiled_notifier(cls.hidden.unique_id)
        compiled.on_progress = progress_text(cls.hidden.unique_id)
        state = compiled_state(compiled)
        return io.NodeOutput(clone, ui={"text": [state["text"]], "fluxaccel_compiled": [state]})
