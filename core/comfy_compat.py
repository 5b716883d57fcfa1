"""Newer ComfyUI features that conflict with FluxAccel, detected by what they leave on a model.

Tests run on ComfyUI 0.3.75, which has none of these; newer releases add:
  * dynamic VRAM (ModelPatcherDynamic: weights streamed on demand, addresses not fixed)  -> --disable-dynamic-vram
  * comfy-kitchen / mixed-precision ops (weights already quantized tensors)             -> load bf16 weights
  * a built-in per-block CUDA-graph compiler (wrappers/attachments on the model)        -> remove it for our model
Detection is by class and key names, so it keeps working without importing the newer modules.
"""
from __future__ import annotations

from .errors import FluxAccelError

_OURS = ("fluxaccel",)
_COMPILER_WORDS = ("cuda_graph", "cudagraph", "compiler")


def dynamic_vram(model) -> bool:
    return any("Dynamic" in cls.__name__ for cls in type(model).__mro__)


def foreign_graph_compilers(model) -> list[str]:
    """Wrapper or attachment keys of another CUDA-graph compiler on this model (ComfyUI's own or a plugin's)."""
    found = []
    for wtype, by_key in getattr(model, "wrappers", {}).items():
        for key, fns in by_key.items():
            if fns and not key.startswith(_OURS) and any(w in key.lower() for w in _COMPILER_WORDS):
                found.append(f"{wtype} wrapper '{key}'")
    for key in getattr(model, "attachments", {}):
        if not key.startswith(_OURS) and any(w in key.lower() for w in _COMPILER_WORDS):
            found.append(f"attachment '{key}'")
    return found


def kitchen_quantized(dm) -> list[str]:
    """Parameters held as a tensor subclass other than torchao's (e.g. ComfyUI's QuantizedTensor)."""
    import torch

    out = []
    for name, p in dm.named_parameters():
        cls = type(p.data) if isinstance(p, torch.nn.Parameter) else type(p)
        if cls is not torch.Tensor and not cls.__module__.startswith("torchao"):
            out.append(f"{name} ({cls.__name__})")
    return out


def require_compatible(model, dm, node: str) -> None:
    if dynamic_vram(model):
        raise FluxAccelError(
            f"{node}: ComfyUI's dynamic VRAM manages this model ({type(model).__name__}): it streams weights on "
            f"demand, so FP8 copies and CUDA graphs cannot keep fixed weights. Start ComfyUI with "
            f"--disable-dynamic-vram to use FluxAccel.")
    kitchen = kitchen_quantized(dm)
    if kitchen:
        raise FluxAccelError(
            f"{node}: this model's weights are already quantized by ComfyUI's mixed-precision ops "
            f"({', '.join(kitchen[:3])}{', ...' if len(kitchen) > 3 else ''}). Load the bf16 checkpoint "
            f"(UNETLoader weight_dtype 'default') to use FluxAccel, or skip FluxAccel for this model.")
