import math

import comfy.model_management
import comfy.utils
from comfy_api.latest import io, ui

from ..core.bench.benchmark import BenchCase
from ..core.compile.patch import compiled_of
from ..core.compile.warmup import NODE, REMOVED_INPUTS, TICKS, WarmupPlan, parse_resolutions, warmup
from ..core.inputs import known_inputs
from ..core.models.synthetic import TEXT_LENGTH_LIMIT
from . import ids
from .events import progress_text
from .validation import parses


_P = WarmupPlan(resolutions=[])  # the plan's defaults: the one home of the node's defaults
_B = BenchCase()  # the size it warms by default: the Benchmark's


class _Bar:
    """Warmup's progress bar: a full step per sampling step; while a step compiles, up to 90 % of it, on a time
    scale of a 45 s compile (an estimate: the text beside it says the phase and the seconds)."""

    def __init__(self, steps: int, node_id: str | None):
        self.bar, self.done, self.text = comfy.utils.ProgressBar(steps * TICKS, node_id=node_id), 0, progress_text(node_id)

    def step(self) -> None:
        self.done += 1
        self.bar.update_absolute(self.done * TICKS)

    def compiling(self, text: str, seconds: float) -> None:
        """Called from the compile's watcher thread. ComfyUI's progress hook takes a pending interrupt (it clears the
        flag and raises): here it would be lost to the sampler's thread, so the flag is set again for it."""
        self.text(text, seconds)
        try:
            self.bar.update_absolute(self.done * TICKS + int(0.9 * TICKS * (1 - math.exp(-seconds / 45))))
        except comfy.model_management.InterruptProcessingException:
            comfy.model_management.interrupt_current_processing(True)


class Warmup(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id=ids.WARMUP,
            display_name="Warmup (FluxAccel)",
            category=ids.CATEGORY,
            description="Compiles and captures the accelerated FLUX model at each listed shape with a short real "
                        "sampling run, before the first real prompt; each shape becomes an allowed compiled shape.",
            inputs=[
                io.Model.Input("model", tooltip="A FLUX model from Compile (FluxAccel), optionally FP8-quantized."),
                io.String.Input("resolutions", default=f"{_B.width}x{_B.height}",
                                tooltip="Image sizes to prepare, WIDTHxHEIGHT separated by commas, e.g. 1024x1024, 832x1216."),
                io.Int.Input("batch_size", default=_P.batch_size, min=1, max=64,
                             tooltip="Images per prompt (EmptyLatentImage batch)."),
                io.Int.Input("text_length", default=_P.text_length, min=1, max=TEXT_LENGTH_LIMIT,
                             tooltip="Text tokens of the prompts (256: ComfyUI's FLUX.1 padding of a short prompt). "
                                     "Ignored when conditioning is connected."),
                io.Float.Input("cfg", default=_P.cfg, min=1.0, max=30.0, step=0.1,
                               tooltip="The KSampler cfg you will use: 1 runs batch 1, above 1 runs cond+uncond (batch 2)."),
                io.Int.Input("steps", default=_P.steps, min=1, max=100,
                             tooltip="Sampling steps per shape (2 compiles and captures)."),
                io.Conditioning.Input("positive", optional=True, tooltip="Your positive conditioning (sets the text length)."),
                io.Conditioning.Input("negative", optional=True, tooltip="Your negative conditioning."),
            ],
            outputs=[io.Model.Output(tooltip="The model, compiled and captured at these shapes, which it allows; the "
                                             "input (the Compile node's output) keeps its own shapes and policy.")],
            hidden=[io.Hidden.unique_id],
            is_output_node=True,  # runs without anything downstream: a workflow may only warm the server (prebuild)
            accept_all_inputs=True,  # inputs this node no longer has reach execute: said in the log, left to FluxAccel
        )

    @classmethod
    def validate_inputs(cls, resolutions):
        return parses(parse_resolutions, resolutions)

    @classmethod
    def execute(cls, model, resolutions, batch_size, text_length, cfg, steps, positive=None, negative=None,
                **removed) -> io.NodeOutput:
        known_inputs(removed, (), REMOVED_INPUTS, NODE)
        res = parse_resolutions(resolutions)
        bar = _Bar(len(res) * steps, cls.hidden.unique_id)
        plan = WarmupPlan(res, batch_size, text_length, cfg, steps)
        warmed, secs = warmup(model, plan, positive, negative, on_step=bar.step, on_compile=bar.compiling)
        text = "\n".join(ready_lines(warmed, secs))
        return io.NodeOutput(warmed, ui=ui.PreviewText(text))


def ready_lines(model, seconds: dict[str, float]) -> list[str]:
    """Per shape: its compile time (the figure the compile's progress ended with) and the whole warm-up sampling."""
    compiled = compiled_of(model)
    compile_s = {k.describe(): v for k, v in compiled.stats.compile_seconds.items()} if compiled is not None else {}
    return [f"{shape}: compiled in {compile_s[shape]:.1f} s; warm-up sampling done after {s:.1f} s" if shape in compile_s
              else f"{shape}: warm-up sampling done after {s:.1f} s (not compiled: see the log)"
              for shape, s in seconds.items()]
