"""core/compile/progress.py: the phase of a compile read off torch's own timers, reported while the compile runs."""
import re
import sys
import threading
import time

import pytest
import torch

from fluxaccel.core.compile.config import CompileConfig

from fluxaccel.core.compile.compiled import CompiledFlux, Setup
from fluxaccel.core.compile.progress import FIRST_RUN, PHASES, CompileWatch, phase
from fluxaccel.core.upstream import comfy_internals
from support.runs import flux_inputs


def test_phase_is_the_first_whose_timer_has_not_moved():
    before = {"bytecode_tracing": 3, "GraphLowering.run": 1}
    assert phase(before, dict(before)) == "tracing the model (dynamo)"
    assert phase(before, {**before, "bytecode_tracing": 4}) == "AOT autograd and lowering (inductor)"
    assert phase({}, {timer: 1 for timer, _ in PHASES}) == FIRST_RUN


def test_a_process_that_never_compiled_reads_its_first_phase(monkeypatch):
    """torch's timers are an empty dict before the process's first compile: that is 'nothing ended yet' (the first
    phase), not 'timers unavailable' (H200, 2026-12-02: a restarted server's progress said 'phase unknown')."""
    from fluxaccel.core.compile import progress as compile_progress
    from fluxaccel.core.upstream import torch_internals

    monkeypatch.setattr(torch_internals, "compile_timers", lambda: {})
    counts = compile_progress._counts()
    assert counts == {timer: 0 for timer, _ in PHASES}
    assert phase(counts, counts) == "tracing the model (dynamo)"


def test_a_real_compile_reports_its_phases_until_ready(tiny_flux, tmp_path, monkeypatch):
    """Reports every second from a watcher thread while the sampler's thread compiles; a report that raises (an editor
    that went away) stops neither the reports nor the compile. (An inductor cache of its own: a compile that found
    its kernels in an earlier test's cache would be over before a second report.)"""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch._dynamo.reset()
    dm = tiny_flux.model.diffusion_model
    c = CompiledFlux(dm, CompileConfig(persistent_cache=False, separate_process=False), Setup(torch.device("cpu"), CompileConfig().inductor_options(capture=False), "t"))
    seen = []

    def report(text, seconds):
        seen.append((text, seconds))
        if len(seen) == 2:
            raise ConnectionError("the editor went away")

    c.on_progress = report
    x, t, ctx, y, guidance = flux_inputs(dm)
    out = c(x, t, context=ctx, y=y, guidance=guidance)
    assert torch.isfinite(out).all() and c.stats.calls == 1
    texts = [s for s, _ in seen]
    what = "batch 1, latent 16x16 (128x128 px), 16 text tokens, bfloat16"
    assert texts[0] == f"compiling {what}: 0 s, starting", texts  # tracing or loading a package: not known yet
    assert re.fullmatch(rf"compiling {re.escape(what)}: ready after [\d.]+ s", texts[-1]), texts
    assert len(seen) >= 3 and [s for _, s in seen] == sorted(s for _, s in seen), seen
    phases = {s.split(" s, ", 1)[1] for s in texts[1:-1]}
    assert phases and phases <= {w for _, w in PHASES} | {FIRST_RUN}, phases
    n = len(seen)
    c(x, t, context=ctx, y=y, guidance=guidance)
    assert len(seen) == n, "a warm call compiles nothing and reports nothing"


def test_a_cancel_lost_in_a_finalizer_is_raised_again_and_ends_the_call_within_two_seconds(monkeypatch):
    """Cancel raises ComfyUI's interrupt in the compiling thread. Where it lands in a finalizer that the garbage
    collector runs in that thread, Python only reports it (sys.unraisablehook) and the thread goes on: the watcher
    raises it again while the call runs, and the call ends within 2 s of Cancel."""
    interrupt = comfy_internals.interrupt_exception()
    swallowed = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: swallowed.append(u.exc_type))
    pressed = threading.Event()
    watch = CompileWatch(None, "a test call", cancelled=pressed.is_set)

    class Finalized:
        def __del__(self):
            # Python code running when the watcher raises the interrupt: it lands here, and is only reported
            end = time.monotonic() + 5.0
            while not watch._cancel_sent and time.monotonic() < end:
                pass
            end = time.monotonic() + 0.2
            while time.monotonic() < end:
                pass

    with pytest.raises(interrupt):
        with watch:
            obj = Finalized()
            pressed.set()
            t0 = time.monotonic()
            del obj
            while time.monotonic() - t0 < 10.0:  # the rest of the compile
                time.sleep(0.01)
    assert time.monotonic() - t0 < 2.0
    assert swallowed == [interrupt]
