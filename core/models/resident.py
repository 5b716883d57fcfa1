"""The resident model FP8 copies and CUDA graphs need, for a model that ComfyUI 0.33+ loads with dynamic VRAM.

A dynamic-VRAM model (ModelPatcherDynamic) streams its weights to the GPU per call through comfy-aimdo, so their
addresses are not fixed. FluxAccel works on a plain ModelPatcher of the same model instead. ComfyUI's own answer,
its non-dynamic delegate, loads the checkpoint file a second time: a second host copy of every weight (2 x 64 GB for
FLUX.2 [dev]). FluxAccel builds that resident model from the dynamic one instead: new module objects whose
parameters share the dynamic model's storage (for UNETLoader files, comfy-aimdo's mapping of the file), so nothing
is read or copied until ComfyUI moves the weights to the GPU. It is built once per dynamic model (BaseModel) and kept
where ComfyUI keeps each patcher's delegate, so every clone of that model -- a LoRA node's, another strength's --
resolves to the same resident model, with the same patch backups, as clones of a plain model do: ComfyUI then switches
between them as between clones (and FluxAccel's FP8 Linears and compiled model are found again).

Where this ComfyUI keeps the delegate elsewhere, or the dynamic model's weights are not where the file put them,
FluxAccel says so and uses ComfyUI's delegate (the second host copy).
"""
from __future__ import annotations

import logging
import weakref

import torch

from ..errors import FluxAccelError
from ..upstream import Unavailable, comfy_internals, say, torch_internals

log = logging.getLogger("fluxaccel.compat")


def is_dynamic(model) -> bool:
    """ComfyUI 0.33's own answer (ModelPatcher.is_dynamic); False on releases without dynamic VRAM."""
    fn = getattr(model, "is_dynamic", None)
    return bool(fn()) if callable(fn) else False


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr() if type(t) is torch.Tensor or type(t) is torch.nn.Parameter else id(t)


def shares_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    """Whether two models' parameters of the same name hold the same storage (all of them)."""
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    return pa.keys() == pb.keys() and all(_storage(pa[k]) == _storage(pb[k]) for k in pa)


def _unpatched(model) -> str:
    """Why the dynamic model's live tree is not its stored weights right now ('' when it is)."""
    moved = [(n, p.device) for n, p in model.model.named_parameters() if p.device != torch.device(model.offload_device)]
    if moved:
        return f"{len(moved)} weights are on {moved[0][1]} (e.g. {moved[0][0]})"
    if model.backup or model.object_patches_backup:
        return "patched weights or modules are applied to it"
    return ""


_SHARED: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()  # the resident copies built here (for the log)
_STANDS_IN: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()  # every BaseModel resident() gave for a dynamic one
KEPT = "_fluxaccel_resident"  # on the dynamic BaseModel: its resident model and patch backups (a delegate override)

RELOAD = ("FluxAccel uses ComfyUI's non-dynamic delegate: the checkpoint is loaded once more (a second host copy of "
          "its weights)")


def shared_copy(model) -> torch.nn.Module | Unavailable | str:
    """The BaseModel's resident copy over the same storage, or why it cannot be made."""
    why = _unpatched(model)
    if why:  # loaded for another branch: ComfyUI's own unload restores the stored weights
        unloaded = comfy_internals.unload_model_and_clones(model)
        if isinstance(unloaded, Unavailable):
            return unloaded
        why = _unpatched(model)
        if why:
            return f"its weights are not as stored after unloading: {why}"
    base = model.model
    copy = torch_internals.share_module_tree(base, drop=comfy_internals.DYNAMIC_MODULE_STATE + (KEPT,))
    if isinstance(copy, Unavailable):
        return copy
    for name in comfy_internals.patcher_model_state(base):  # ModelPatcher.__init__ starts these afresh
        copy.__dict__.pop(name, None)
    if not shares_weights(copy, base):
        return "its parameters could not be shared"
    _SHARED.add(copy)
    return copy


def resident(model, node: str):
    """The model with fixed, fully resident weights that FP8 copies and CUDA graphs need.

    A dynamic-VRAM patcher gives a plain ModelPatcher of the same weights, patches, options and wrappers: one resident
    model per dynamic model, sharing the weights' storage (ComfyUI's reloading delegate where that cannot be done),
    kept by each of its patchers. Any other model is returned as it is.
    """
    if not is_dynamic(model):
        return model
    kept = comfy_internals.kept_delegate(model)
    if kept is None:  # this patcher has none yet: its model's, else one sharing the dynamic model's weights
        shared = model.model.__dict__.get(KEPT)
        if shared is None:
            copy = shared_copy(model)
            shared = comfy_internals.delegate_override(model, copy) if isinstance(copy, torch.nn.Module) else copy
            if isinstance(shared, tuple):
                model.model.__dict__[KEPT] = shared
        kept = comfy_internals.keep_delegate(model, shared) if isinstance(shared, tuple) else shared
    if isinstance(kept, Unavailable):
        say(kept, RELOAD)
    elif isinstance(kept, str):
        log.warning("FluxAccel: %s: this dynamic-VRAM model's weights cannot be shared (%s): %s", node, kept, RELOAD)
    try:
        delegate = model.get_non_dynamic_delegate()
    except RuntimeError as e:  # a custom loader that registered no cached_patcher_init: nothing to reload from
        raise FluxAccelError(
            f"{node}: ComfyUI's dynamic VRAM streams this model's weights on demand, and the node that loaded it gives "
            f"no way to load them as fixed, resident weights ({e}). Load the model with UNETLoader (Load Diffusion "
            f"Model) or CheckpointLoaderSimple, or start ComfyUI with --disable-dynamic-vram.") from e
    if is_dynamic(delegate):
        raise FluxAccelError(f"{node}: ComfyUI returned a dynamic-VRAM model where a resident one was asked for "
                             f"({type(delegate).__name__}); start ComfyUI with --disable-dynamic-vram.")
    _STANDS_IN.add(delegate.model)
    if KEPT not in model.model.__dict__ and isinstance(comfy_internals.kept_delegate(model), tuple):
        model.model.__dict__[KEPT] = comfy_internals.kept_delegate(model)  # ComfyUI's reload, kept for its clones too
    if delegate.model in _SHARED:
        log.info("FluxAccel: %s works on a resident copy of this dynamic-VRAM model that shares its weights (no "
                 "second host copy)", node)
    else:
        log.info("FluxAccel: %s works on ComfyUI's non-dynamic delegate of this dynamic-VRAM model (its weights "
                 "take host RAM once more)", node)
    return delegate


def stands_in_for_dynamic(base) -> bool:
    """Whether this BaseModel is one resident() gave for a dynamic-VRAM model (its copy, or ComfyUI's delegate)."""
    return base in _STANDS_IN
