from comfy_api.latest import io

from ..core.models.flux import require_flux
from ..core.models.synthetic import TEXT_LENGTH, TEXT_LENGTH_LIMIT, synthetic_conditioning_for
from . import ids


class SyntheticConditioning(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id=ids.SYNTHETIC_CONDITIONING,
            display_name="Synthetic FLUX Conditioning (FluxAccel benchmark)",
            category=f"{ids.CATEGORY}/testing",
            description="Seeded random T5/CLIP-shaped conditioning for benchmarks and tests without text "
                        "encoders. Images made with it are noise-like by design.",
            inputs=[
                io.Model.Input("model", tooltip="The FLUX model the conditioning is for (gives its text widths)."),
                io.Int.Input("text_length", default=TEXT_LENGTH, min=1, max=TEXT_LENGTH_LIMIT,
                             tooltip="Text tokens (256: ComfyUI's FLUX.1 padding of a short prompt; FLUX.2 pads to "
                                     "512 itself)."),
                io.Float.Input("guidance", default=3.5, min=0.0, max=100.0, step=0.1,
                               tooltip="FLUX guidance embedding value (ignored by schnell)."),
                io.Int.Input("seed", default=0, min=0, max=2**31 - 1, control_after_generate=True,
                             tooltip="Seed of the random conditioning."),
            ],
            outputs=[io.Conditioning.Output(tooltip="Random conditioning of the model's text and pooled widths, "
                                                    "for Warmup, Benchmark or a sampler's positive and negative.")],
        )

    @classmethod
    def execute(cls, model, text_length, guidance, seed) -> io.NodeOutput:
        dm = require_flux(model, "Synthetic FLUX Conditioning", "makes conditioning for")
        return io.NodeOutput(synthetic_conditioning_for(dm, text_length, guidance=guidance, seed=seed))
