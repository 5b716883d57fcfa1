"""What a compiled model reports about its calls, apart from running them: the compile facts of a shape's first call
(time, phases), the timing of warm calls, the health of its CUDA-graph captures, progress while compiling, and the
callbacks that tell the editor. It only observes and records (stats, log); it never changes a call."""
from __future__ import annotations

import contextlib
import logging
import time

import torch

from ..upstream import Unavailable, say, torch_internals
from .attention import OVERRIDE_KEY, UNTRACEABLE, comfy_attention_name
from .progress import CompileWatch
from .shapes import ShapeKey

log = logging.getLogger("fluxaccel.compile")

# dynamo's timed phases of one compile (seconds summed over its sub-calls): where a first run's compile time goes
PHASES: tuple[str, ...] = ("bytecode_tracing", "create_aot_dispatcher_function", "GraphLowering.run",
                           "GraphLowering.codegen", "async_compile.wait", "PyCodeCache.load_by_key_path",
                           "AOTAutogradCache.inductor_load", "build_guards")


def phase_totals() -> dict[str, float]:
    timers = torch_internals.compile_timers()
    if isinstance(timers, Unavailable):
        say(timers, "a compile's time is not split by phase")
        return {}
    return {k: sum(timers.get(k, ())) for k in PHASES}


class Telemetry:
    """The observer of one CompiledFlux (its stats, device and graph state); on_compiled(compiled) after a shape
    compiled or its graphs were lost, on_progress(text, seconds) while a shape compiles (progress.Report)."""

    def __init__(self, compiled):
        self.compiled = compiled
        self.on_compiled = None
        self.on_progress = None

    def notify(self) -> None:
        if self.on_compiled is not None:
            self.on_compiled(self.compiled)

    def count_call(self, paused) -> None:
        st = self.compiled.stats
        st.calls += 1
        self._check_captures()
        if paused is True:
            st.model_compiler_paused += 1
        elif paused is not False:
            st.model_compiler_unknown += 1
            say(paused, "cannot keep the compiled model outside the Comfy model compiler's memory plan; start "
                        "ComfyUI with --disable-comfy-compiler if a run fails")

    @contextlib.contextmanager
    def first_call(self, key: ShapeKey, transformer_options: dict, x: torch.Tensor):
        """Around a shape's first (compiling) call; yields its CompileWatch (whose loading_package marks a package
        load in the progress text)."""
        self._say_attention(transformer_options)
        t0 = time.perf_counter()
        phases_before = phase_totals()
        with CompileWatch(self.on_progress, key.describe()) as watch:
            yield watch
            if x.is_cuda:
                torch.cuda.synchronize(x.device)
        self._record_compile(key, time.perf_counter() - t0, phases_before)
        self.notify()

    def _record_compile(self, key: ShapeKey, seconds: float, phases_before: dict) -> None:
        st, packages = self.compiled.stats, self.compiled.packages
        st.compile_seconds[key] = seconds
        phases = {k: round(v - phases_before.get(k, 0), 2) for k, v in phase_totals().items()
                  if v - phases_before.get(k, 0) > 0}
        outcome, load_seconds = packages.outcome_of(key) if packages is not None else (None, None)
        if outcome is not None:
            st.warm_start[key] = outcome
            if load_seconds is not None:
                phases["warm_start_load"] = load_seconds
        st.compile_phases[key] = {**st.compile_phases.get(key, {}), **phases}
        if st.warm_start.get(key) == "loaded":
            log.info("FluxAccel: loaded %s from its warm-start package in %.1f s (nothing compiled)", key.describe(),
                     seconds)
        else:
            log.info("FluxAccel: compiled %s in %.1f s", key.describe(), seconds)

    def _say_attention(self, transformer_options: dict) -> None:
        """Log once when the compiled model runs PyTorch SDPA in place of ComfyUI's untraceable attention."""
        st = self.compiled.stats
        name = comfy_attention_name()
        if name in UNTRACEABLE and OVERRIDE_KEY not in transformer_options and not st.attention_note:
            st.attention_note = (
                f"ComfyUI runs {name} here, which reads free memory inside the model and cannot be compiled; the "
                f"compiled model uses PyTorch SDPA instead (what --use-pytorch-cross-attention selects)")
            log.info("FluxAccel: %s", st.attention_note)

    @contextlib.contextmanager
    def warm_call(self, x: torch.Tensor):
        """Around a call of a compiled shape: host time and device time (CUDA events)."""
        st = self.compiled.stats
        events = None
        if x.is_cuda:
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
        t0 = time.perf_counter()
        yield
        st.host_s.append(time.perf_counter() - t0)
        if events is not None:
            events[1].record()
            st.device_events.append(events)

    def _check_captures(self) -> None:
        """FluxAccel's own captures (call_graphs.py): a shape whose capture failed is lost to graphs (said once)."""
        graphs = self.compiled.runner.call_graphs
        if graphs is None or not (graphs.failed or graphs.churn):
            return
        for key, why in graphs.failures().items():
            if key not in self.compiled.stats.graphs_lost:
                self._lose(key, f"no CUDA graph for it ({why}): it runs compiled without a graph")

    def _lose(self, key: ShapeKey, why: str) -> None:
        st = self.compiled.stats
        st.graphs_lost[key] = why
        st.degrade(f"CUDA graphs ({key.describe()})", why, "lost")
        log.warning("FluxAccel: %s: %s", key.describe(), why)
        self.notify()
