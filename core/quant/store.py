"""One set of FP8 Linears per loaded model and FP8 config, shared by all its clones, that follows each clone's weight
patches in place.

Quantize FP8 builds the FP8 Linears of a model once. Another clone of the same model with the same config (a LoRA's
strength changed, a LoRA swapped, added, removed or stacked, before or after Quantize FP8) gets the same Linear
objects; when sampling starts, sync() brings their FP8 data and scales to that clone's patches: each Linear whose
patches differ from those merged into it now is merged again from its stored bf16 weight (ComfyUI's own weight
patching, source.patched) and quantized into its existing buffers. The buffers keep their
addresses, so a compiled model's kernels and CUDA graphs stay valid, and no second copy of the weights is made.

A patch list is known by what it holds: each patch's strengths, offset and function, and its data by identity (the
store keeps the lists it merged, so an identity cannot be taken by another object meanwhile).
"""
from __future__ import annotations

import dataclasses
import logging
import time
import weakref
from dataclasses import dataclass, field

import torch

from ..models import swaps
from . import act_fusion, build
from .build import Kept
from .fp8 import Fp8Config
from .linear import is_fp8_linear, quantize_linear
from .report import Fp8Report
from .source import Linears, patched

log = logging.getLogger("fluxaccel.fp8")

_STORES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # BaseModel -> {config key: Fp8Store}


def fingerprint(patches: list | None) -> tuple:
    """What a key's patch list merges: each patch's strength, data (by identity), model strength, offset, function."""
    return tuple((p[0], id(p[1]), p[2], p[3], id(p[4]) if len(p) > 4 else None) for p in patches or ())


@dataclass(eq=False)
class Fp8Store:
    """The FP8 Linears of one model and config: `modules` and `fused` (the activations moved into them) by their
    diffusion-model name / object-patch key, the `originals` they were quantized from, and `held`: per weight or
    bias key, the patch list merged into it now."""

    cfg: Fp8Config
    modules: dict[str, torch.nn.Module]
    originals: dict[str, torch.nn.Module]
    fused: dict[str, torch.nn.Module]
    report: Fp8Report
    compute_dtype: object = None
    held: dict[str, list] = field(default_factory=dict)
    generations: dict[str, int] = field(default_factory=dict)  # per Linear, how often merged again (a write in place)

    @property
    def merges(self) -> int:
        """Linears merged again so far (the stats)."""
        return sum(self.generations.values())

    @property
    def fp8(self) -> dict[str, torch.nn.Module]:
        """The FP8 Linears among the modules (the others: checkpoint-quantized Linears made bf16, which ComfyUI's
        load patches as usual)."""
        return {n: m for n, m in self.modules.items() if is_fp8_linear(m)}

    def keys(self) -> list[str]:
        """The weight and bias keys of the FP8 Linears (what a weight patch on them names)."""
        return [f"diffusion_model.{n}.{p}" for n, m in self.fp8.items() for p in ("weight", "bias")
                if getattr(m, p, None) is not None]

    def sync(self, model, patches: dict[str, list]) -> int:
        """Make every FP8 Linear hold its stored weights with `patches` (key -> the patch list this clone merges;
        a key not in it: none) merged; `model` is the clone about to sample. Returns how many Linears changed."""
        t0, changed = time.perf_counter(), []
        for name, q in self.fp8.items():
            keys = [f"diffusion_model.{name}.{p}" for p in ("weight", "bias") if getattr(q, p, None) is not None]
            if all(fingerprint(self.held.get(k)) == fingerprint(patches.get(k)) for k in keys):
                continue
            self._merge(model, name, {k: patches.get(k) for k in keys})
            changed.append(name)
        if changed:
            log.info("FluxAccel: merged this prompt's weight patches into %d FP8 Linears in place in %.2f s",
                     len(changed), time.perf_counter() - t0)
        return len(changed)

    def _merge(self, model, name: str, patches: dict[str, list | None]) -> None:
        q, original = self.modules[name], self.originals[name]
        device = torch.device(model.load_device)
        params = {}
        for key, plist in patches.items():
            part = key.rsplit(".", 1)[1]
            stored = model.backup[key].weight if key in model.backup else getattr(original, part)
            params[part] = patched(plist, key, stored, device) if plist else stored
        new = quantize_linear(original if isinstance(original, torch.nn.Linear) else q, self.cfg, device,
                              self.compute_dtype, params)
        with torch.no_grad():
            q.weight.copy_(new.weight.to(q.weight.device))
            q.fp8_weight_scale.copy_(new.fp8_weight_scale.to(q.fp8_weight_scale.device))
            if q.bias is not None and "bias" in params:
                q.bias.copy_(new.bias.to(q.bias.device, q.bias.dtype))
        for key, plist in patches.items():
            self.held[key] = list(plist or ())
        self.generations[name] = self.generations.get(name, 0) + 1


def for_clone(flux, linears: Linears, cfg: Fp8Config) -> tuple[Fp8Store, Fp8Report, Kept]:
    """(the FP8 Linears of `flux`'s loaded model under `cfg`, the report, the clone's weight patches on them): those
    built for another clone of the model from these very Linears, else built now and kept for its other clones
    (one store per model and config; a newer one replaces it). The patches are merged into the Linears when the
    clone samples (Fp8Store.sync), not by ComfyUI's load."""
    model, at = flux.model, tuple(cfg.key())
    stores = _STORES.setdefault(model.model, {})
    shared = stores[at] if at in stores and _built_from(stores[at], linears) else None
    if shared is None:  # this model's first FP8 Linears under this config
        report = Fp8Report(cfg.granularity, cfg.scope, str(flux.device), skipped=dict(linears.skipped))
        built = build.fp8_linears(linears, cfg, report)
        fused = act_fusion.fuse(flux.dm, lambda name, m: swaps.original(model, f"diffusion_model.{name}", m),
                                built.modules, cfg, report)
        shared = stores[at] = Fp8Store(cfg, built.modules, {n: linears.originals[n] for n in built.modules}, fused,
                                       report, linears.compute_dtype, {k: list(v) for k, v in built.merged.items()})
    else:
        report = dataclasses.replace(shared.report, merged_patches=list(linears.weight_patches),
                                     weights_cache="the FP8 Linears of this model, shared with its other clones; "
                                                   "this clone's weight patches are merged in place when it samples")
    keys = [f"diffusion_model.{n}.{p}" for n in linears.chosen for p in ("weight", "bias")
            if getattr(linears.originals[n], p, None) is not None]
    return shared, report, Kept({k: model.patches[k] for k in keys if k in model.patches and model.patches[k]})


def _built_from(store: Fp8Store, linears: Linears) -> bool:
    """Whether `store` holds the FP8 copies of exactly these chosen Linears (the same objects)."""
    return list(store.fp8) == list(linears.chosen) and \
        all(store.originals[n] is linears.originals.get(n) for n in store.modules)
