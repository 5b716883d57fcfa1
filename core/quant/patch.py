"""Quantize FP8 on a ModelPatcher: a clone whose quantized Linears are object patches.

Why object patches on a clone:
  * the loaded model (and every other branch or workflow using it) keeps its bf16 Linears; ComfyUI swaps our
    FP8 modules in when our clone is loaded and restores the originals when another clone is loaded;
  * the clone gets its own patches_uuid, so switching between it and a plain clone makes ComfyUI unpatch and
    move the model: only the modules in the live tree go to the GPU, i.e. the FP8 copies, not FP8 + bf16.

The run, top to bottom: the checked resident model (models/flux.py) -> its Linears as this clone runs them
(source.py) -> their FP8 copies (build.py: ComfyUI merges the LoRAs, torchao or the FP8 weights cache quantizes)
-> the MLP activations moved into them (act_fusion.py) -> all of it on a clone, one object patch per block
(models/swaps.py).
"""
from __future__ import annotations

import dataclasses
import logging
import uuid
from dataclasses import dataclass

from ..env import require_fp8_device, require_torch, require_torchao
from ..models import swaps
from ..models.flux import FluxModel, on_load_callback_type, partial_load_guard, prepare_sampling_type
from . import source, store
from .build import Kept
from .fp8 import Fp8Config
from .report import Fp8Report

log = logging.getLogger("fluxaccel.fp8")

FP8_KEY = "fluxaccel_fp8"  # ModelPatcher attachment (Fp8State), ON_LOAD callback key
NODE = "Quantize FP8 (FluxAccel)"


LATE = "fluxaccel_late_patches"  # the ModelPatcher attribute that holds, while it samples, the patches taken off


def _merged_when_sampling(executor, model, *args, **kwargs):
    """A PREPARE_SAMPLING wrapper (ComfyUI's sampler runs it before it loads the model): weight patches a LoRA node
    added after Quantize FP8 on the FP8 Linears are taken off the clone while it samples (ComfyUI's load must not
    patch FP8 data), for the load to merge them in place (_on_load), and put back after."""
    state = fp8_state(model)
    ours = set(state.store.keys()) if state is not None and state.store is not None else set()
    late = {k: v for k, v in model.patches.items() if v and k in ours}
    for k in late:
        del model.patches[k]
    setattr(model, LATE, late)
    try:
        return executor(model, *args, **kwargs)
    finally:
        model.patches.update(late)
        setattr(model, LATE, {})


def _on_load(node: str):
    """An ON_LOAD callback: a partial (lowvram) load is refused; the FP8 Linears are brought to the loaded clone's
    weight patches in place -- those present when Quantize FP8 ran, then any a LoRA node added after it
    (store.Fp8Store.sync: only where they differ from what the Linears hold)."""
    guard = partial_load_guard(node)

    def on_load(patcher, *args):
        guard(patcher, *args)
        state = fp8_state(patcher)
        if state is None or state.store is None:
            return
        late = getattr(patcher, LATE, {})
        state.store.sync(patcher, {k: list(state.merged_patches.get(k, ())) + list(late.get(k, ()))
                                   for k in state.store.keys()})
    return on_load


@dataclass(frozen=True)
class Fp8State:
    """What Quantize FP8 applied to a clone: a ModelPatcher attachment (FP8_KEY), which ComfyUI's clones share.
    Never mutated: another config or remove_fp8 makes a new clone."""
    config: Fp8Config
    keys: tuple[str, ...]  # the object-patch keys of the quantized (and dequantized) Linears
    report: Fp8Report
    merged_patches: Kept  # weight patches merged into the FP8 weights, restored by remove_fp8
    fused_keys: tuple[str, ...] = ()  # the object-patch keys of the activations fused into FP8 Linears (Identity)
    store: object = None  # the store.Fp8Store whose Linears these are


def fp8_state(model) -> Fp8State | None:
    """The FP8 state Quantize FP8 put on this model, if any."""
    return model.get_attachment(FP8_KEY)


def apply_fp8(model, cfg: Fp8Config, node: str = NODE):
    """Return (clone with FP8 Linears, report). The input model is left untouched.

    Quantizing a model that already carries the same FP8 config is a no-op (the same model is returned);
    a different config re-quantizes from the original bf16 weights, never from FP8.
    """
    require_torch(node)
    require_torchao()
    # ComfyUI 0.33+ dynamic VRAM: a resident copy sharing its weights (models/resident.py), checked
    flux = FluxModel.of(model, node, quantized_ok=True)
    prev = flux.model.get_attachment(FP8_KEY)
    if prev is not None and prev.config.key() == cfg.key():
        report = dataclasses.replace(prev.report, already_applied=True)
        log.info("%s", report.summary())
        return flux.model, report
    if prev is not None:  # another FP8 config: start again from the model as it was before quantization
        flux = dataclasses.replace(flux, model=remove_fp8(flux.model))
    require_fp8_device(flux.device)

    linears = source.read(flux, cfg)
    shared, report, merged = store.for_clone(flux, linears, cfg)

    clone = flux.model.clone()
    for key in merged:  # merged into the FP8 weights (store.sync), not by ComfyUI's load; kept for remove_fp8
        clone.patches.pop(key)
    keys = tuple(f"diffusion_model.{n}" for n in shared.modules)
    # one object patch per block: ComfyUI re-applies each at every prompt
    swaps.add(clone, {**dict(zip(keys, shared.modules.values())), **shared.fused})
    # A fresh patches_uuid makes ComfyUI unpatch/move the model when it switches between this clone and
    # another one, so the GPU holds only the weights of the clone being run.
    clone.patches_uuid = uuid.uuid4()
    clone.size = max(1, flux.model.model_size() - report.bytes_saved)
    # FP8 weights cannot be streamed per layer by ComfyUI's lowvram path
    clone.add_callback_with_key(on_load_callback_type(), FP8_KEY, _on_load(node))
    clone.add_wrapper_with_key(prepare_sampling_type(), FP8_KEY, _merged_when_sampling)
    clone.set_attachments(FP8_KEY, Fp8State(cfg, keys, report, merged, tuple(shared.fused), shared))
    log.info("%s", report.summary())
    return clone, report


def remove_fp8(model):
    """A clone of `model` running its original Linears again (the default Benchmark baseline)."""
    prev = fp8_state(model)
    if prev is None:
        return model
    clone = model.clone()
    swaps.remove(clone, (*prev.keys, *prev.fused_keys))
    for key, patches in prev.merged_patches.items():
        clone.patches[key] = list(patches)
    clone.remove_callbacks_with_key(on_load_callback_type(), FP8_KEY)
    clone.remove_wrappers_with_key(prepare_sampling_type(), FP8_KEY)
    clone.remove_attachments(FP8_KEY)
    clone.patches_uuid = uuid.uuid4()
    clone.size = model.model_size() + prev.report.bytes_saved
    return clone
