"""What FluxAccel knows of each FLUX architecture, read from ComfyUI's own model objects (classes and FluxParams
flags, never names or file names): which Linears each Quantize FP8 scope takes, which blocks form compile regions,
which call inputs make the compiled signature, and what is refused and why.

  FLUX.1  comfy.ldm.flux.model.Flux without global modulation: dev, schnell, Fill (extra input channels),
          Kontext (reference latents appended to the image tokens) and fine-tunes. Modulation Linears live in
          every block (img_mod / txt_mod / modulation).
  FLUX.2  the same class with FluxParams.global_modulation ([dev] 32B, [klein] 4B/9B): three shared modulation
          Linears outside the blocks, gated-SiLU MLPs, no biases, reference latents (multi-reference editing).
  Chroma  comfy.ldm.chroma.model.Chroma: FLUX.1-schnell's blocks without per-block modulation; a distilled
          guidance network (the Approximator) computes every block's modulation once per call.

Everything else (Chroma Radiance's pixel-space model, other families) is refused by name.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..errors import FluxAccelError

_IN_BLOCKS = re.compile(r"^(double_blocks|single_blocks)\.\d+\.")


@dataclass(frozen=True)
class Profile:
    """One FLUX architecture as FluxAccel treats it.

    modulation: names (diffusion-model relative) of the Linears that compute modulation -- kept in bf16 by scope
      'blocks' (one token per image: tiny GEMMs whose error reaches every block), quantized by 'blocks+modulation'.
    references: whether the model takes reference latents (ref_latents), which are then part of the compiled
      signature.
    """

    name: str
    modulation: str
    references: bool
    summary: str

    def in_scope(self, name: str, scope: str) -> bool:
        """Whether Quantize FP8's `scope` takes the Linear `name` ('double_blocks.0.img_attn.qkv', ...)."""
        if scope == "all_linear":
            return True
        modulation = re.search(self.modulation, name) is not None
        if modulation:
            return scope == "blocks+modulation"
        return _IN_BLOCKS.match(name) is not None

    def variant(self, dm: torch.nn.Module) -> str:
        """What of this architecture a model is, for messages and results ('FLUX.1 Fill', 'FLUX.2', ...)."""
        params = getattr(dm, "params", None)
        if self.name == "FLUX.1" and params is not None:
            if params.in_channels > params.out_channels:
                return "FLUX.1 Fill"
            if not params.guidance_embed:
                return "FLUX.1 schnell"
        return self.name


FLUX1 = Profile(
    "FLUX.1", modulation=r"^(double_blocks|single_blocks)\.\d+\.(img_mod|txt_mod|modulation)\.lin$", references=True,
    summary="FLUX.1 dev, schnell, Fill, Kontext and fine-tunes")
FLUX2 = Profile(
    "FLUX.2", modulation=r"^(double_stream_modulation_img|double_stream_modulation_txt|single_stream_modulation)\.lin$",
    references=True, summary="FLUX.2 [dev] and [klein]")
CHROMA = Profile(
    "Chroma", modulation=r"^distilled_guidance_layer\.", references=False, summary="Chroma")
PROFILES: tuple[Profile, ...] = (FLUX1, FLUX2, CHROMA)


def _classes() -> dict[str, type]:
    """ComfyUI's diffusion-model classes this host has (a release without Chroma has no entry for it)."""
    found = {}
    for key, module, name in (("flux", "comfy.ldm.flux.model", "Flux"), ("chroma", "comfy.ldm.chroma.model", "Chroma"),
                              ("radiance", "comfy.ldm.chroma_radiance.model", "ChromaRadiance")):
        try:
            mod = __import__(module, fromlist=[name])
        except ImportError:
            continue
        cls = getattr(mod, name, None)
        if isinstance(cls, type):
            found[key] = cls
    return found


def profile_of(dm) -> Profile | None:
    """The profile of a diffusion model, from its class and FluxParams; None if FluxAccel does not accelerate it."""
    if dm is None or not (hasattr(dm, "double_blocks") and hasattr(dm, "single_blocks")):
        return None
    classes = _classes()
    radiance = classes.get("radiance")
    if radiance is not None and isinstance(dm, radiance):
        return None  # a subclass of Chroma: pixel space, its own NeRF head
    chroma = classes.get("chroma")
    if chroma is not None and isinstance(dm, chroma):
        return CHROMA
    flux = classes.get("flux")
    if flux is None or not isinstance(dm, flux):
        return None
    return FLUX2 if getattr(getattr(dm, "params", None), "global_modulation", False) else FLUX1


SUPPORTED = "FLUX.1 (dev, schnell, Fill, Kontext and fine-tunes), FLUX.2 ([dev], [klein]) and Chroma"


def require_profile(dm, kind: str, node: str, does: str = "accelerates", name: str = "model") -> Profile:
    """The profile of `dm`, or an error naming what was received and what the node does for which models."""
    found = profile_of(dm)
    if found is not None:
        return found
    inner = type(dm).__name__ if dm is not None else "none"
    why = (" (Chroma Radiance works in pixel space with its own decoder head, which FluxAccel does not accelerate)"
           if inner == "ChromaRadiance" else "")
    raise FluxAccelError(
        f"{node} {does} {SUPPORTED} diffusion models, but its {name} input received a {kind} model (diffusion model class "
        f"{inner}){why}. Connect the MODEL output of a supported checkpoint or UNETLoader, or bypass this node for "
        f"this model.")
