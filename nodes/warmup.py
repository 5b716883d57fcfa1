import comfy.utils
from comfy_api.latest import io, ui

from ..core.warmup import parse_resolutions, warmup
from . import ids
from .validation import parses


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
                io.Conditioning.Input("positive", optional=True, tooltip="Your positive conditioning (sets the text length)."),
                io.Conditioning.Input("negative", optional=True, tooltip="Your negative conditioning."),
            ],
            outputs=[io.Model.Output(tooltip="The model, compiled and captured at these shapes, which it allows; the "
                                             "input (the Compile node's output) keeps its own shapes and policy.")],
        )

    @classmethod
    def validate_inputs(cls, resolutions):
        return parses(parse_resolutions, resolutions)

    @classmethod
    def execute(cls, model, resolutions, batch_size, text_length, cfg, steps, positive=None, negative=None) -> io.NodeOutput:
        res = parse_resolutions(resolutions)
        pbar = comfy.utils.ProgressBar(len(res) * steps)
        warmed, secs = warmup(model, res, batch_size, text_length, cfg, steps, positive, negative,
                              on_step=lambda: pbar.update(1))
        text = "\n".join(f"{shape}: ready in {s:.1f} s" for shape, s in secs.items())
        return io.NodeOutput(warmed, ui=ui.PreviewText(text))
