"""Warm up a compiled FLUX model: real sampling at each shape a workflow will use, so compile and CUDA-graph
capture happen before the first real prompt, and each shape becomes an allowed shape of the compiled model."""
from __future__ import annotations

import logging
import re
import time
from typing import Callable

import torch

from .shapes import ShapeKey, dtype_name
from .progress import Report
from .patch import with_own_shapes
from ..errors import FluxAccelError
from ..models.flux import require_flux
from ..models.synthetic import synthetic_conditioning_for

log = logging.getLogger("fluxaccel.warmup")

TICKS = 100  # the Warmup node's progress-bar units per sampling step: its bar also moves inside a step that compiles


def parse_resolutions(text: str) -> list[tuple[int, int]]:
    """'1024x1024, 832x1216' -> [(1024, 1024), (832, 1216)] as (width, height); multiples of 16 only."""
    out = []
    for part in re.split(r"[,;\s]+", text.strip()):
        if not part:
            continue
        m = re.fullmatch(r"(\d+)\s*[x×X*]\s*(\d+)", part)
        if not m:
            raise FluxAccelError(f"Warmup: cannot read resolution {part!r}; write WIDTHxHEIGHT, e.g. 1024x1024, 832x1216")
        w, h = int(m.group(1)), int(m.group(2))
        if w % 16 or h % 16 or w < 16 or h < 16:
            raise FluxAccelError(f"Warmup: {w}x{h} is not a FLUX resolution; width and height must be multiples of 16")
        if (w, h) not in out:
            out.append((w, h))
    if not out:
        raise FluxAccelError("Warmup: no resolution given; write e.g. 1024x1024")
    return out


def warmup(model, resolutions: list[tuple[int, int]], batch_size: int = 1, text_length: int = 256, cfg: float = 1.0,
           steps: int = 2, positive=None, negative=None, sampler: str = "euler", scheduler: str = "simple",
           on_step: Callable[[], None] | None = None, on_compile: Report | None = None):
    """Sample `steps` steps at each resolution. Returns (model, {shape description: seconds of its first sampling
    run}): a clone whose compiled model allows these shapes; the input model (the Compile node's output) keeps its
    own shapes and policy, also when warming up fails. on_compile(text, seconds): every second while a shape
    compiles (compile_progress.py)."""
    import comfy.sample

    dm = require_flux(model, "Warmup (FluxAccel)")
    model, compiled = with_own_shapes(model)
    if positive is None:
        positive = synthetic_conditioning_for(dm, text_length)
    if negative is None:
        negative = synthetic_conditioning_for(dm, positive[0][0].shape[1], seed=1)
    text_len = positive[0][0].shape[1]
    model_batch = batch_size * (2 if cfg > 1 else 1)  # ComfyUI batches cond and uncond into one call
    dtype = model.model.get_dtype() if model.model.manual_cast_dtype is None else model.model.manual_cast_dtype
    ch = model.model.latent_format.latent_channels
    seconds = {}
    for w, h in resolutions:
        key = ShapeKey(model_batch, h // 8, w // 8, text_len, dtype_name(dtype))
        if compiled is not None:
            compiled.register_shape(key)
        latent = torch.zeros(batch_size, ch, h // 8, w // 8)
        noise = comfy.sample.prepare_noise(latent, 0)
        t0 = time.perf_counter()
        before = compiled.on_progress if compiled is not None else None
        if compiled is not None and on_compile is not None:
            compiled.on_progress = on_compile
        try:
            comfy.sample.sample(model, noise, steps, cfg, sampler, scheduler, positive, negative, latent,
                                callback=(lambda *a: on_step()) if on_step else None, disable_pbar=True, seed=0)
        finally:
            if compiled is not None:
                compiled.on_progress = before
        seconds[key.describe()] = time.perf_counter() - t0
        log.info("FluxAccel warmup: %s ready in %.1f s", key.describe(), seconds[key.describe()])
    return model, seconds
