"""What current ComfyUI (0.33 and newer) puts between FluxAccel and the FLUX weights, and how each is met.

  * dynamic VRAM (ModelPatcherDynamic, on by default on NVIDIA GPUs with torch >= 2.8): weights are cast per call
    through comfy-aimdo's VBAR slots, so their addresses are not fixed and the compiler breaks the graph at every
    Linear. Our nodes work on ComfyUI's non-dynamic delegate of the model (`get_non_dynamic_delegate`, the same
    reload core's TorchCompileModel makes with `clone(disable_dynamic=True)`): the checkpoint loaded a second time
    as a plain, fully resident ModelPatcher, cached on the dynamic patcher. Other branches keep dynamic VRAM.
  * core's own per-block CUDA graphs and, from 0.34, the Comfy model compiler (a malloc graph around them), for
    dynamic-VRAM models of other families: FLUX's forward does not use them; modules core has captured are refused for
    our compile, and our compiled call runs with a recording paused (upstream/comfy_internals.py).
  * weights that are already tensor subclasses other than torchao's (mixed-precision / scaled-FP8 checkpoints:
    ComfyUI's QuantizedTensor) are found here; fp8_patch decides what to do with them.
"""
from __future__ import annotations

import torch

from ..errors import FluxAccelError
from ..upstream import Unavailable, comfy_internals, torch_internals
from . import swaps
from .resident import is_dynamic, resident  # noqa: F401 -- the resident model, re-exported for the patches

_OURS = ("fluxaccel",)
PARALLEL_KEY = "fluxaccel.parallel"  # the Parallel node's ModelPatcher attachment and wrapper key (core/parallel)


def compiled_elsewhere(model) -> list[str]:
    """Parts of the model another node compiled or captured: compiled modules of their own (object patches,
    submodules), ComfyUI's own per-block CUDA graphs."""
    found = [f"compiled object patch {key}" for key, obj in swaps.items(model) if torch_internals.is_compiled_module(obj)]
    dm = model.model.diffusion_model
    found += [f"compiled submodule diffusion_model.{name}" for name, mod in dm.named_modules()
              if name and torch_internals.is_compiled_module(mod)]
    return found + [f"ComfyUI per-block CUDA graph on {name}" for name in comfy_internals.core_graph_modules(dm)]


def is_checkpoint_quantized(t) -> bool:
    cls = comfy_internals.quantized_tensor_class()
    return cls is not None and isinstance(t, cls)


def linear_like(mod) -> bool:
    """An nn.Linear, or a Linear of ComfyUI's MixedPrecisionOps (not an nn.Linear; a 2-D weight, maybe quantized)."""
    if isinstance(mod, torch.nn.Linear):
        return True
    w = getattr(mod, "weight", None)
    return (type(mod).__name__ == "Linear" and isinstance(getattr(mod, "in_features", None), int)
            and isinstance(getattr(mod, "out_features", None), int) and isinstance(w, torch.Tensor) and w.ndim == 2)


def checkpoint_format(mod) -> str:
    """How a checkpoint stored this Linear's weight: e.g. 'float8_e4m3fn (TensorCoreFP8E4M3Layout)'."""
    qdata = comfy_internals.checkpoint_qdata(getattr(mod, "weight", None))
    fmt = getattr(mod, "quant_format", None) or (str(qdata.dtype).replace("torch.", "")
                                                 if isinstance(qdata, torch.Tensor) else "quantized")
    layout = getattr(mod, "layout_type", None)
    return f"{fmt} ({layout})" if layout else fmt


def kitchen_quantized(dm, replaced=()) -> list[str]:
    """Parameters held as a tensor subclass other than torchao's (e.g. ComfyUI's QuantizedTensor), except those of
    modules in `replaced` (object-patch keys such as 'diffusion_model.img_in': swapped in at load, e.g. by Quantize
    FP8, so the stored module never runs)."""
    out = []
    for name, p in dm.named_parameters():
        if f"diffusion_model.{name.rpartition('.')[0]}" in replaced:
            continue
        cls = type(p.data) if isinstance(p, torch.nn.Parameter) else type(p)
        if cls is not torch.Tensor and not cls.__module__.startswith("torchao"):
            out.append(f"{name} ({cls.__name__})")
    return out


def require_compatible(model, dm, node: str, quantized_ok: bool = False) -> None:
    """After resident(): refuse what FluxAccel cannot work on, saying what to do. quantized_ok: the caller
    (Quantize FP8) handles checkpoint-quantized weights itself."""
    if is_dynamic(model):
        raise FluxAccelError(f"{node}: internal error: a dynamic-VRAM model reached FluxAccel without its resident "
                             f"copy; start ComfyUI with --disable-dynamic-vram and report this.")
    kitchen = [] if quantized_ok else kitchen_quantized(dm, replaced={k for k, _ in swaps.items(model)})
    if kitchen:
        raise FluxAccelError(
            f"{node}: this model's weights are already quantized by ComfyUI's mixed-precision ops "
            f"({', '.join(kitchen[:3])}{', ...' if len(kitchen) > 3 else ''}). Put Quantize FP8 (FluxAccel) before "
            f"this node: it re-quantizes such checkpoints (and dequantizes the layers it keeps in bf16).")
