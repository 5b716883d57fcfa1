"""What a compiled model reports about its calls, apart from running them: the compile facts of a shape's first call
(time, phases, CUDA graphs skipped), the timing and CUDA-graph health of warm calls, progress while compiling, and
the callbacks that tell the editor. It only observes and records (stats, log); it never changes a call."""
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


def cudagraph_skips() -> int | None:
    """Inductor's running count of graphs it compiled without CUDA graphs; None where torch does not say (said once)."""
    n = torch_internals.cudagraph_skips()
    if isinstance(n, Unavailable):
        say(n, "cannot tell whether inductor compiled a shape without CUDA graphs")
        return None
    return n


def graph_recordings(device: torch.device) -> tuple[int, int] | None:
    """(CUDA graphs recorded, re-recordings counted toward triton.cudagraph_unexpected_rerecord_limit) by inductor's
    cudagraph-trees manager of this thread and device so far; None where there is none yet or torch does not expose
    them (said once)."""
    rec = torch_internals.graph_recordings(device)
    if isinstance(rec, Unavailable):
        say(rec, "cannot tell whether CUDA graphs are recorded or re-recorded")
        return None
    return rec


def phase_totals() -> dict[str, float]:
    timers = torch_internals.compile_timers()
    if isinstance(timers, Unavailable):
        say(timers, "a compile's time is not split by phase")
        return {}
    return {k: sum(timers.get(k, ())) for k in PHASES}


class Telemetry:
    """The observer of one CompiledFlux (its stats, device and graph state); on_compiled(compiled) after a shape
    compiled or its graphs were lost, on_progress(text, seconds) while a shape compiles (compile_progress.Report)."""

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
        st.marks += bool(self.compiled.runner.graphs)  # inductor's cudagraph trees: a step mark before each call
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
        skips_before, phases_before = cudagraph_skips(), phase_totals()
        with CompileWatch(self.on_progress, key.describe()) as watch:
            yield watch
            if x.is_cuda:
                torch.cuda.synchronize(x.device)
        self._record_compile(key, time.perf_counter() - t0, phases_before, skips_before)
        self.notify()

    def _record_compile(self, key: ShapeKey, seconds: float, phases_before: dict, skips_before: int | None) -> None:
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
        skips_after = cudagraph_skips()
        skipped = skips_after - skips_before if skips_after is not None and skips_before is not None else 0
        if skipped and self.compiled.graphs_active:  # correct, but slower: said in stats, label, badge and log
            st.graph_skips[key] = skipped
            st.degrade(f"CUDA graphs ({key.describe()})", f"inductor compiled this shape without (some) graphs, "
                       f"{skipped} time(s); TORCH_LOGS=perf_hints says why", "lost")
            log.warning("FluxAccel: inductor skipped CUDA graphs %d time(s) while compiling %s; this shape runs "
                        "compiled without (some) graphs. The reason: start ComfyUI with TORCH_LOGS=perf_hints.",
                        skipped, key.describe())

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
    def warm_call(self, key: ShapeKey, x: torch.Tensor):
        """Around a call of a compiled shape: host time, device time (CUDA events) and CUDA-graph health."""
        st, c = self.compiled.stats, self.compiled
        events = None
        if x.is_cuda:
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
        watch = c.graphs_active and c.runner.call_graphs is None  # inductor's cudagraph trees (FluxAccel's: above)
        skips_before = cudagraph_skips() if watch else 0
        rec_before = graph_recordings(c.device) if watch else None
        t0 = time.perf_counter()
        yield
        st.host_s.append(time.perf_counter() - t0)
        if events is not None:
            events[1].record()
            st.device_events.append(events)
        if watch:
            self._count_recordings(key, rec_before)
            self._check_graphs(key, skips_before)

    def _count_recordings(self, key: ShapeKey, rec_before: tuple[int, int] | None) -> None:
        """Count the calls that (re-)recorded graphs and warn as inductor's re-record limit nears."""
        st = self.compiled.stats
        rec_after = graph_recordings(self.compiled.device)
        if rec_before is not None and rec_after is not None and rec_after[0] > rec_before[0]:
            st.recording_calls[key] = st.recording_calls.get(key, 0) + 1
            n = st.recording_calls[key] - 1
            if n and (n == 1 or n % 16 == 0):
                log.warning("FluxAccel: CUDA graphs of %s re-recorded (%d time(s); inductor counts %d re-recording(s) "
                            "toward triton.cudagraph_unexpected_rerecord_limit = %d, past which it runs without "
                            "graphs): the model's weights moved, e.g. ComfyUI unloaded and reloaded it.",
                            key.describe(), n, rec_after[1], torch_internals.cudagraph_rerecord_limit())
        if rec_after is None and self.compiled.graphs_running and st.calls >= 2:  # this call is counted after
            # cudagraph trees record on a shape's second or third call; none at all means the graph runs without them
            self._lose(key, "no CUDA graph was recorded for this shape (inductor's cudagraph trees never ran): it "
                            "runs compiled without graphs")

    def _check_graphs(self, key: ShapeKey, skips_before: int | None) -> None:
        """Mark the shape's graphs lost once inductor stopped using them (past its re-record limit)."""
        st = self.compiled.stats
        skips_after = cudagraph_skips() if skips_before is not None else None
        if skips_after is not None and skips_after > skips_before and key not in st.graphs_lost:
            self._lose(key, "inductor stopped using CUDA graphs for this shape after "
                            f"{st.recording_calls.get(key, 1) - 1} re-recording(s) (its "
                            "triton.cudagraph_unexpected_rerecord_limit; TORCH_LOGS=perf_hints says why): it runs "
                            "compiled without graphs. Restart ComfyUI, or keep the model loaded (fewer /free or "
                            "model switches), to get graphs back")

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
