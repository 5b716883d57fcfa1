"""Warm up a compiled FLUX model: real sampling at each shape a workflow will use, so compile and CUDA-graph
capture happen before the first real prompt, and each shape becomes an allowed shape of the compiled model."""
from __future__ import annotations

import contextlib
import logging
import re
import time
from dataclasses import dataclass
from typing import Callable

import comfy.sample
import torch

from ..budget import require_call_room, text_tokens
from ..errors import FluxAccelError
from ..inputs import conditioning
from ..upstream import comfy_internals
from ..models.flux import latent_scale, require_flux
from ..models.synthetic import TEXT_LENGTH, synthetic_conditioning_for
from .config import SHAPES_LIMIT
from .patch import with_own_shapes
from .progress import Report
from .shapes import ShapeKey, dtype_name, references

log = logging.getLogger("fluxaccel.warmup")

NODE = "Warmup (FluxAccel)"
REMOVED_INPUTS: tuple[str, ...] = ("activation_scales",)  # inputs the Warmup node had once
TICKS = 100  # the Warmup node's progress-bar units per sampling step: its bar also moves inside a step that compiles


def _size(part: str, what: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d{1,9})\s*[x×X*]\s*(\d{1,9})", part)
    if not m:
        shown = part if len(part) <= 40 else part[:40] + "..."
        raise FluxAccelError(f"Warmup: cannot read {what} {shown!r} in resolutions; write WIDTHxHEIGHT, e.g. "
                             f"1024x1024, 832x1216, and a reference image's size after a '+', e.g. 1024x1024+1024x1024")
    w, h = int(m.group(1)), int(m.group(2))
    if w % 16 or h % 16 or w < 16 or h < 16:
        raise FluxAccelError(f"Warmup: {what} {w}x{h} in resolutions is not a FLUX size; width and height must be "
                             f"multiples of 16")
    top = comfy_internals.max_resolution()
    if w > top or h > top:
        raise FluxAccelError(f"Warmup: {what} {w}x{h} in resolutions is larger than ComfyUI's largest image side "
                             f"({top}); write sizes of at most {top}x{top}")
    return w, h


def parse_resolutions(text: str) -> list[tuple]:
    """'1024x1024, 832x1216' -> [(1024, 1024), (832, 1216)] as (width, height); multiples of 16 only. A size with
    reference images (FLUX.1 Kontext, FLUX.2 editing) lists them after '+': '1024x1024+1024x1024' ->
    (1024, 1024, ((1024, 1024),))."""
    if not isinstance(text, str):
        raise FluxAccelError(f"Warmup: resolutions must be text, e.g. 1024x1024, got {type(text).__name__}")
    out = []
    for part in re.split(r"[,;\s]+", text.strip()):
        if not part:
            continue
        if len(out) == SHAPES_LIMIT:
            raise FluxAccelError(f"Warmup: resolutions lists more than {SHAPES_LIMIT} sizes, the most one compiled "
                                 f"model holds; list the sizes your workflows use")
        image, *refs = part.split("+")
        entry = _size(image, "resolution")
        if refs:
            entry = (*entry, tuple(_size(r, "reference size") for r in refs))
        if entry not in out:
            out.append(entry)
    if not out:
        raise FluxAccelError("Warmup: no resolution given; write e.g. 1024x1024")
    return out


def _with_references(conditioning, refs: tuple, channels: int, scale: int):
    """A copy of `conditioning` whose every entry carries zero reference latents of these pixel sizes (what
    ReferenceLatent would attach; the values do not matter for compiling)."""
    latents = [torch.zeros(1, channels, h // scale, w // scale) for w, h in refs]
    return [[c, {**extra, "reference_latents": latents}] for c, extra in conditioning]


@dataclass(frozen=True)
class WarmupPlan:
    """What Warmup samples: the resolutions (width, height, and the reference-image sizes where one lists any:
    parse_resolutions), the batch size, the synthetic conditioning's text length (where no conditioning is given),
    the CFG (above 1, ComfyUI batches cond and uncond into one call) and the sampling steps per resolution."""

    resolutions: list[tuple]
    batch_size: int = 1
    text_length: int = TEXT_LENGTH
    cfg: float = 1.0
    steps: int = 2


def _shapes(model, plan: WarmupPlan, positive, negative):
    """Per resolution (with its reference-image sizes, if it lists any): (its ShapeKey, positive, negative, latent)."""
    text_len = text_tokens(model, positive[0][0])
    batch_size = plan.batch_size
    model_batch = batch_size * (2 if plan.cfg > 1 else 1)  # ComfyUI batches cond and uncond into one call
    dtype = model.model.get_dtype() if model.model.manual_cast_dtype is None else model.model.manual_cast_dtype
    ch = model.model.latent_format.latent_channels
    scale = latent_scale(model)
    for w, h, *listed in plan.resolutions:
        require_call_room(NODE, f"resolution {w}x{h} in resolutions (batch_size {batch_size})", model, w, h,
                          model_batch, text_len, listed[0] if listed else ())
        pos, neg = positive, negative
        if listed:
            pos, neg = (_with_references(c, listed[0], ch, scale) for c in (positive, negative))
        refs, method = references(pos[0][1].get("reference_latents"), pos[0][1].get("reference_latents_method"))
        key = ShapeKey(model_batch, h // scale, w // scale, text_len, dtype_name(dtype), refs, method, scale)
        yield key, pos, neg, torch.zeros(batch_size, ch, h // scale, w // scale)


def _sample(model, inputs: tuple, plan: WarmupPlan, on_step):
    """Sample (positive, negative, latent) with euler/simple: what compiles and captures a shape."""
    pos, neg, latent = inputs
    comfy.sample.sample(model, comfy.sample.prepare_noise(latent, 0), plan.steps, plan.cfg, "euler", "simple", pos, neg, latent,
                        callback=(lambda *a: on_step()) if on_step else None, disable_pbar=True, seed=0)


def warmup(model, plan: WarmupPlan, positive=None, negative=None, on_step: Callable[[], None] | None = None,
           on_compile: Report | None = None):
    """Sample plan.steps steps at each of its resolutions. Returns (model, {shape description: seconds of its first
    sampling run}): a clone whose compiled model allows these shapes; the input model (the Compile node's output)
    keeps its own shapes and policy, also when warming up fails. on_step() after every sampling step;
    on_compile(text, seconds): every second while a shape compiles (progress.py)."""
    dm = require_flux(model, NODE)
    conditioning(positive, NODE, "positive")
    conditioning(negative, NODE, "negative")
    if positive is None:
        positive = synthetic_conditioning_for(dm, plan.text_length)
    if negative is None:
        negative = synthetic_conditioning_for(dm, positive[0][0].shape[1], seed=1)
    shapes = list(_shapes(model, plan, positive, negative))
    model, compiled = with_own_shapes(model)
    seconds = {}
    with compiled.compiling_here() if compiled is not None else contextlib.nullcontext():
        for key, pos, neg, latent in shapes:
            seconds[key.describe()] = _warm_one(model, compiled, (key, pos, neg, latent), plan, (on_step, on_compile))
    return model, seconds


def _warm_one(model, compiled, shape: tuple, plan: WarmupPlan, hooks: tuple) -> float:
    """Sample one shape ((key, positive, negative, latent): compiling it, in this process); its seconds. hooks:
    (on_step, on_compile) as warmup's."""
    on_step, on_compile = hooks
    key, pos, neg, latent = shape
    if compiled is not None:
        compiled.register_shape(key)
    t0 = time.perf_counter()
    before = compiled.on_progress if compiled is not None else None
    if compiled is not None and on_compile is not None:
        compiled.on_progress = on_compile
    try:
        _sample(model, (pos, neg, latent), plan, on_step)
    finally:
        if compiled is not None:
            compiled.on_progress = before
    seconds = time.perf_counter() - t0
    log.info("FluxAccel warmup: %s ready in %.1f s", key.describe(), seconds)
    return seconds
