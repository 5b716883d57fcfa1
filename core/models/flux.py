"""Recognise a FLUX ModelPatcher and refuse, with a clear message, what we cannot accelerate."""
from __future__ import annotations

from dataclasses import dataclass

from comfy.patcher_extension import CallbacksMP
import torch

from ..errors import FluxAccelError
from .loaded import require_compatible, resident
from .patcher import own_clone, owner_of
from .profiles import Profile, require_profile

FP8_DTYPES = tuple(
    getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz") if hasattr(torch, n)
)


def diffusion_model(model) -> torch.nn.Module:
    return model.get_model_object("diffusion_model")


def require_flux(model, node: str, does: str = "accelerates", name: str = "model") -> torch.nn.Module:
    """Return the diffusion model of a ComfyUI MODEL of a supported FLUX architecture (profiles.py), or raise naming
    what its input `name` received and what the node does ("<node> accelerates FLUX.1 ...")."""
    base = getattr(model, "model", None)
    dm = getattr(base, "diffusion_model", None)
    kind = type(base).__name__ if base is not None else type(model).__name__
    require_profile(dm, kind, node, does, name)
    return dm


def profile(model, node: str = "FluxAccel") -> Profile:
    """The profile of a MODEL (require_flux's check, returning the profile)."""
    return require_profile(model.model.diffusion_model, type(model.model).__name__, node)


def latent_scale(model) -> int:
    """Pixels per latent cell of a MODEL: 8 for FLUX.1 and Chroma, 16 for FLUX.2 (its latent format says)."""
    return int(getattr(model.model.latent_format, "spacial_downscale_ratio", 8))


def token_px(dm: torch.nn.Module, scale: int) -> int:
    """Pixels per token side of a FLUX diffusion model: `scale` pixels per latent cell (latent_scale) times its patch
    (2x2 cells in FLUX.1 and Chroma, one cell of FLUX.2's 16x latent): 16 in each."""
    return scale * int(getattr(dm, "patch_size", 2))


def require_fully_loaded(model, node: str) -> None:
    """A model that ComfyUI could only partially load (lowvram) streams weights per layer: refuse it."""
    if getattr(model.model, "model_lowvram", False):
        raise FluxAccelError(
            f"{node}: ComfyUI loaded this FLUX model only partially (lowvram: some weights stay in CPU RAM and "
            f"are copied per layer), which FP8 weights and CUDA graphs cannot use. Free VRAM (unload other models, "
            f"lower the batch) or start ComfyUI with --highvram (or --gpu-only) so the model loads completely."
        )


def require_bf16_weights(modules, node: str) -> None:
    """Refuse checkpoints stored in FP8 or loaded with UNETLoader weight_dtype fp8 (ComfyUI then keeps the
    weights in FP8 and casts them per layer)."""
    fp8 = sorted({str(p.dtype) for m in modules for p in m.parameters() if p.dtype in FP8_DTYPES})
    if fp8:
        raise FluxAccelError(
            f"{node}: this FLUX model's weights are already stored in reduced precision ({', '.join(fp8)}: an FP8 "
            f"checkpoint, or UNETLoader weight_dtype fp8_e4m3fn/fp8_e5m2). FluxAccel quantizes from bf16 weights: "
            f"load the bf16 checkpoint with weight_dtype 'default', or skip the Quantize FP8 node for this model."
        )


def on_load_callback_type() -> str:
    return CallbacksMP.ON_LOAD


def partial_load_guard(node: str):
    """An ON_LOAD callback refusing ComfyUI's lowvram (partial) loads of a patched model at sampling time."""
    def on_load(patcher, device_to, lowvram_model_memory, force_patch_weights, full_load):
        require_fully_loaded(patcher, node)

    return on_load


@dataclass(frozen=True)
class FluxModel:
    """A MODEL as a FluxAccel node works on it, checked once: the resident patcher (resident.py: fixed weights, for a
    dynamic-VRAM model a copy sharing its storage), its diffusion model and architecture profile, and the node that
    asked (its name is in every message)."""

    model: object
    dm: torch.nn.Module
    profile: Profile
    node: str

    @classmethod
    def of(cls, model, node: str, quantized_ok: bool = False) -> "FluxModel":
        """The checked resident model, or an error saying what to do. quantized_ok: the caller (Quantize FP8)
        handles checkpoint-quantized weights itself."""
        require_flux(model, node)
        model = resident(model, node)
        dm = require_flux(model, node)
        require_fully_loaded(model, node)
        require_compatible(model, dm, node, quantized_ok)
        return cls(model, dm, profile(model, node), node)

    def clone(self):
        """A clone of the model of FluxAccel's patcher class (patcher.py): what every FluxAccel node returns."""
        return own_clone(self.model)

    @property
    def owner(self):
        """The FP8 set whose Linears this model runs (its weights owner, quant/store.py), if any."""
        return owner_of(self.model)

    @property
    def device(self) -> torch.device:
        """Where ComfyUI runs the model."""
        return torch.device(self.model.load_device)

    @property
    def scale(self) -> int:
        return latent_scale(self.model)

    @property
    def references(self) -> bool:
        return self.profile.references

    @property
    def on_load_type(self) -> str:
        return on_load_callback_type()

    @property
    def partial_load_guard(self):
        return partial_load_guard(self.node)
