"""The Parallel node in a real ComfyUI server on the CPU: UNETLoader -> Parallel (2 workers) -> KSampler equals the
same prompt without it (bf16 weights computed in float32); a worker killed between prompts fails the next prompt with
a message that names it, and the prompt after that starts the workers again and runs, in the same server."""
import os
import signal
from pathlib import Path

import pytest

from tools.comfy_server import PromptFailed

from .conftest import flux_inputs, sample_and_save, saved_latent
from fluxaccel.core.bench.metrics import rel_err

pytestmark = pytest.mark.e2e


def _prompt(parallel: bool, seed: int) -> dict:
    g = flux_inputs(size=48)
    model = "1"
    if parallel:
        g["10"] = {"class_type": "FluxAccelParallel", "inputs": {"model": ["1", 0], "gpus": 2}}
        model = "10"
    g.update(sample_and_save(model, seed=seed, steps=2, tag=f"parallel-{parallel}-{seed}"))
    return g


def _workers(server_pid: int) -> list[int]:
    """The pids of the server's parallel workers (its child processes running core/parallel/worker.py)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmd = (stat.parent / "cmdline").read_bytes().decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == server_pid and "parallel/worker.py" in cmd:
            found.append(int(stat.parent.name))
    return found


def test_parallel_equals_eager_and_a_killed_worker_fails_one_prompt(server):
    eager = saved_latent(server, server.run(_prompt(False, 5)))
    par = saved_latent(server, server.run(_prompt(True, 5)))
    assert rel_err(par, eager) < 1e-4
    workers = _workers(server.proc.pid)
    assert len(workers) == 2
    os.kill(workers[1], signal.SIGKILL)
    with pytest.raises(PromptFailed, match=r"Parallel \(FluxAccel\): worker \d \(cpu\) exited with code -9 .*the next "
                                           r"prompt starts the workers again"):
        server.run(_prompt(True, 6))
    again = saved_latent(server, server.run(_prompt(True, 6)))
    assert rel_err(again, saved_latent(server, server.run(_prompt(False, 6)))) < 1e-4
    assert len(_workers(server.proc.pid)) == 2
