import math

import comfy.utils
from comfy_api.latest import io, ui

from ..core.compile.patch import compiled_of
from ..core.compile.warmup import TICKS, parse_resolutions, warmup
from ..core.quant.static_scales import StaticScalesConfig, static_scales_state
from . import ids
from .events import progress_text
from .validation import parses


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
        import comfy.model_management as mm

        self.text(text, seconds)
        try:
            self.bar.update_absolute(self.done * TICKS + int(0.9 * TICKS * (1 - math.exp(-seconds / 45))))
        except mm.InterruptProcessingException:
            mm.interrupt_current_processing(True)


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
                io.String.Input("resolutions", default="1024x1024",
                                tooltip="Image sizes to prepare, WIDTHxHEIGHT separated by commas, e.g. 1024x1024, 832x1216."),
                io.Int.Input("batch_size", default=1, min=1, max=64, tooltip="Images per prompt (EmptyLatentImage batch)."),
                io.Int.Input("text_length", default=256, min=1, max=4096,
                             tooltip="T5 tokens of the prompts: 256 is ComfyUI's FLUX padding; 512 is common. "
                                     "Ignored when conditioning is connected."),
                io.Float.Input("cfg", default=1.0, min=1.0, max=30.0, step=0.1,
                               tooltip="The KSampler cfg you will use: 1 runs batch 1, above 1 runs cond+uncond (batch 2)."),
                io.Int.Input("steps", default=2, min=1, max=100, tooltip="Sampling steps per shape (2 compiles and captures)."),
                io.Combo.Input("activation_scales", options=["dynamic", "static"], default="dynamic", optional=True,
                               tooltip="FP8 activation scales. dynamic: each call's own (Quantize FP8's). static "
                                       "(opt-in; needs Quantize FP8 with layout plain and your positive conditioning "
                                       "connected): first samples every listed size uncompiled for `steps` steps -- set "
                                       "them to your KSampler's steps -- and fixes each FP8 Linear's activation scale "
                                       "from the largest value seen (2x headroom; larger values saturate): ~4 % "
                                       "faster per step at FLUX.1-dev 1024² on an H200. Its error shows in the "
                                       "Benchmark node. A new conditioning runs the calibration again: connect a "
                                       "fixed, typical prompt of your own here rather than the one you edit."),
                io.Conditioning.Input("positive", optional=True, tooltip="Your positive conditioning (sets the text length)."),
                io.Conditioning.Input("negative", optional=True, tooltip="Your negative conditioning."),
            ],
            outputs=[io.Model.Output(tooltip="The model, compiled and captured at these shapes, which it allows; the "
                                             "input (the Compile node's output) keeps its own shapes and policy.")],
            hidden=[io.Hidden.unique_id],
            is_output_node=True,  # runs without anything downstream: a workflow may only warm the server (prebuild)
        )

    @classmethod
    def validate_inputs(cls, resolutions):
        return parses(parse_resolutions, resolutions)

    @classmethod
    def execute(cls, model, resolutions, batch_size, text_length, cfg, steps, activation_scales="dynamic",
                positive=None, negative=None) -> io.NodeOutput:
        res = parse_resolutions(resolutions)
        static = StaticScalesConfig() if activation_scales == "static" else None
        bar = _Bar(len(res) * steps * (2 if static else 1), cls.hidden.unique_id)  # static: calibration runs first
        warmed, secs = warmup(model, res, batch_size, text_length, cfg, steps, positive, negative,
                              on_step=bar.step, on_compile=bar.compiling, static_scales=static)
        text = "\n".join(ready_lines(warmed, secs))
        return io.NodeOutput(warmed, ui=ui.PreviewText(text))


def ready_lines(model, seconds: dict[str, float]) -> list[str]:
    """Per shape: its compile time (the figure the compile's progress ended with) and the whole warm-up sampling; the
    static activation scales, where calibrated."""
    compiled = compiled_of(model)
    compile_s = {k.describe(): v for k, v in compiled.stats.compile_seconds.items()} if compiled is not None else {}
    static = static_scales_state(model)
    shapes = [f"{shape}: compiled in {compile_s[shape]:.1f} s; warm-up sampling done after {s:.1f} s" if shape in compile_s
              else f"{shape}: warm-up sampling done after {s:.1f} s (not compiled: see the log)"
              for shape, s in seconds.items()]
    return ([static.summary()] if static else []) + shapes
