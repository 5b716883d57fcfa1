"""The ModelPatcher class of every clone a FluxAccel node makes: ComfyUI's own class (whatever the loader gave) with
its weight-patching methods extended, so that ComfyUI's load / unpatch lifecycle -- its per-key patch lists,
its backups and patches_uuid -- decides every weight write, including the FP8 Linears', and each write is counted
(generations.py).

  * patch_weight_to_device(key): a key whose weight an FP8 set holds (the clone's OWNER attachment, quant/store.py)
    is merged there in place from its stored bf16 weight, where this clone's patches differ from what the Linear
    holds; every other key is ComfyUI's own patching (a new tensor, as ComfyUI writes it: a resident copy's stored
    weights share their storage with the dynamic-VRAM model's, which must never be written), counted.
  * unpatch_model / partially_unload: ComfyUI's restore of its backups, counted.
  * patch_hook_weight_to_device / unpatch_hooks / patch_cached_hook_weights: ComfyUI's hook LoRAs (Create Hook LoRA,
    keyframes) on an FP8 weight are merged into the FP8 Linear on top of the clone's patches, exactly as ComfyUI
    applies a hook on top of a patched bf16 weight; restored to the clone's patches when the hooks go.
  * partially_load: switching between two clones of one fully loaded model (another LoRA strength) restores the
    first clone's patches in place instead of moving the whole model to the offload device and back, then loads the
    second as ComfyUI does. The weights keep their addresses: compiled kernels and CUDA graphs stay valid.

The class is made per ComfyUI patcher class (a GGUF or other custom patcher keeps its own overrides beneath ours).
"""
from __future__ import annotations

import logging
import uuid

from ..errors import FluxAccelError
from ..upstream import Unavailable, comfy_internals
from .generations import of_model
from .resident import stands_in_for_dynamic

log = logging.getLogger("fluxaccel.patches")

OWNER = "fluxaccel.weights_owner"  # ModelPatcher attachment: the object that writes some of this clone's weights


def owner_of(model):
    """The weights owner (an FP8 set) on this clone, if any."""
    get = getattr(model, "get_attachment", None)
    return get(OWNER) if callable(get) else None


class FluxAccelPatching:
    """The mixin: see the module docstring. Each method ends in ComfyUI's own."""

    fluxaccel_patcher = True

    def patch_weight_to_device(self, key, device_to=None, inplace_update=False, return_weight=False, *args, **kwargs):
        owner = owner_of(self)
        if owner is not None and owner.owns(key):
            if return_weight:  # a caller asking for the patched value (e.g. saving the model): not an FP8 weight's
                return super().patch_weight_to_device(key, device_to, inplace_update, return_weight, *args, **kwargs)
            owner.bring(self, key, hooks=None)
            return None
        out = super().patch_weight_to_device(key, device_to, inplace_update, return_weight, *args, **kwargs)
        if not return_weight and key in self.patches:
            gens = of_model(self.model)
            gens.bump((key,))
            gens.patched.add(key)
        return out

    def load(self, *args, **kwargs):
        _written_elsewhere(self)
        owner = owner_of(self)
        before = (owner.merges, owner.merge_s) if owner is not None else None
        out = super().load(*args, **kwargs)
        of_model(self.model).applied = comfy_internals.weight_patches_uuid(self.model)
        if before is not None and owner.merges != before[0]:
            log.info("FluxAccel: this prompt's weight patches merged into %d FP8 Linears in place in %.2f s",
                     owner.merges - before[0], owner.merge_s - before[1])
        return out

    def unpatch_model(self, device_to=None, unpatch_weights=True, *args, **kwargs):
        if unpatch_weights:
            _written_elsewhere(self)
            gens = of_model(self.model)
            gens.bump(list(self.backup))
            gens.patched.difference_update(self.backup)
        out = super().unpatch_model(device_to, unpatch_weights, *args, **kwargs)
        if unpatch_weights:
            of_model(self.model).applied = None
        return out

    def partially_unload(self, *args, **kwargs):
        before = set(self.backup)
        try:
            return super().partially_unload(*args, **kwargs)
        finally:
            restored, gens = before - set(self.backup), of_model(self.model)
            gens.bump(restored)
            gens.patched.difference_update(restored)

    def partially_load(self, device_to, extra_memory=0, force_patch_weights=False, *args, **kwargs):
        if not force_patch_weights and _switch_in_place(self, device_to):
            # the loaded clone's patches restored where they are (ComfyUI's own unpatch, without its move to the
            # offload device); ComfyUI then loads this clone onto weights that are already there
            self.unpatch_model(None, unpatch_weights=True)
        return super().partially_load(device_to, extra_memory, force_patch_weights, *args, **kwargs)

    # -- ComfyUI's hook LoRAs (applied while sampling, per conditioning and keyframe) --------------------------------
    def patch_hook_weight_to_device(self, hooks, combined_patches, key, original_weights, memory_counter, *args,
                                    **kwargs):
        owner = owner_of(self)
        if owner is not None and owner.owns(key):
            if key in combined_patches:
                _refuse_hooks_where_comfyui_does(self)
                owner.bring(self, key, hooks=combined_patches[key])
                if comfy_internals.hooks_cached(self) is True:  # ComfyUI's cache of this group, as for its keys
                    self.cached_hook_patches.setdefault(hooks, {})[key] = owner.hook_marker(combined_patches[key])
                if original_weights is not None:
                    original_weights.pop(key, None)
            return None
        if key in combined_patches:
            _refuse_hooks_where_comfyui_does(self)
        out = super().patch_hook_weight_to_device(hooks, combined_patches, key, original_weights, memory_counter,
                                                  *args, **kwargs)
        if key in combined_patches:
            of_model(self.model).bump((key,))
        return out

    def patch_cached_hook_weights(self, cached_weights, key, memory_counter, *args, **kwargs):
        owner = owner_of(self)
        if owner is not None and owner.owns(key):
            owner.bring(self, key, hooks=owner.hook_patches(cached_weights[key]))
            return None
        out = super().patch_cached_hook_weights(cached_weights, key, memory_counter, *args, **kwargs)
        of_model(self.model).bump((key,))
        return out

    def unpatch_hooks(self, whitelist_keys_set=None, *args, **kwargs):
        owner = owner_of(self)
        if owner is not None:
            owner.drop_hooks(self, whitelist_keys_set)
        restored = [k for k in getattr(self, "hook_backup", {}) if not whitelist_keys_set or k in whitelist_keys_set]
        out = super().unpatch_hooks(whitelist_keys_set, *args, **kwargs)
        of_model(self.model).bump(restored)
        return out


def _written_elsewhere(patcher) -> None:
    """Where another patcher of this model (a clone of another class, e.g. an eager branch's) has loaded or unpatched
    it since FluxAccel's clones last wrote its weights (ComfyUI's patches_uuid on the model says so), every weight
    they had patched may have been restored or rewritten: counted as written."""
    gens = of_model(patcher.model)
    now = comfy_internals.weight_patches_uuid(patcher.model)
    if isinstance(now, Unavailable) or now == gens.applied:
        return
    gens.bump(gens.patched)
    gens.patched.clear()
    gens.applied = now


def _refuse_hooks_where_comfyui_does(patcher) -> None:
    """ComfyUI's dynamic VRAM does not run hook LoRAs (ModelPatcherDynamic refuses them); FluxAccel's resident copy of
    such a model says the same, with the way out, rather than running what eager ComfyUI would refuse."""
    if stands_in_for_dynamic(patcher.model):
        raise FluxAccelError(
            "A hook LoRA (Create Hook LoRA, Set Hook Keyframes, ...) reaches this model, which ComfyUI loaded with "
            "dynamic VRAM: ComfyUI does not apply hook weight patches to dynamic-VRAM models, with or without "
            "FluxAccel. Start ComfyUI with --disable-dynamic-vram to use hook LoRAs, or use LoraLoaderModelOnly.")


def _switch_in_place(patcher, device_to) -> bool:
    """Whether `patcher` is about to replace another clone's weight patches on a model ComfyUI holds fully loaded on
    `device_to` (ComfyUI would move every weight to the offload device and back to do it)."""
    base = patcher.model
    current = comfy_internals.weight_patches_uuid(base)
    if isinstance(current, Unavailable) or current is None or current == patcher.patches_uuid:
        return False
    return (not getattr(base, "model_lowvram", True) and getattr(base, "model_loaded_weight_memory", 0) > 0
            and str(getattr(base, "device", "")) == str(device_to))


_CLASSES: dict[type, type] = {}


def patcher_class(cls: type) -> type:
    """FluxAccel's patcher class over ComfyUI's (or a custom node's) patcher class `cls`."""
    if getattr(cls, "fluxaccel_patcher", False):
        return cls
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"FluxAccel{cls.__name__}", (FluxAccelPatching, cls), {"__module__": __name__})
    return _CLASSES[cls]


def own_clone(model):
    """A clone of `model` (a resident, non-dynamic ModelPatcher) of FluxAccel's patcher class; its own clones (a LoRA
    node after ours) keep the class. Its patches_uuid is its own: ComfyUI's load never takes it for the clone it came
    from, so whatever that clone wrote is unpatched, and counted, before this one runs."""
    clone = model.clone()
    clone.__class__ = patcher_class(type(clone))
    clone.patches_uuid = uuid.uuid4()
    return clone


def stamp(patcher, key: str) -> tuple[int, int]:
    """What a reader compares to know whether the weight at `key` (a state-dict key of the clone's diffusion model,
    as ComfyUI names it) is the one it copied: the FP8 set's generation for the Linears it owns, else the model's."""
    owner = owner_of(patcher)
    if owner is not None and owner.owns(key):
        return owner.generations.stamp(owner.key_of(key))
    return of_model(patcher.model).stamp(key)


def set_owner(clone, owner) -> None:
    clone.set_attachments(OWNER, owner)


def remove_owner(clone) -> None:
    clone.remove_attachments(OWNER)
