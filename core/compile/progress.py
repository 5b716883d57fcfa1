"""Progress of one compile for a person watching it: the phase torch is in and the seconds so far, reported every
`interval` seconds from a watcher thread while the compiling call blocks the sampler.

The phase is read from torch's own compile timers (`torch._dynamo.utils.compilation_time_metrics`): a timer is
recorded when its phase ends, so the phase now running is the first of PHASES whose timer has not moved since the
compile began. A warm-start package that loads reports "loading the warm-start package" instead.
"""
from __future__ import annotations

import ctypes
import logging
import threading
import time
from contextlib import contextmanager
from typing import Callable

from ..upstream import Unavailable, comfy_internals, say, torch_internals

log = logging.getLogger("fluxaccel.compile")

# (timer that ends the phase, what runs until then), in the order a compile runs them
PHASES: tuple[tuple[str, str], ...] = (
    ("bytecode_tracing", "tracing the model (dynamo)"),
    ("GraphLowering.run", "AOT autograd and lowering (inductor)"),
    ("GraphLowering.codegen", "generating kernels (inductor)"),
    ("async_compile.wait", "compiling kernels (Triton / C++)"),
    ("create_aot_dispatcher_function", "finishing the compiled graph"),
)
FIRST_RUN = "first run of the compiled graph"

Report = Callable[[str, float], None]  # (text, seconds since the compile began)


UNKNOWN_PHASE = "phase unknown (torch's compile timers are not where FluxAccel reads them)"


def _counts() -> dict[str, int] | None:
    """How many times each phase's timer has ended so far; None where torch does not expose its timers."""

    timers = torch_internals.compile_timers()  # an empty dict before the process's first compile
    return None if isinstance(timers, Unavailable) else {k: len(timers.get(k, ())) for k, _ in PHASES}


def phase(before: dict[str, int] | None, now: dict[str, int] | None) -> str:
    """The phase running now, given the timer counts when the compile began and now."""
    if before is None or now is None:
        return UNKNOWN_PHASE
    for timer, what in PHASES:
        if now.get(timer, 0) <= before.get(timer, 0):
            return what
    return FIRST_RUN


def cancelled() -> bool:
    """Whether the user pressed Cancel in ComfyUI (False where this ComfyUI cannot tell: said once)."""
    asked = comfy_internals.interrupt_requested()
    if isinstance(asked, Unavailable):
        say(asked, "a compile runs to its end after Cancel")
        return False
    return asked


def _raise_in(thread_id: int, exc: type | None) -> None:
    """Raise `exc` in the thread `thread_id` at its next Python instruction (None: take back one not raised yet)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc else None)


CANCEL_POLL_S = 0.1  # how often the watcher looks for Cancel (the prompt must end within 2 s of it)
CANCEL_RESEND_S = 0.5  # how long after raising the interrupt, with the call still running, it is raised again


class CompileWatch:
    """Context manager around one compiling call: report(text, elapsed) now, every `interval` seconds, and at the end.
    A report that raises is logged and stops nothing (the compile must not fail for its progress display).

    Cancel: the compile is Python running in the sampler's thread, which checks for Cancel only between steps. The
    watcher checks `cancelled` every CANCEL_POLL_S and, once it is true, raises ComfyUI's interrupt in the compiling
    thread; the call ends as a cancelled prompt, whatever torch made of the exception on its way out, and nothing
    of the compile is saved (its files are written after the call). Where torch holds the thread in C code the
    exception lands when Python runs again. One that lands where Python only prints it (a finalizer or weakref
    callback the garbage collector runs in that thread) is lost, so while the call still runs it is raised again
    every CANCEL_RESEND_S."""

    def __init__(self, report: Report | None, what: str, interval: float = 1.0,
                 cancelled: Callable[[], bool] | None = cancelled):
        self.report, self.what, self.interval, self.cancelled = report, what, interval, cancelled
        self.loading = False  # while a warm-start package loads (loading_package)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._compiling = False
        self._cancel_sent = False

    @contextmanager
    def loading_package(self):
        """Around loading a warm-start package: the reports say so instead of a compile phase."""
        self.loading = True
        try:
            yield
        finally:
            self.loading = False

    def text(self, elapsed: float | None) -> str:
        """The report at `elapsed` seconds; None: the call's start, before it is known whether it traces the model or
        loads a warm-start package."""
        if elapsed is None:
            return f"compiling {self.what}: 0 s, starting"
        doing = "loading the warm-start package" if self.loading else phase(self._before, _counts())
        return f"compiling {self.what}: {elapsed:.0f} s, {doing}"

    def _send(self, text: str, elapsed: float) -> None:
        try:
            self.report(text, elapsed)
        except (ImportError, AttributeError, RuntimeError, OSError, ValueError, TypeError) as e:
            # a display must never break the compile: said, and the compile goes on
            log.warning("FluxAccel: compile progress not shown (%s: %s)", type(e).__name__, e)

    def _loop(self) -> None:
        reported = sent_at = 0.0
        while not self._stop.wait(min(self.interval, CANCEL_POLL_S)):
            elapsed = time.perf_counter() - self._t0
            if self.report is not None and elapsed - reported >= self.interval:
                reported = elapsed
                self._send(self.text(elapsed), elapsed)
            if self.cancelled is not None and (not self._cancel_sent or elapsed - sent_at >= CANCEL_RESEND_S) \
                    and self.cancelled():
                with self._lock:
                    if self._compiling:
                        if not self._cancel_sent:
                            log.info("FluxAccel: Cancel pressed: stopping the compile of %s after %.1f s", self.what,
                                     elapsed)
                        self._cancel_sent, sent_at = True, elapsed
                        _raise_in(self._owner, comfy_internals.interrupt_exception())

    def __enter__(self) -> "CompileWatch":
        self._before, self._t0 = _counts(), time.perf_counter()
        self._owner, self._compiling = threading.get_ident(), True
        if self.report is not None:
            self._send(self.text(None), 0.0)
        if self.report is not None or self.cancelled is not None:
            self._thread = threading.Thread(target=self._loop, name="fluxaccel-compile-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        with self._lock:
            self._compiling = False
            if self._cancel_sent:
                _raise_in(self._owner, None)  # not raised yet (the call ended first): taken back
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        elapsed = time.perf_counter() - self._t0
        if self.report is not None:
            end = "cancelled" if self._cancel_sent else "failed" if exc_type is not None else "ready"
            self._send(f"compiling {self.what}: {end} after {elapsed:.1f} s", elapsed)
        if self._cancel_sent and not isinstance(exc, comfy_internals.interrupt_exception()):
            raise comfy_internals.interrupt_exception()("the compile was cancelled") from exc
