from comfy_api.latest import io, ui

from ..core.inputs import node_defaults
from ..core.parallel.config import ParallelConfig
from ..core.parallel.patch import NODE, apply_parallel
from . import ids
from .events import progress_text

_D = node_defaults(ParallelConfig)  # {field: (default, advanced)}: the config dataclass is the one home of defaults


class Parallel(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id=ids.PARALLEL,
            display_name=NODE,
            category=ids.CATEGORY,
            description="Splits each model call's tokens over several GPUs (sequence parallelism, yunchang's Ulysses "
                        "attention), one worker process per GPU. Put it after Quantize FP8 and LoRAs, in place of "
                        "Compile. The workers start at the first prompt.",
            inputs=[
                io.Model.Input("model", tooltip="A FLUX.1 or FLUX.2 model, optionally FP8-quantized by FluxAccel."),
                io.Int.Input("gpus", default=_D["gpus"][0], min=2, max=8,
                             tooltip="How many GPUs (worker processes) share each model call; the model's attention "
                                     "heads must split evenly over them."),
            ],
            outputs=[io.Model.Output(tooltip="The model, run across the GPUs; the input model is unchanged.")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, model, **inputs) -> io.NodeOutput:
        cfg = ParallelConfig.from_inputs(inputs, NODE)
        clone, parallel = apply_parallel(model, cfg)
        parallel.on_progress = progress_text(cls.hidden.unique_id)  # the workers' start, on this node
        return io.NodeOutput(clone, ui=ui.PreviewText(parallel.describe()))
