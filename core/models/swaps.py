"""FluxAccel's module swaps (FP8 Linears, fused activations, table modulations, ...) as ComfyUI object patches: one
per block.

ComfyUI applies a clone's object patches with one `set_attr` per key, and 0.33's `load_models_gpu` undoes and redoes
all of them at every prompt (`partially_load`). Swapping each Linear through its own patch made that 380 keys for a
compiled FLUX.1, each one host time in every prompt; swapping each block as a whole makes it 57. A block's patch is a copy
of the block as the model has it (no clone's patches applied) in which the modules on the path to each swapped
module are shallow copies: new module objects over the same parameters, their own child lists. The original block,
and every other branch of the workflow, keep their modules; the copy shares every module it does not swap.

A block holding another node's object patch (on the block or inside it) keeps one patch per module, as before: the
two kinds of keys cannot be undone in a safe order together. `swaps.get`/`items` read both kinds by module key.
"""
from __future__ import annotations

import copy
import logging

import torch

log = logging.getLogger("fluxaccel.patches")

BLOCK_LISTS = ("double_blocks", "single_blocks")
_SWAPS = "_fluxaccel_swaps"  # a block copy's {relative name: swapped module}
_HOLDS = "_fluxaccel_holds"  # a block copy's objects kept alive while it is (the FP8 set whose Linears it runs)


def block_of(key: str) -> tuple[str, str] | None:
    """(block key, name inside it) for a module key inside a FLUX block ('diffusion_model.double_blocks.3.img_mod' ->
    ('diffusion_model.double_blocks.3', 'img_mod')), else None."""
    parts = key.split(".")
    if len(parts) > 3 and parts[0] == "diffusion_model" and parts[1] in BLOCK_LISTS and parts[2].isdigit():
        return ".".join(parts[:3]), ".".join(parts[3:])
    return None


def swapped_in(obj) -> dict | None:
    """A block copy's swaps ({name inside the block: module}), or None for any other object."""
    return obj.__dict__.get(_SWAPS) if isinstance(obj, torch.nn.Module) else None


def original(model, key: str, default=None):
    """The object at `key` ('diffusion_model.…') of the model without any clone's object patches: ComfyUI's backup
    (object_patches_backup, shared by a model's clones) stands in at every level where a patch is applied now.
    `default` where the key does not resolve."""
    backup = model.object_patches_backup
    obj, parts = model.model, key.split(".")
    for i, part in enumerate(parts):
        here = ".".join(parts[:i + 1])
        obj = backup[here] if here in backup else getattr(obj, part, None)
        if obj is None:
            return default
    return obj


def get(model, key: str):
    """This clone's object patch at module key `key` (inside its block copy, or a patch of its own), else None."""
    if key in model.object_patches:
        return model.object_patches[key]
    where = block_of(key)
    swaps = swapped_in(model.object_patches.get(where[0])) if where else None
    return swaps.get(where[1]) if swaps else None


def items(model) -> list[tuple[str, object]]:
    """(module key, object) of every object patch of the clone, block copies read as the modules they swap."""
    out = []
    for key, obj in model.object_patches.items():
        swaps = swapped_in(obj)
        out += [(f"{key}.{name}", m) for name, m in swaps.items()] if swaps is not None else [(key, obj)]
    return out


def _shallow(module: torch.nn.Module) -> torch.nn.Module:
    """A new module object over the same parameters and buffers, with its own list of children."""
    new = copy.copy(module)
    new.__dict__["_modules"] = dict(module._modules)
    return new


def _block_copy(block: torch.nn.Module, swaps: dict, holds: tuple = ()) -> torch.nn.Module:
    """`block` with `swaps` ({name inside it: module}) in place, every module on their paths copied (_shallow);
    `holds`: objects the copy keeps alive (while a clone or ComfyUI's loaded module tree has it)."""
    root = _shallow(block)
    copied = {id(root)}
    for name, module in swaps.items():
        *path, last = name.split(".")
        parent = root
        for part in path:
            child = parent._modules[part]
            if id(child) not in copied:
                child = _shallow(child)
                copied.add(id(child))
                parent._modules[part] = child
            parent = child
        setattr(parent, last, module)
    root.__dict__[_SWAPS] = dict(swaps)
    root.__dict__[_HOLDS] = _Holds(holds)
    return root


def _foreign_inside(model, block_key: str) -> bool:
    """Whether another object patch of the clone is on this block or inside it (then its modules are patched one
    by one)."""
    own = model.object_patches.get(block_key)
    return (own is not None and swapped_in(own) is None) or any(
        k.startswith(f"{block_key}.") for k in model.object_patches)


def _set_block(clone, block_key: str, swaps: dict, holds: tuple = ()) -> None:
    if not swaps:
        clone.object_patches.pop(block_key, None)
        return
    block = original(clone, block_key)
    clone.add_object_patch(block_key, _block_copy(block, swaps, holds))


class _Holds(tuple):
    """A block copy's kept objects: never part of a pickled model (a separate compile, the Parallel workers rebuild
    the module tree from its skeleton without them)."""

    def __reduce__(self):
        return tuple, ()


def _holds(obj) -> tuple:
    return obj.__dict__.get(_HOLDS, ()) if isinstance(obj, torch.nn.Module) else ()


def add(clone, modules: dict[str, object], holder=None) -> None:
    """Swap each module key's module for the given object on this clone (never on the model it was cloned from):
    inside FLUX blocks one object patch per block, elsewhere one per module. `holder`: an object the block patches
    keep alive (the FP8 set whose Linears they run)."""
    by_block: dict[str, dict] = {}
    one_by_one = set()
    for key, obj in modules.items():
        where = block_of(key)
        if where is None or _foreign_inside(clone, where[0]):
            clone.add_object_patch(key, obj)
            one_by_one.update([where[0]] if where else [])
        else:
            by_block.setdefault(where[0], {})[where[1]] = obj
    if one_by_one:
        log.info("FluxAccel: %d blocks hold another node's object patches (e.g. %s): their modules are swapped one "
                 "patch each (ComfyUI re-applies each at every prompt)", len(one_by_one), min(one_by_one))
    for block_key, swaps in by_block.items():
        had = clone.object_patches.get(block_key)
        holds = tuple({id(h): h for h in (*_holds(had), *((holder,) if holder is not None else ()))}.values())
        _set_block(clone, block_key, {**(swapped_in(had) or {}), **swaps}, holds)


def regroup(clone, keys) -> None:
    """Object patches this clone just got one per module key (while they were built) grouped as add() groups them."""
    add(clone, {k: clone.object_patches.pop(k) for k in keys if k in clone.object_patches})


def remove(clone, keys) -> None:
    """Take the swaps at these module keys off this clone (the model's own modules run there again)."""
    by_block: dict[str, set] = {}
    for key in keys:
        where = block_of(key)
        if key in clone.object_patches or where is None:
            clone.object_patches.pop(key, None)
        else:
            by_block.setdefault(where[0], set()).add(where[1])
    for block_key, names in by_block.items():
        had = clone.object_patches.get(block_key)
        swaps = swapped_in(had)
        if swaps is not None:
            _set_block(clone, block_key, {n: m for n, m in swaps.items() if n not in names})  # (holds dropped)
