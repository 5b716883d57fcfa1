from comfy_api.latest import io

from ..core.models.flux import require_flux
from ..core.models.synthetic import synthetic_conditioning_for
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
                io.Int.Input("text_length", default=256, min=1, max=4096,
                             tooltip="Text tokens: 256 is ComfyUI's FLUX.1 padding, 512 common for FLUX.1-dev; FLUX.2 pads to 512."),
                io.Float.Input("guidance", default=3.5, min=0.0, max=100.0, step=0.1,
                               tooltip="FLUX guidance embedding value (ignored by schnell)."),
                io.Int.Input("seed", default=0, min=0, max=2**31 - 1, control_after_generate=True,
                             tooltip="Seed of the random conditioning."),
            ],
            outputs=[io.Conditioning.Output()],
        )

    @classmethod
    def execute(cls, model, text_length, guidance, seed) -> io.NodeOutput:
        dm = require_flux(model, "Synthetic FLUX Conditioning")
        return io.NodeOutput(synthetic_conditioning_for(dm, text_length, guidance=guidance, seed=seed))
