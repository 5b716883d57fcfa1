"""Quantize FP8 on a ModelPatcher: a clone whose quantized Linears are object patches.

Why object patches on a clone:
  * the loaded model (and every other branch or workflow using it) keeps its bf16 Linears; ComfyUI swaps our
    FP8 modules in when our clone is loaded and restores the originals when another clone is loaded;
  * the clone gets its own patches_uuid, so switching between it and a plain clone makes ComfyUI unpatch and
    move the model: only the modules in the live tree go to the GPU, i.e. the FP8 copies, not FP8 + bf16.

The run, top to bottom: the checked resident model (models/flux.py) -> its Linears as this clone runs them
(source.py) -> their FP8 copies, one set per loaded model and config (store.py; build.py: ComfyUI merges the LoRAs,
torchao or the FP8 weights cache quantizes) -> the MLP activations moved into them (act_fusion.py) -> all of it on a
clone of FluxAccel's patcher class, one object patch per block (models/swaps.py), the set as the clone's weights
owner: ComfyUI's load merges the clone's weight patches into the FP8 Linears (models/patcher.py).
"""
from __future__ import annotations

import dataclasses
import logging
import uuid
from dataclasses import dataclass

from ..env import require_fp8_device, require_torch, require_torchao
from ..models import swaps
from ..models.flux import FluxModel, on_load_callback_type, partial_load_guard
from ..models.patcher import remove_owner, set_owner
from . import source, store
from .fp8 import Fp8Config
from .report import Fp8Report

log = logging.getLogger("fluxaccel.fp8")

FP8_KEY = "fluxaccel_fp8"  # ModelPatcher attachment (Fp8State), ON_LOAD callback key
NODE = "Quantize FP8 (FluxAccel)"


def _on_load(node: str):
    """An ON_LOAD callback: a partial (lowvram) load is refused (FP8 weights cannot be streamed per layer)."""
    return partial_load_guard(node)


@dataclass(frozen=True)
class Fp8State:
    """What Quantize FP8 applied to a clone: a ModelPatcher attachment (FP8_KEY), which ComfyUI's clones share.
    Never mutated: another config or remove_fp8 makes a new clone."""
    config: Fp8Config
    keys: tuple[str, ...]  # the object-patch keys of the quantized (and dequantized) Linears
    report: Fp8Report
    fused_keys: tuple[str, ...] = ()  # the object-patch keys of the activations fused into FP8 Linears (Identity)


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
    shared, report = store.for_clone(flux, linears, cfg)

    # FluxAccel's patcher class: ComfyUI's load brings the FP8 Linears to this clone's weight patches (LoRAs before or
    # after this node), which stay in clone.patches like any clone's (models/patcher.py)
    clone = flux.clone()
    set_owner(clone, shared)
    keys = tuple(f"diffusion_model.{n}" for n in shared.modules)
    # one object patch per block (ComfyUI re-applies each at every prompt); the blocks hold the set while they run
    swaps.add(clone, {**dict(zip(keys, shared.modules.values())), **shared.fused}, holder=shared)
    # (own_clone's fresh patches_uuid makes ComfyUI unpatch the model when it switches between this clone and
    # another one, so the GPU holds only the modules of the clone being run)
    clone.size = max(1, flux.model.model_size() - report.bytes_saved)
    # FP8 weights cannot be streamed per layer by ComfyUI's lowvram path
    clone.add_callback_with_key(on_load_callback_type(), FP8_KEY, _on_load(node))
    clone.set_attachments(FP8_KEY, Fp8State(cfg, keys, report, tuple(shared.fused)))
    log.info("%s", report.summary())
    return clone, report


def remove_fp8(model):
    """A clone of `model` running its original Linears again (the default Benchmark baseline)."""
    prev = fp8_state(model)
    if prev is None:
        return model
    clone = model.clone()
    swaps.remove(clone, (*prev.keys, *prev.fused_keys))
    clone.remove_callbacks_with_key(on_load_callback_type(), FP8_KEY)
    remove_owner(clone)  # its weight patches are ComfyUI's again, on the bf16 Linears
    clone.remove_attachments(FP8_KEY)
    clone.patches_uuid = uuid.uuid4()
    clone.size = model.model_size() + prev.report.bytes_saved
    return clone
