"""The new Linears of one Quantize FP8 run: each chosen Linear's weight as this clone runs it (source.py: ComfyUI's own
weight patching merges its LoRAs), quantized by torchao -- or read from the FP8 weights cache where it holds this
model -- and the checkpoint-quantized Linears outside the scope as plain bf16 Linears. Nothing is put on a model here
(patch.py does)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import comfy.model_management as mm
import torch

from ..cache import fp8_weights
from .fp8 import Fp8Config
from .linear import comfy_linear, plain_from_parts, quantize_linear
from .report import Fp8Report
from .source import Linears

log = logging.getLogger("fluxaccel.fp8")


@dataclass
class Built:
    """The new Linears by diffusion-model name, and the weight patches merged into them (patch key -> patches)."""

    modules: dict[str, torch.nn.Module] = field(default_factory=dict)
    merged: dict = field(default_factory=dict)


def fp8_linears(linears: Linears, cfg: Fp8Config, report: Fp8Report, sources: dict | None = None) -> Built:
    """Every chosen Linear as an FP8 Linear, one at a time: read from the FP8 weights cache where it holds this model
    (the first one is quantized all the same, and must match what the file holds), else quantized, and saved there;
    then the checkpoint-quantized Linears outside the scope dequantized. The report says what was done."""
    built, device, dtype = Built(), linears.device, linears.compute_dtype
    fp8_bytes = sum(linears.originals[n].weight.numel() for n in linears.chosen)
    home = fp8_home(linears.model, device, fp8_bytes, report)
    entry = fp8_weights.entry_for(linears, cfg)
    t0, stored, like = time.perf_counter(), None, None
    for name, lin, params in linears.as_run(built.merged, sources):
        if name in linears.dequantize:  # the model computes in its manual-cast dtype: the bf16 weight cast per call
            new = comfy_linear(lin, params, device, cast=dtype is not None).to(linears.model.offload_device)
        elif like is not None and stored is not None:
            new = plain_from_parts(lin, {**params, "weight": stored[name]["weight"]}, stored[name]["scale"], like,
                                   home, dtype)
        else:  # quantized on the GPU (fast); the copy waits for ComfyUI's load where fp8_home says
            base = lin if isinstance(lin, torch.nn.Linear) else comfy_linear(lin, params, device, cast=False)
            new = quantize_linear(base, cfg, device, dtype, params).to(home)
            if like is None:
                like, stored = new, fp8_weights.load(entry, linears.shapes, home, check=(name, new))
        built.modules[name] = new
        report.count(name, lin, new)
    report.merged_patches += list(built.merged)
    if stored is not None:
        report.weights_cache = (f"loaded {len(linears.chosen) - 1} Linears from {entry.path} to {home} in "
                                f"{time.perf_counter() - t0:.2f} s (the first quantized and checked)")
    elif entry.key is not None:
        fp8_weights.save(entry, {n: {"weight": built.modules[n].weight, "scale": built.modules[n].fp8_weight_scale}
                                 for n in linears.chosen})
        report.weights_cache = f"saving to {entry.path}"
    else:
        report.weights_cache = f"not cached: {entry.why_not}"
    return built


def fp8_home(model, device: torch.device, fp8_bytes: int, report: Fp8Report) -> torch.device:
    """Where the FP8 copies wait until ComfyUI loads the clone. On the load device when it has room for them beside
    ComfyUI's inference reserve: the host then holds no second copy, and ComfyUI's load moves nothing; until that
    load ComfyUI's memory checks count them as used memory of the device (not as a model it can unload), and its
    first unload moves them to the host like any loaded weights. Else where ComfyUI keeps unloaded weights (host
    RAM)."""

    offload = torch.device(model.offload_device)
    if device == offload:  # (a CPU server: both the CPU)
        return offload
    room = mm.get_free_memory(device) - mm.minimum_inference_memory()
    home = device if room > fp8_bytes else offload
    report.fp8_home = (f"on {device} until ComfyUI loads the model ({fp8_bytes / 1024**3:.1f} GiB, "
                       f"{room / 1024**3:.1f} GiB free beside ComfyUI's reserve)" if home == device else
                       f"in host RAM until ComfyUI loads the model ({device} has {room / 1024**3:.1f} GiB free beside "
                       f"ComfyUI's reserve, {fp8_bytes / 1024**3:.1f} GiB needed)")
    return home
