"""The sequence-parallel workers of one model, seen from ComfyUI's process: started once (one process per GPU, or
per slot on a CPU), given the model's skeleton and weights, then each model call; a worker's death, an error in it,
or a worker that does not answer ends the call with a message, and the next call starts them again.

ComfyUI keeps its sampler, its patches and LoRA handling: the workers get the weights as ComfyUI loaded them for
this clone (LoRAs merged), and afterwards only the tensors that changed (another LoRA strength). They talk to this
process over multiprocessing.connection (pickled), and to each other through torch.distributed (gloo on a CPU,
NCCL on GPUs), where yunchang's all-to-all gathers attention (sequence.py).
"""
from __future__ import annotations

import logging
import os
import pickle
import queue
import secrets
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from multiprocessing.connection import Listener
from pathlib import Path

import torch

from ..cache import folder
from ..compile import skeleton
from ..errors import FluxAccelError
from ..upstream import Unavailable, comfy_internals, say, torch_internals
from .config import ParallelConfig
from .wire import recv, send

log = logging.getLogger("fluxaccel.parallel")

PACKAGE = __name__.rsplit(".core.", 1)[0]  # the name this plugin's package is imported under (ComfyUI: its folder)
WORKER = Path(__file__).with_name("worker.py")
CANCEL_GRACE_S = 1.0  # after Cancel, how long a call in flight may still finish before the workers are stopped


def where(devices: list[str]) -> str:
    """Where the workers run, as every place that shows it says it: '2 GPUs (cuda:0, cuda:1)', or on a machine
    without CUDA devices '2 CPU workers'."""
    if all(d == "cpu" for d in devices):
        return f"{len(devices)} CPU workers (no CUDA device: gpus counts processes on this machine's CPU)"
    return f"{len(devices)} GPUs ({', '.join(devices)})"


class WorkerDied(FluxAccelError):
    """A worker process ended or failed; the message says which and how."""


def launch(devices: list[str], job: dict, work: Path) -> list[subprocess.Popen]:
    """One worker process per device, each given `job` with its rank and device (a job file in `work`, its log
    beside it); workers on the CPU share its cores."""
    env = dict(os.environ)
    if all(d == "cpu" for d in devices):
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // len(devices))))
    procs = []
    for rank, device in enumerate(devices):
        path = work / f"job{rank}"
        path.write_bytes(pickle.dumps({**job, "rank": rank, "device": device, "sys_path": list(sys.path),
                                       "package": PACKAGE, "package_dir": str(Path(__file__).resolve().parents[2]),
                                       "parent": os.getpid()}))
        with open(work / f"worker{rank}.log", "wb") as out:
            procs.append(subprocess.Popen([sys.executable, str(WORKER), str(path)], stdout=out,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=os.getcwd(),
                                          env=env))
    return procs


def changed_weights(dm: torch.nn.Module, sent: dict, stamp_of) -> dict:
    """The weights (state_dict names, CPU copies) written since they were last sent (`sent`: name -> stamp, updated):
    `stamp_of(name)` is the weight's generation stamp (models/generations.py), the one signal of a write."""
    out = {}
    for name, t in dm.state_dict(keep_vars=True).items():
        mark = stamp_of(name)
        if sent.get(name) != mark:
            out[name] = t.detach().cpu()
            sent[name] = mark
    return out


class Workers:
    """N worker processes for one diffusion model. `devices`: one torch device name per worker."""

    def __init__(self, cfg: ParallelConfig, devices: list[str], node: str):
        self.cfg, self.devices, self.node = cfg, devices, node
        self.procs: list[subprocess.Popen] = []
        self.conns: list = []
        weakref.finalize(self, _end, self.procs, self.conns)  # the workers end with the model they serve
        self.sent: dict[str, tuple] = {}  # weight name -> its generation stamp when last sent
        self.holds = None  # what the model they hold is made of besides the loaded weights (patch.py: kind_of)
        self.rebuilds = 0
        self.starts = self.calls = 0
        self.compiled_graphs: int | None = 0  # graphs rank 0 has compiled (its blocks; None: cannot tell)
        self.work: tempfile.TemporaryDirectory | None = None

    def start(self, dm: torch.nn.Module, stamp_of, holds, tell=log.info) -> None:
        """Start the workers and give them the model (its skeleton, then every weight; `stamp_of` as ready takes
        it)."""
        self.stop()
        t0 = time.perf_counter()
        blob, _ = skeleton.dumps(dm)
        flags = comfy_internals.launch_args()
        if isinstance(flags, Unavailable):
            raise FluxAccelError(f"{self.node}: cannot start the workers: {flags} (they need ComfyUI's launch flags)")
        self.work = tempfile.TemporaryDirectory(prefix="fluxaccel-parallel-", dir=folder.temp_dir())
        authkey = secrets.token_bytes(16)
        work, listener = Path(self.work.name), Listener(("127.0.0.1", 0), authkey=authkey)
        tell(f"starting {where(self.devices)}")
        try:
            job = {"world": len(self.devices), "address": listener.address, "authkey": authkey.hex(), "init_method":
                   f"file://{work / 'group'}", "timeout_s": self.cfg.timeout_s, "compile_blocks":
                   self.cfg.compile_blocks, "flags": pickle.dumps(flags)}  # (flags: read once the path is set)
            self.procs.extend(launch(self.devices, job, work))
            self.conns[:] = _connections(self, listener)
        finally:
            listener.close()
        tell(f"{len(self.devices)} workers started")
        self._give_model(dm, stamp_of, holds, tell, blob)
        self.starts += 1
        tell(f"{len(self.devices)} workers ready in {time.perf_counter() - t0:.1f} s")

    def _give_model(self, dm: torch.nn.Module, stamp_of, holds, tell, blob=None) -> None:
        """Give the running workers the model afresh: its skeleton and every weight."""
        if blob is None:
            blob, _ = skeleton.dumps(dm)
        self.sent.clear()
        weights = changed_weights(dm, self.sent, stamp_of)
        tell(f"sending the workers the model ({len(weights)} tensors, "
             f"{sum(t.numel() * t.element_size() for t in weights.values()) / 1024**3:.2f} GiB)")
        self._all(("model", blob, weights), "taking the model")
        self.holds = holds

    def ready(self, dm: torch.nn.Module, stamp_of, holds, tell=log.info) -> int:
        """Make the workers ready for a call of `dm`: started with the model where none runs; given the model afresh
        where the clone's model is made of other parts than theirs (`holds`: another FP8 config or none, another
        fused layout, other object patches); else given exactly the weights written since the last call
        (`stamp_of(name)`: the weight's generation stamp). Returns how many weights were sent. A worker that died
        since the last call is reported (WorkerDied); the next call starts them again."""
        if not self.procs:
            self.start(dm, stamp_of, holds, tell)
            return 0
        self._check_alive("waiting for the next model call")
        if holds != self.holds:
            tell("this model's layers differ from those the workers hold (another FP8 config or none, or other "
                 "patched modules): they take the model afresh")
            self._give_model(dm, stamp_of, holds, tell)
            self.rebuilds += 1
            return 0
        changed = changed_weights(dm, self.sent, stamp_of)
        if changed:
            self._all(("weights", changed), "taking changed weights")
        return len(changed)

    def call(self, inputs: dict, cancelled) -> torch.Tensor:
        """Run one model call on every worker; rank 0's output. `cancelled()`: Cancel pressed (the call in flight
        ends first, then the prompt)."""
        self.calls += 1
        answer = self._all(("call", inputs), "running a model call", cancelled)[0]
        self.compiled_graphs = answer["compiled_graphs"]
        return answer["out"]

    def _all(self, msg: tuple, doing: str, cancelled=None) -> list:
        """Send `msg` to every worker and wait for every answer; a failure stops all of them and says why."""
        try:
            for conn in self.conns:
                send(conn, msg)
            answers = [self._answer(rank, conn, doing, cancelled) for rank, conn in enumerate(self.conns)]
        except (OSError, EOFError) as e:  # a worker's connection broke: which one exited, where that shows
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline and all(p.poll() is None for p in self.procs):
                time.sleep(0.05)
            self._check_alive(doing)
            tail = self._log_tail()
            self.stop()
            raise WorkerDied(f"{self.node}: a worker was lost while {doing} ({type(e).__name__}: {e}){tail}; the "
                             f"next prompt starts the workers again") from None
        errors = [(rank, text) for kind, rank, text in answers if kind == "error"]
        if errors:
            rank, text = errors[0]
            self.stop()
            raise WorkerDied(f"{self.node}: worker {rank} failed while {doing}: {text.strip().splitlines()[-1]}; the "
                             f"next prompt starts the workers again")
        if cancelled is not None and cancelled():
            raise comfy_internals.interrupt_exception()("cancelled")
        return [out for _, _, out in answers]

    def _answer(self, rank: int, conn, doing: str, cancelled=None):
        """Worker `rank`'s answer; after Cancel, a call still running past CANCEL_GRACE_S stops the workers."""
        deadline, cancel_at = time.monotonic() + self.cfg.timeout_s, None
        while not conn.poll(0.1):
            self._check_alive(doing)
            cancel_at = cancel_at or (time.monotonic() if cancelled is not None and cancelled() else None)
            if cancel_at is not None and time.monotonic() - cancel_at > CANCEL_GRACE_S:
                self.stop(wait_s=0.2)  # busy workers read no stop message: killed
                log.info("FluxAccel: %s: Cancel pressed while %s: the workers were stopped; the next prompt starts "
                         "them again", self.node, doing)
                raise comfy_internals.interrupt_exception()("cancelled")
            if time.monotonic() > deadline:
                self.stop()
                raise WorkerDied(f"{self.node}: worker {rank} did not answer within {self.cfg.timeout_s:.0f} s while "
                                 f"{doing}; the next prompt starts the workers again")
        return recv(conn)

    def _check_alive(self, doing: str) -> None:
        dead = [(rank, p.returncode) for rank, p in enumerate(self.procs) if p.poll() is not None]
        if dead:
            rank, code = dead[0]
            tail = self._log_tail(rank) if code is None or code >= 0 else f" (ended by signal {-code})"
            self.stop()
            raise WorkerDied(f"{self.node}: worker {rank} ({self.devices[rank]}) exited with code {code} while "
                             f"{doing}{tail}; the next prompt starts the workers again")

    def _log_tail(self, rank: int = 0) -> str:
        return log_tail(Path(self.work.name) / f"worker{rank}.log") if self.work is not None else ""

    def stop(self, wait_s: float = 5.0) -> None:
        """End every worker (a stop message, then kill what still runs after `wait_s`)."""
        _end(self.procs, self.conns, wait_s)
        self.sent.clear()
        self.holds = None
        if self.work is not None:
            self.work.cleanup()
            self.work = None


def _connections(workers: "Workers", listener: Listener) -> list:
    """Each worker's connection, by rank; a worker that exits before connecting ends the start with its log."""
    got: queue.Queue = queue.Queue()

    def accept():
        try:
            for _ in workers.devices:
                conn = listener.accept()
                got.put((recv(conn)[1], conn))
        except OSError:  # the listener closed: the start failed
            pass

    threading.Thread(target=accept, name="fluxaccel-parallel-accept", daemon=True).start()
    conns, deadline = [None] * len(workers.devices), time.monotonic() + workers.cfg.timeout_s
    while None in conns:
        workers._check_alive("starting")
        if time.monotonic() > deadline:
            tail = workers._log_tail()
            workers.stop()
            raise WorkerDied(f"{workers.node}: the workers did not start within {workers.cfg.timeout_s:.0f} s{tail}")
        try:
            rank, conn = got.get(timeout=0.2)
            conns[rank] = conn
        except queue.Empty:
            pass
    return conns


def log_tail(path: Path) -> str:
    """' (its log: LAST LINE)' of a worker's log, or ''."""
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return f" (its log: {lines[-1][:300]})" if lines else ""


def _end(procs: list, conns: list, wait_s: float = 5.0) -> None:
    """Stop these workers and empty both lists (also when their Workers object is collected: weakref.finalize): a
    stop message to each, `wait_s` in all for them to exit, then a kill for each one still running."""
    for conn in conns:
        try:
            send(conn, ("stop",))
            conn.close()
        except OSError:
            pass
    deadline = time.monotonic() + wait_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    procs.clear()
    conns.clear()
