"""Put a CompiledFlux into a ComfyUI ModelPatcher clone through a keyed APPLY_MODEL wrapper.

As ComfyUI's own set_torch_compile_wrapper does: the wrapper swaps BaseModel.diffusion_model for the compiled
callable for the duration of one apply_model call and restores it in `finally`; any previous wrapper under our
key is removed first. The loaded model and other branches are never compiled.
"""
from __future__ import annotations

import logging
import weakref

from comfy.patcher_extension import WrappersMP
import torch

from ..env import require_torch
from ..errors import FluxAccelError
from ..models import swaps
from ..models.flux import FluxModel, on_load_callback_type
from ..models.loaded import PARALLEL_KEY, compiled_elsewhere
from ..upstream import Unavailable, comfy_internals, torch_internals
from . import fp8_attention, mod_table, single_block
from .compiled import CompiledFlux, Setup
from .config import NODE, CompileConfig
from .keys import cache_key
from .staging import staging_wrapper

log = logging.getLogger("fluxaccel.compile")

COMPILE_KEY = "fluxaccel.compile"
KEEP = 4  # compiled models kept per loaded model for its later clones (another LoRA strength reuses one)
_COMPILED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # BaseModel -> {what it depends on: CompiledFlux}
COMFY_COMPILE_KEY = comfy_internals.COMFY_COMPILE_KEY


def _apply_model_type() -> str:
    return WrappersMP.APPLY_MODEL


def capture_unavailable(device: torch.device) -> str:
    """Why FluxAccel cannot capture model calls into CUDA graphs here ('' where it can): graphs need a CUDA device,
    and the compiled blocks' C++ wrapper (which runs under any CUDA allocator) a C++ compiler."""
    kind = torch.device(device).type
    if kind != "cuda":
        return f"this model runs on {'the CPU' if kind == 'cpu' else kind}; CUDA graphs need a CUDA GPU"
    cc = torch_internals.cpp_compiler()
    if isinstance(cc, Unavailable):
        return f"{cc}: the C++ wrapper's build cannot be checked"
    if not cc:
        return "no C++ compiler for inductor's C++ wrapper was found (install g++, or set CXX)"
    return ""


def _replace_comfy_compile(clone) -> None:
    """ComfyUI's own torch.compile wrapper (TorchCompileModel, whole model or per block) is replaced by FluxAccel's
    compile, which compiles the blocks itself: removed from the clone, said in the log."""
    wt = _apply_model_type()
    if clone.get_wrappers(wt, COMFY_COMPILE_KEY):
        log.info("FluxAccel: replacing ComfyUI's torch.compile wrapper (TorchCompileModel) with FluxAccel's compile")
        clone.remove_wrappers_with_key(wt, COMFY_COMPILE_KEY)
        clone.model_options.pop("torch_compile_kwargs", None)


def _install(clone, compiled: CompiledFlux):
    """Put `compiled` on `clone` (already a clone): our one keyed APPLY_MODEL wrapper, replacing any earlier one, and
    the CompiledFlux as the clone's COMPILE_KEY attachment (read by Warmup, Benchmark and the editor badge). On a GPU
    the wrapper first copies the sampler's CPU inputs there through pinned memory (staging.py)."""
    wt = _apply_model_type()
    clone.remove_wrappers_with_key(wt, COMPILE_KEY)
    wrapper = comfy_internals.swap_in_wrapper({"diffusion_model": compiled})
    if compiled.device.type == "cuda":
        wrapper = staging_wrapper(wrapper, compiled.device, compiled.stats)
    clone.add_wrapper_with_key(wt, COMPILE_KEY, wrapper)
    clone.set_attachments(COMPILE_KEY, compiled)
    return clone, compiled


def apply_compile(model, cfg: CompileConfig, node: str = NODE):
    """Return (a clone of `model` whose diffusion model runs its blocks compiled and each call captured, the
    CompiledFlux); the input model is unchanged."""
    require_torch(node)
    flux = FluxModel.of(model, node)  # the resident model, checked: what FluxAccel can accelerate
    device = flux.device
    owner, clone = flux.owner, flux.clone()
    _replace_comfy_compile(clone)
    capture = capture_unavailable(device)
    options = cfg.inductor_options(capture=not capture)
    other = compiled_elsewhere(flux.model)
    if other:
        raise FluxAccelError(
            f"{node}: parts of this model are already compiled or captured by another node ({'; '.join(other)}). "
            f"FluxAccel compiles each FLUX block itself and captures the whole model call, which cannot run another "
            f"node's compiled or captured blocks inside it: remove the other node, or load the model again for "
            f"FluxAccel.")
    if flux.model.get_attachment(PARALLEL_KEY) is not None:
        raise FluxAccelError(f"{node}: this model runs across GPUs (Parallel), whose workers compile its blocks "
                             f"themselves. Remove Compile + CUDA Graph, or the Parallel node.")
    why_fp8 = fp8_attention.why_not(device) if cfg.attention == "fp8" else ""
    if why_fp8:
        raise FluxAccelError(f"{node}: attention 'fp8' cannot run here: {why_fp8}. Set attention to 'cudnn'.")
    # a compiled model of this loaded model with the same config, device and FP8 Linears (another LoRA strength, ...)
    # serves this clone too: its compiled blocks, caches, CUDA graphs and table
    reuse = (cfg, str(device), owner.generations.serial if owner is not None else None, _object_patches(clone))
    kept = _COMPILED.setdefault(flux.model.model, {})
    earlier = kept.get(reuse)
    table, why_table = mod_table.for_clone(clone, flux.model, flux.dm, device,
                                           earlier.runner.mod_table if earlier is not None else None)
    if earlier is not None and table is earlier.runner.mod_table:
        log.info("FluxAccel: %s: the same model, config and FP8 Linears as a model compiled before: its compiled "
                 "blocks and CUDA graphs serve this one", node)
        compiled = earlier.again()
    else:
        degraded = {  # what runs below what FluxAccel could do here, and why: the stats (node text, badge), the log
            "CUDA graphs": capture if device.type == "cuda" else "",  # on a GPU graphs were expected
            "modulation table": why_table,
            "single blocks' fused input": single_block.why_off(flux.model, flux.dm),
            "FP8 attention's Q/K scales from the QK-norm bound":
                fp8_attention.why_qk_bound_off(flux.dm) if cfg.attention == "fp8" else ""}
        degraded = tuple((what, why) for what, why in degraded.items() if why)
        for what, why in degraded:
            log.warning("FluxAccel: %s runs without %s: %s", node, what, why)
        setup = Setup(device, options, cache_key(clone, cfg, device, options), capture, flux.scale, flux.references,
                      table, degraded)
        compiled = kept[reuse] = CompiledFlux(flux.dm, cfg, setup)
        while len(kept) > KEEP:
            del kept[next(iter(kept))]
    clone.add_callback_with_key(flux.on_load_type, COMPILE_KEY, flux.partial_load_guard)
    return _install(clone, compiled)


def _object_patches(clone) -> tuple:
    """What the clone's object patches swap, by key and kind (FluxAccel's FP8 blocks, other nodes' modules)."""
    return tuple(sorted((k, type(v).__name__) for k, v in clone.object_patches.items()))


def compiled_of(model) -> CompiledFlux | None:
    """The CompiledFlux Compile (or Warmup) put on this model, if any: its COMPILE_KEY attachment, while our wrapper
    is on the model (a clone that dropped the wrapper runs uncompiled, whatever it still carries)."""
    if not model.get_wrappers(_apply_model_type(), COMPILE_KEY):
        return None
    return model.get_attachment(COMPILE_KEY)


def with_own_shapes(model):
    """(clone, its CompiledFlux): a clone of a compiled model whose CompiledFlux is derived from the input's (own
    allowed shapes and stats), for a node that registers shapes (Warmup); (model, None) if it is not compiled."""
    compiled = compiled_of(model)
    if compiled is None:
        return model, None
    return _install(model.clone(), compiled.derive())


def remove_compile(model):
    """A clone running the uncompiled model (the Benchmark's default baseline)."""
    if compiled_of(model) is None:
        return model

    clone = model.clone()
    clone.remove_wrappers_with_key(_apply_model_type(), COMPILE_KEY)
    clone.remove_callbacks_with_key(on_load_callback_type(), COMPILE_KEY)
    clone.remove_attachments(COMPILE_KEY)
    # ComfyUI's modulations again (the table belongs to the compiled model)
    swaps.remove(clone, [k for k, v in swaps.items(clone) if isinstance(v, mod_table.TableModulation)])
    return clone
