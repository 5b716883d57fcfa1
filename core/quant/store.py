"""One set of FP8 Linears per loaded model and FP8 config, shared by its clones, written by ComfyUI's own weight
patching.

Quantize FP8 builds the FP8 Linears of a model once. Another clone of the same model with the same config (a LoRA's
strength changed, a LoRA swapped, added, removed or stacked, before or after Quantize FP8) gets the same Linear
objects. The clone keeps its weight patches in `model.patches` like any clone; when ComfyUI loads it, its
patch_weight_to_device reaches each FP8 weight key (models/patcher.py) and `bring` merges the clone's patches into
that Linear from its stored bf16 weight (ComfyUI's own weight patching, source.patched) and quantizes the result into
the existing buffers -- only where they differ from what the Linear holds. The buffers keep their addresses: a
compiled model's kernels and CUDA graphs stay valid, and no second copy of the weights is made. Each merge raises the
Linear's generation (models/generations.py), which the modulation table and the Parallel workers read.

A patch list is known by what it holds: each patch's strengths, offset and function, and its data by identity (the
set keeps the lists it merged, so an identity cannot be taken by another object meanwhile). ComfyUI's hook LoRAs
(patched while sampling, per keyframe) are a second stage on top of the clone's patches, as ComfyUI applies them.

Lifetime: the sets of a model are found through a weak map on its BaseModel; a set lives while a clone refers to it
(its attachment) or ComfyUI runs its Linears (the block patches in the loaded module tree hold it).
"""
from __future__ import annotations

import dataclasses
import logging
import time
import weakref
from dataclasses import dataclass, field

import torch

from ..errors import FluxAccelError
from ..models import swaps
from ..models.generations import Generations
from ..upstream import Unavailable, comfy_internals
from . import act_fusion, build
from .fp8 import Fp8Config
from .linear import is_fp8_linear, quantize_linear
from .report import Fp8Report
from .source import Linears, kept, patched

log = logging.getLogger("fluxaccel.fp8")

SETS = "_fluxaccel_fp8_sets"  # the BaseModel's WeakValueDictionary: config key -> Fp8Store
PREFIX = "diffusion_model."


def fingerprint(patches) -> tuple:
    """What a key's patch list merges: each patch's strength, data (by identity), model strength, offset, function."""
    return tuple((p[0], id(p[1]), p[2], p[3], id(p[4]) if len(p) > 4 else None) for p in patches or ())


def _stages_print(stages: tuple) -> tuple:
    return tuple(fingerprint(s) for s in stages)


class HookStage(tuple):
    """A hook LoRA's patches on an FP8 weight, as ComfyUI's hook cache keeps them for a hook group (value, device)."""


@dataclass(eq=False)
class Fp8Store:
    """The FP8 Linears of one model and config: `modules` and `fused` (the activations moved into them) by their
    diffusion-model name / object-patch key, the `originals` they were quantized from; `held`: per weight or bias key,
    the patch stages merged into it now (the clone's patches, then a hook's); `generations`: per Linear, how often it
    was written in place."""

    cfg: Fp8Config
    modules: dict[str, torch.nn.Module]
    originals: dict[str, torch.nn.Module]
    fused: dict[str, torch.nn.Module]
    report: Fp8Report
    compute_dtype: object = None
    held: dict[str, tuple] = field(default_factory=dict)
    generations: Generations = field(default_factory=Generations)

    def __post_init__(self):
        self._keys = {n: tuple(f"{PREFIX}{n}.{p}" for p in ("weight", "bias") if getattr(m, p, None) is not None)
                      for n, m in self.modules.items() if is_fp8_linear(m)}
        self.merge_s = 0.0
        # the stored bf16 weights of the Linears a patch has reached, kept on the load device where it has room: a
        # LoRA change merges them again without reading them from host memory (FLUX.1-dev: 24 GB for every Linear)
        self.sources: dict[str, torch.Tensor] = {}

    @property
    def fp8(self) -> dict[str, torch.nn.Module]:
        """The FP8 Linears among the modules (the others: checkpoint-quantized Linears made bf16, which ComfyUI's
        load patches as usual)."""
        return {n: self.modules[n] for n in self._keys}

    @property
    def merges(self) -> int:
        """Linears merged again so far (the stats)."""
        return self.generations.version

    def key_of(self, key: str) -> str:
        """The Linear's name of a state-dict key of its (weight, bias, fp8_weight_scale, ...)."""
        return key[len(PREFIX):].rsplit(".", 1)[0]

    def owns(self, key: str) -> bool:
        return key.startswith(PREFIX) and self.key_of(key) in self._keys

    # -- ComfyUI's patching, through models/patcher.py ---------------------------------------------------------------
    def bring(self, patcher, key: str, hooks=None) -> bool:
        """Make the FP8 Linear of `key` hold its stored weights with `patcher`'s patches merged (and, for `key`,
        `hooks`: a hook LoRA's patches on top; None: none). True where it was merged again."""
        name = self.key_of(key)
        want = {k: (self.held.get(k, ((),)) if k != key and hooks is not None else
                    ((tuple(patcher.patches.get(k, ())),) + ((HookStage(hooks),) if k == key and hooks else ())))
                for k in self._keys[name]}
        if all(_stages_print(self.held.get(k, ((),))) == _stages_print(want[k]) for k in want):
            return False
        self._merge(patcher, name, want)
        return True

    def drop_hooks(self, patcher, keys=None) -> None:
        """The hook stage taken off every FP8 Linear holding one (of `keys`, where given): its clone's patches only."""
        for name, lin_keys in self._keys.items():
            hooked = [k for k in lin_keys if len(self.held.get(k, ((),))) > 1 and (not keys or k in keys)]
            if hooked:
                self._merge(patcher, name, {k: (self.held.get(k, ((),))[0],) if k in hooked else self.held.get(k, ((),))
                                            for k in lin_keys})

    @staticmethod
    def hook_marker(hooks) -> tuple:
        """What ComfyUI's hook cache keeps for an FP8 weight: its hook patches, merged again when the group returns."""
        return (HookStage(hooks), None)

    @staticmethod
    def hook_patches(cached) -> tuple:
        return cached[0]

    def _merge(self, patcher, name: str, stages: dict[str, tuple]) -> None:
        t0 = time.perf_counter()
        q, original = self.modules[name], self.originals[name]
        device = torch.device(patcher.load_device)
        params = {}
        for key, key_stages in stages.items():
            part = key.rsplit(".", 1)[1]
            stored = self._stored(patcher, key, getattr(original, part), device, any(key_stages))
            t = stored
            for i, stage in enumerate(key_stages):
                if not stage:
                    continue
                t = (patched(list(stage), key, t, device) if i == 0 else
                     _hooked(list(stage), key, t, stored, device))
            params[part] = t
        new = quantize_linear(original if isinstance(original, torch.nn.Linear) else q, self.cfg, device,
                              self.compute_dtype, params)
        with torch.no_grad():
            q.weight.copy_(new.weight.to(q.weight.device))
            q.fp8_weight_scale.copy_(new.fp8_weight_scale.to(q.fp8_weight_scale.device))
            if q.bias is not None and "bias" in params:
                q.bias.copy_(new.bias.to(q.bias.device, q.bias.dtype))
        for key, key_stages in stages.items():
            self.held[key] = tuple(tuple(s) if i == 0 else s for i, s in enumerate(key_stages))
        self.generations.bump((name,))
        self.merge_s += time.perf_counter() - t0

    def _stored(self, patcher, key: str, original: torch.Tensor, device: torch.device, patched: bool) -> torch.Tensor:
        """The stored weight at `key` (ComfyUI's backup where another clone's patch is applied to the live one now),
        from the copy kept on the device where there is one (source.kept)."""
        stored = patcher.backup[key].weight if key in patcher.backup else original
        return kept(self.sources, key, stored, device) if patched else stored


def _hooked(hooks: list, key: str, weight: torch.Tensor, stored: torch.Tensor, device) -> torch.Tensor:
    """A hook LoRA's patches on top of the clone's patched weight, as ComfyUI's patch_hook_weight_to_device computes
    them (float32, then its stochastic rounding with the key's seed); `stored` is the weight before any patch."""
    t = comfy_internals.hooked_weight(hooks, key, weight, stored, device)
    if isinstance(t, Unavailable):
        raise FluxAccelError(f"Quantize FP8 (FluxAccel): this ComfyUI's hook patching is not where FluxAccel reads it "
                             f"({t}); hook LoRAs cannot be merged into FP8 weights here. Remove the hook LoRA or "
                             f"Quantize FP8.")
    return t


def _sets(base) -> "weakref.WeakValueDictionary":
    sets = base.__dict__.get(SETS)
    if sets is None:
        sets = base.__dict__[SETS] = weakref.WeakValueDictionary()
    return sets


def for_clone(flux, linears: Linears, cfg: Fp8Config) -> tuple[Fp8Store, Fp8Report]:
    """(the FP8 Linears of `flux`'s loaded model under `cfg`, the report): those built for another clone of the model
    from these very Linears while one still uses them, else built now (with this clone's weight patches merged)."""
    model, at = flux.model, tuple(cfg.key())
    sets = _sets(model.model)
    shared = sets.get(at)
    if shared is not None and not _built_from(shared, linears):
        shared = None
    if shared is None:  # this model's first FP8 Linears under this config (or none alive)
        report = Fp8Report(cfg.granularity, cfg.scope, str(flux.device), skipped=dict(linears.skipped))
        sources: dict[str, torch.Tensor] = {}
        built = build.fp8_linears(linears, cfg, report, sources)
        fused = act_fusion.fuse(flux.dm, lambda name, m: swaps.original(model, f"diffusion_model.{name}", m),
                                built.modules, cfg, report)
        shared = Fp8Store(cfg, built.modules, {n: linears.originals[n] for n in built.modules}, fused, report,
                          linears.compute_dtype)
        shared.sources.update(sources)
        shared.held.update({k: ((tuple(v),) if v else ((),)) for k, v in built.merged.items()})
        sets[at] = shared
    else:
        report = dataclasses.replace(shared.report, merged_patches=list(linears.weight_patches),
                                     weights_cache="the FP8 Linears of this model, shared with its other clones; "
                                                   "this clone's weight patches are merged in place when ComfyUI "
                                                   "loads it")
    return shared, report


def _built_from(store: Fp8Store, linears: Linears) -> bool:
    """Whether `store` holds the FP8 copies of exactly these chosen Linears (the same objects)."""
    return list(store.fp8) == list(linears.chosen) and \
        all(store.originals[n] is linears.originals.get(n) for n in store.modules)
