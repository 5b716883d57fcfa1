"""Every private name of an upstream that FluxAccel reaches, one adapter module per upstream:

  comfy_internals  -- ComfyUI: the Comfy model compiler and core's per-block CUDA graphs, FLUX's
                      plain RoPE and attention choice, checkpoint-quantized weights, its compile wrapper, versions
  torch_internals  -- torch's dynamo and inductor: compile counters and timers, cudagraph trees, config patches,
                      the cache-artifact manager, AOT-compiled functions
  torchao_internals -- torchao: its FP8 hardware gate, the float8 primitives of its torch-kernel path
  fa3_internals    -- FlashAttention-3's FP8 forward (the fa3-fwd wheel): its custom op, for FP8 attention

Each function detects the name it needs when it is called and returns a defined "not available" answer (an
`Unavailable`, falsy, that names the upstream, its version and the missing name) instead of raising
AttributeError/ImportError. The caller turns that into a degraded but honest behaviour and says so once, through
`say()`: one log line naming the upstream, its version and what FluxAccel does instead. Everything said is kept in
`degradations()` (stats, badge and Benchmark read it).
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

log = logging.getLogger("fluxaccel.upstream")


@dataclass(frozen=True)
class Unavailable:
    """A private upstream name that is not there (moved, renamed or not yet added): falsy, and says what is missing."""

    upstream: str  # "ComfyUI", "torch", "torchao"
    version: str
    name: str  # the dotted name that was looked for
    detail: str = ""

    def __bool__(self) -> bool:
        return False

    def __str__(self) -> str:
        return f"{self.upstream} {self.version} has no {self.name}{f' ({self.detail})' if self.detail else ''}"


_said: dict[tuple[str, str], str] = {}
_lock = threading.Lock()


def say(missing: Unavailable, consequence: str, level: int = logging.WARNING) -> None:
    """Log once per (missing name, consequence): what is missing upstream and what FluxAccel does instead."""
    key = (str(missing), consequence)
    with _lock:
        if key in _said:
            return
        _said[key] = consequence
    log.log(level, "FluxAccel: %s: %s", missing, consequence)


def degradations() -> list[str]:
    """Everything said through say() in this process: 'what is missing: what FluxAccel does instead'."""
    with _lock:
        return [f"{what}: {consequence}" for (what, _), consequence in _said.items()]


def forget() -> None:
    """Tests: start the said-once record afresh."""
    with _lock:
        _said.clear()
