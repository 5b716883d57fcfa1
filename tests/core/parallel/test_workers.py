"""Stopping the workers: the time given to them to exit is one bound for all of them, not one for each."""
import subprocess
import sys
import time

from fluxaccel.core.parallel.workers import _end


def _python(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code])


def test_busy_workers_are_killed_after_one_shared_wait_and_one_that_ends_is_left_to_end():
    """Two workers that read no stop message (busy in a compile) and one that ends by itself: the stop returns after
    the one wait (where waiting for each in turn took twice as long), kills the busy two and lets the third exit."""
    busy = [_python("import time; time.sleep(60)") for _ in range(2)]
    ending = _python("import time; time.sleep(0.3)")
    time.sleep(0.5)  # the interpreters are up (and the third one's sleep is nearly over)
    procs = [*busy, ending]
    started = time.monotonic()
    _end(procs, [], wait_s=1.5)
    took = time.monotonic() - started
    assert [p.returncode for p in busy] == [-9, -9] and ending.returncode == 0
    assert procs == [] and took < 2.5, took
