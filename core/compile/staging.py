"""The sampler's CPU inputs reach the GPU without making the host wait for it (compiled models on a GPU).

ComfyUI keeps the conditioning on the CPU and concatenates it anew for every model call; BaseModel._apply_model then
copies it to the GPU with a blocking copy from pageable memory. That copy returns only once the GPU has reached it,
so the host cannot prepare call n+1 while the GPU runs call n: after every call the GPU waits while the host walks
from the copy to the next call's first kernel: a captured call's replay starts late by that walk.

Staging copies each CPU tensor among the call's inputs (the latent, the conditioning, pooled vectors, guidance:
not transformer_options) into pinned memory and from there to the GPU with a non-blocking copy, before ComfyUI's own
cast: ComfyUI then finds them on the GPU, and casts there. The values are the same bits (a copy; the dtype cast is
ComfyUI's, as before). torch's pinned-memory allocator keeps each pinned block until its copy has run. Where pinned
memory cannot be had (a locked-memory limit), the call runs with ComfyUI's own copy and that is said once
(`on_fail`), not retried at every call.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

log = logging.getLogger("fluxaccel.compile")

Copy = Callable[[torch.Tensor, torch.device], torch.Tensor]


def pinned_copy(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """t on `device`, through pinned memory, without the host waiting for the copy."""
    return t.pin_memory().to(device, non_blocking=True)


def staged(args: tuple, kwargs: dict, device: torch.device, copy: Copy = pinned_copy) -> tuple[tuple, dict, int]:
    """(args, kwargs, number of tensors staged): the top-level CPU tensors of a model call moved to `device` (a CUDA
    device; any other device: unchanged). transformer_options and other containers are left as they are."""
    if torch.device(device).type != "cuda":
        return args, kwargs, 0
    n = 0

    def move(v):
        nonlocal n
        if isinstance(v, torch.Tensor) and v.device.type == "cpu":
            n += 1
            return copy(v, device)
        return v

    return tuple(move(a) for a in args), {k: move(v) for k, v in kwargs.items()}, n


def staging_wrapper(inner: Callable, device: torch.device, stats, copy: Copy = pinned_copy) -> Callable:
    """An APPLY_MODEL wrapper: `inner` (an APPLY_MODEL wrapper) called with the call's CPU inputs staged on `device`;
    `stats` (a CompileStats) counts the staged tensors, and is told once, with the log, if staging cannot run (then
    it is off: ComfyUI's own copy runs)."""
    failed: list[str] = []

    def apply_staged(executor, *args, **kwargs):
        if not failed:
            try:
                args, kwargs, n = staged(args, kwargs, device, copy)
                stats.staged_tensors += n
            except RuntimeError as e:  # pinned memory refused: ComfyUI's own copy from now on, said once
                failed.append(f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300])
                stats.degrade("the sampler's inputs copied without waiting",
                              f"{failed[0]}; ComfyUI's own copy runs (the host waits for the GPU at every call)")
                log.warning("FluxAccel: pinned-memory copies of the sampler's inputs are off from now on: %s; "
                            "ComfyUI's own copy runs", failed[0])
        return inner(executor, *args, **kwargs)

    return apply_staged
