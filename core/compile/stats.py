"""What a compiled model has done and where it runs below what was asked: one stats object per CompiledFlux."""
from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

import torch

from .shapes import ShapeKey

Kind = Literal["off", "lost", "unknown"]


@dataclass(frozen=True)
class Degradation:
    """One thing that runs below what the workflow asked: `what` (e.g. "CUDA graphs"), `why` (with the fix where there
    is one), `kind`: "off" (never on here), "lost" (was on, stopped), "unknown" (cannot be told: not claimed either
    way), and since when (wall-clock time of the process)."""

    what: str
    why: str
    kind: Kind = "off"
    since: str = field(default_factory=lambda: time.strftime("%Y-%m-%d %H:%M:%S"))

    def line(self) -> str:
        return f"{self.what} {'unknown' if self.kind == 'unknown' else self.kind}: {self.why} (since {self.since})"


@dataclass
class CompileStats:
    shapes: list[ShapeKey] = field(default_factory=list)  # allowed to run compiled (ShapePolicy decides)
    compile_seconds: dict[ShapeKey, float] = field(default_factory=dict)
    calls: int = 0
    eager_calls: int = 0
    cache_loaded: bool = False
    graphs_lost: dict[ShapeKey, str] = field(default_factory=dict)  # per shape, why its CUDA graph stopped
    compile_phases: dict[ShapeKey, dict[str, float]] = field(default_factory=dict)  # PHASES seconds per compile
    # per shape, how its compiled call came about (warm_start.py): "loaded" (a package: no tracing), "saved" (traced,
    # compiled and written for the next process), or why there is no package (it then re-traces after a restart)
    warm_start: dict[ShapeKey, str] = field(default_factory=dict)
    warm_start_off: str = ""  # why warm-start packages are not used at all here ("" when they are)
    # per shape, its compile in a separate process (separate.py): running, done in N s, or why it compiled here; and
    # the model calls that ran uncompiled meanwhile (also counted in eager_calls)
    separate: dict[ShapeKey, str] = field(default_factory=dict)
    uncompiled_while_compiling: int = 0
    staged_tensors: int = 0  # CPU inputs of model calls copied to the GPU without blocking the host (staging.py)
    degradations: list[Degradation] = field(default_factory=list)  # what runs below what was asked, and why
    # calls run with the Comfy model compiler's recording paused (ComfyUI 0.34+), and calls where it could not be told
    model_compiler_paused: int = 0
    model_compiler_unknown: int = 0
    attention_note: str = ""  # set when the compiled model runs SDPA in place of ComfyUI's attention (attention.py)
    # last warm calls: host seconds spent inside the call (graph replay is asynchronous, so on a GPU this is the
    # launch overhead: guards, input checks, replay) and (start, end) CUDA events around it (device time)
    host_s: deque = field(default_factory=lambda: deque(maxlen=256))
    device_events: deque = field(default_factory=lambda: deque(maxlen=256))

    def copy(self) -> "CompileStats":
        """The stats of a derived CompiledFlux (CompiledFlux.derive): its own allowed shapes, counters and timing
        windows; what the shared compiled blocks have compiled (compile_seconds, phases) stays shared, so a shape
        one of them compiled is not 'compiled' again by the other."""
        new = CompileStats(**{f: getattr(self, f) for f in self.__dataclass_fields__})
        new.shapes = list(self.shapes)
        new.graphs_lost = dict(self.graphs_lost)
        new.warm_start, new.degradations = dict(self.warm_start), list(self.degradations)
        new.separate = dict(self.separate)
        new.host_s, new.device_events = deque(self.host_s, maxlen=256), deque(self.device_events, maxlen=256)
        return new

    COUNTERS = ("calls", "eager_calls", "uncompiled_while_compiling", "staged_tensors", "model_compiler_paused",
                "model_compiler_unknown")

    def for_another_clone(self) -> "CompileStats":
        """The stats of another clone compiled as this one (patch.apply_compile's reuse): what was compiled and
        how (shapes, compile times, packages, what runs below FluxAccel's best) carried over; its calls counted
        from zero."""
        new = self.copy()
        for name in self.COUNTERS:
            setattr(new, name, 0)
        new.host_s, new.device_events = deque(maxlen=256), deque(maxlen=256)
        return new

    def degrade(self, what: str, why: str, kind: Kind = "off") -> None:
        """Record (once per what) a part of the request that does not run as asked; the log says it where it happens."""
        if not any(d.what == what for d in self.degradations):
            self.degradations.append(Degradation(what, why, kind))

    def call_timings(self) -> dict:
        """Median host and device milliseconds per warm compiled call (synchronizes once to read the events)."""
        out = {}
        if self.host_s:
            out["model_call_host_ms_median"] = round(1000 * statistics.median(self.host_s), 3)
        if self.device_events:
            torch.cuda.synchronize()
            out["model_call_device_ms_median"] = round(statistics.median(a.elapsed_time(b) for a, b in self.device_events), 3)
        return out
