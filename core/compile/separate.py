"""Compile in a separate process: a shape's first call starts a process that compiles it into its warm-start package
while this process runs the model uncompiled; the first model call after the package is on disk loads it.

Why: on a fresh machine the first compile of FLUX.1-dev is tens of seconds of single-threaded Python (tracing, AOT,
lowering), and a thread of this process would stall ComfyUI's own Python (the interpreter lock). In
a process of its own the compile runs beside the first prompt: that prompt runs at uncompiled speed, and the compiled
model takes over at the sampler's next model call once the package is written (mid-prompt or in the next prompt).

What the process compiles: the call's skeleton (skeleton.py) -- the live module tree and inputs without their data,
rebuilt on the same device as zeros: the weights once more in device memory (checked first; where the device lacks
the room the shape compiles here, and that is said), never in host memory. It writes the package and the kernel-cache
file under the key a compile here would use, so a restart loads them as usual. It runs with this process's ComfyUI
launch flags and environment.

Said, never silent: the log names the process, its log file, how long it took and the calls that ran uncompiled
meanwhile; the stats (describe), the Compile node's badge and the Benchmark see the same. Warmup and Benchmark compile
in this process (or wait for a process already running): they exist to compile before, and to measure, the compiled
model.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..cache.kernels import KernelCache
from ..cache.packages import NotPackageable, Packages, WarmStart, call_description, portable, signature
from ..upstream import Unavailable, comfy_internals
from . import skeleton
from .blocks import BlockTable
from .config import CompileConfig
from .fp8_attention import why_not
from .progress import cancelled
from .reductions import persistent
from .rope import torch_rope
from .runner import recompile_budget

log = logging.getLogger("fluxaccel.compile")

WORKER = Path(__file__).with_name("compile_worker.py")
HEADROOM = 2 * 1024**3  # device memory the process needs beside the weights: its CUDA context and the compile's work
PACKAGE = __name__.rsplit(".core.", 1)[0]  # the name this plugin's package is imported under (ComfyUI: its folder)


@dataclass(eq=False)  # a job is itself: hashed by identity (RUNNING)
class Job:
    """One shape compiling in a separate process. state: "running", "ready" (its package is on disk), "failed" or
    "refused" (it never started); why: the reason for the last two."""

    shape: str
    sig: str
    state: str
    why: str = ""
    proc: subprocess.Popen | None = None
    log_path: Path | None = None
    result_path: Path | None = None
    started: float = dataclasses.field(default_factory=time.monotonic)
    seconds: float | None = None  # wall time from start to finish
    uncompiled_calls: int = 0  # this process's model calls that ran uncompiled while it compiled
    nbytes: int = 0  # device memory its rebuilt model takes
    taken: bool = False  # the model has taken the outcome in (CompiledFlux)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def watch(self, on_done=None) -> None:
        """Say when the process ends, also between prompts (a thread that waits on it: it holds no interpreter lock
        while waiting); on_done() then, e.g. to update the badge."""
        def wait():
            self.proc.wait()
            self.poll()
            if on_done is not None:
                on_done()

        threading.Thread(target=wait, name="fluxaccel-separate-compile", daemon=True).start()

    def poll(self) -> str:
        with self.lock:
            if self.state == "running" and self.proc.poll() is not None:
                self._finish()
        return self.state

    def _finish(self) -> None:
        RUNNING.discard(self)
        self.seconds = round(time.monotonic() - self.started, 1)
        try:
            result = json.loads(self.result_path.read_text())
            self.result_path.unlink()
        except (OSError, ValueError):
            result = {}
        if self.proc.returncode == 0 and result.get("saved"):
            self.state = "ready"
            log.info("FluxAccel: %s compiled in a separate process in %.1f s (%d model call(s) ran uncompiled "
                     "meanwhile); loading its package", self.shape, self.seconds, self.uncompiled_calls)
            return
        self.state = "failed"
        self.why = result.get("error") or f"the process exited with status {self.proc.returncode}: {self._log_tail()}"
        log.warning("FluxAccel: the separate-process compile of %s failed after %.1f s (%s; its log: %s); compiling "
                    "it in this process", self.shape, self.seconds, self.why, self.log_path)

    def _log_tail(self) -> str:
        try:
            lines = [ln for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return "no log"
        return (lines[-1] if lines else "empty log")[:300]

    def wait(self, on_progress=None) -> str:
        """Block until the process ends (Warmup, Benchmark); on_progress(text, seconds) about once a second. Cancel
        ends the wait at once; the process compiles on in the background and its package is used when the shape is
        next met (said)."""
        while self.poll() == "running":
            if on_progress is not None:
                elapsed = time.monotonic() - self.started
                on_progress(f"waiting for the separate-process compile of {self.shape} ({elapsed:.0f} s)", elapsed)
            if cancelled():
                log.info("FluxAccel: Cancel pressed while waiting for the separate-process compile of %s: it goes on "
                         "in the background, and its package is loaded when this shape is next met", self.shape)
                raise comfy_internals.interrupt_exception()("cancelled while a separate process compiles")
            time.sleep(0.5)
        return self.state

    def describe(self) -> str:
        if self.state == "running":
            return f"compiling in a separate process (pid {self.proc.pid}, log {self.log_path})"
        if self.state == "ready":
            return f"compiled in a separate process in {self.seconds} s"
        return f"compiled in this process: {self.why}"


RUNNING: "set[Job]" = set()  # this process's separate compiles not finished yet (any model): their memory is counted


def room(device: torch.device, nbytes: int) -> str:
    """Why the device has no room for a second copy of the weights ('' where it has). The separate compiles still
    running count in full: one that has not allocated yet would otherwise be counted as free memory."""
    device = torch.device(device)
    if device.type != "cuda":
        return ""
    free, _ = torch.cuda.mem_get_info(device)
    busy = sum(j.nbytes + HEADROOM for j in list(RUNNING) if j.state == "running")
    if free >= nbytes + HEADROOM + busy:
        return ""
    gib = 1024**3
    others = f" beside {busy / gib:.1f} GiB for the separate compile(s) still running" if busy else ""
    return (f"the GPU has {free / gib:.1f} GiB free and a separate compile needs {(nbytes + HEADROOM) / gib:.1f} GiB "
            f"(the weights once more){others}")


class SeparateCompiles:
    """The separate-process compiles of one compiled model (one cache key), one per shape."""

    def __init__(self, store: WarmStart, config, device: torch.device, options: dict):
        self.store, self.config, self.device, self.options = store, config, torch.device(device), options
        self.jobs: dict = {}  # ShapeKey -> Job

    def start(self, key, sig: str, dm: torch.nn.Module, args: tuple, kwargs: dict) -> Job:
        """Start compiling this call's shape in a separate process, or say why not (a "refused" job)."""
        shape, kwargs = key.describe(), portable(kwargs)
        try:
            model, nbytes = skeleton.dumps(dm)
            call, _ = skeleton.dumps((args, kwargs))
        except skeleton.NotPortable as e:
            return self._refuse(key, Job(shape, sig, "refused", f"the model or its call cannot be rebuilt in "
                                                                 f"another process ({e})"))
        flags = comfy_internals.launch_args()
        why = room(self.device, nbytes) or (f"{flags}: the process would not run with ComfyUI's launch flags"
                                            if isinstance(flags, Unavailable) else "")
        if why:
            return self._refuse(key, Job(shape, sig, "refused", why))
        base = self.store.dir / f"{self.store.key}-{sig}"
        job = Job(shape, sig, "running", log_path=base.with_suffix(f".compile{os.getpid()}.log"),
                  result_path=base.with_suffix(f".result{os.getpid()}.json"), nbytes=nbytes)
        header = {"key": self.store.key, "signature": sig, "cache_dir": str(self.store.dir), "device": str(self.device),
                  "call": call_description(args, kwargs),
                  "config": dataclasses.asdict(self.config), "options": self.options, "package": PACKAGE,
                  "package_dir": str(Path(__file__).resolve().parents[2]), "sys_path": list(sys.path),
                  "result": str(job.result_path), "parent": os.getpid()}
        try:
            self.store.dir.mkdir(parents=True, exist_ok=True)
            job.result_path.unlink(missing_ok=True)
            job_file = base.with_suffix(f".job{os.getpid()}")
            job_file.write_bytes(pickle.dumps({"header": header, "flags": pickle.dumps(flags), "model": model,
                                                   "call": call}))
            with open(job.log_path, "wb") as out:
                job.proc = subprocess.Popen([sys.executable, str(WORKER), str(job_file)], stdout=out,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=os.getcwd())
        except (OSError, pickle.PicklingError, ValueError) as e:
            return self._refuse(key, Job(shape, sig, "refused", f"could not start it ({type(e).__name__}: {e})"))
        self.jobs[key] = job
        RUNNING.add(job)
        log.info("FluxAccel: compiling %s in a separate process (pid %d, log %s); until it is ready this model runs "
                 "uncompiled, each call counted", shape, job.proc.pid, job.log_path)
        return job

    def runs_uncompiled(self, compiled, key, call) -> bool:
        """Whether this call (runner.ModelCall) of `compiled` (a CompiledFlux) runs uncompiled because a separate process compiles its
        shape (started at the shape's first call); False once that process wrote the package (loaded in this call),
        or where the shape compiles in this call: compiled.here (Warmup, Benchmark), a package on disk, or a separate
        compile refused or failed (recorded in compiled.stats, said in the log)."""
        job = self.jobs.get(key)
        if job is None:
            if compiled.here:
                return False
            job = self._start_for(compiled, key, call)
            if job is None:
                return False
        state = job.poll()
        if state == "running" and compiled.here:
            state = job.wait(compiled.telemetry.on_progress)
        if state == "running":
            job.uncompiled_calls += 1
            return True
        if not job.taken:
            job.taken = True
            compiled.stats.separate[key] = job.describe()
            if state == "ready" and compiled.cache is not None:
                compiled.cache.load()  # the process's artifacts, so that a later save here keeps them in the file
            if state != "ready":
                compiled.stats.degrade(f"compile in a separate process ({key.describe()})",
                                       f"{job.why}; compiled in its first call", "off" if state == "refused" else "lost")
        return False

    def _start_for(self, compiled, key, call) -> Job | None:
        """Start the separate compile of this call's shape; None where its package is on disk already, or the call
        cannot have one (the runner then loads it, or compiles here and says why)."""
        call_kwargs = compiled.runner.call_kwargs(call)
        sig = self._signature(call.x, call.timestep, call_kwargs)
        if sig is None:
            return None
        if compiled.packages.store.blocks_on_disk(sig):
            return None
        job = self.start(key, sig, compiled.runner.dm, (call.x, call.timestep), call_kwargs)
        compiled.stats.separate[key] = job.describe()
        compiled.telemetry.notify()
        if job.state == "running":
            def done():  # the badge learns it between prompts too
                compiled.stats.separate[key] = job.describe()
                compiled.telemetry.notify()

            job.watch(done)
        return job

    @staticmethod
    def _signature(x, timestep, call_kwargs: dict) -> str | None:
        """The whole call's signature (what a separate compile is started for), or None where a package cannot stand
        for the call."""
        try:
            return signature((x, timestep), portable(call_kwargs))
        except NotPackageable:
            return None

    def record(self, compiled, key, call) -> None:
        """After a shape's first compiled call here (its blocks compiled or loaded in this process): write the index
        of its per-block packages, so that a restart loads them instead of starting a separate compile."""
        blocks = compiled.packages.blocks_of(key)
        if not blocks:
            return
        sig = self._signature(call.x, call.timestep, compiled.runner.call_kwargs(call))
        if sig is not None and not compiled.packages.store.blocks_on_disk(sig):
            compiled.packages.store.save_blocks(sig, blocks)

    def _refuse(self, key, job: Job) -> Job:
        self.jobs[key] = job
        log.warning("FluxAccel: %s compiles in this process, not in a separate one: %s", job.shape, job.why)
        return job


# -- the separate process's side (compile_worker.py runs it) -------------------------------------------------------
def work(job: dict) -> dict:
    """Compile the job's call into its warm-start package and kernel-cache file; the result for the parent."""
    h = job["header"]
    device = torch.device(h["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    t0 = time.perf_counter()
    dm = skeleton.loads(job["model"], device)  # parameters made as the server's were: outside inference mode
    # the autograd mode of the server's call (ComfyUI samples in inference mode): part of the call's signature
    mode = torch.inference_mode() if h["call"]["inference"] else torch.set_grad_enabled(h["call"]["grad"])
    with mode:
        return _compile(job, dm, device, t0)


def why_not_here(cfg: CompileConfig, device: torch.device) -> str:
    """What this process lacks for the job's configuration ("" if nothing). The server checked its own; FP8
    attention's check here also registers FlashAttention-3's op with torch, which the traced call looks up."""
    if cfg.attention == "fp8":
        why = why_not(device)
        if why:
            return f"attention 'fp8' cannot run in the compile process: {why}"
    return ""


def _compile(job: dict, dm: torch.nn.Module, device: torch.device, t0: float) -> dict:
    h = job["header"]
    args, kwargs = skeleton.loads(job["call"], device)
    if signature(args, kwargs) != h["signature"]:
        here = call_description(args, kwargs)
        differs = sorted(k for k in here if here[k] != h["call"].get(k))
        return {"saved": False, "error": f"the call rebuilt in the separate process differs in {', '.join(differs)}"}
    cfg = CompileConfig(**h["config"])
    why = why_not_here(cfg, device)
    if why:
        return {"saved": False, "error": why}
    store = WarmStart(h["key"], Path(h["cache_dir"]))
    # each block kind compiled on its own into its package, in a run of the model's call
    packages = Packages(store, h["options"])
    blocks = BlockTable(dm, h["options"], packages)
    blocks.shape = h["signature"]
    kwargs["transformer_options"] = {**blocks.transformer_options(), **kwargs["transformer_options"]}
    log.info("FluxAccel compile process: rebuilt the model and its call in %.1f s", time.perf_counter() - t0)
    cache = KernelCache(h["key"], Path(h["cache_dir"]))
    cache.load()
    with cache.recording(), recompile_budget(), torch_rope(), persistent():
        dm(*args, **kwargs)  # the model around the blocks runs as it is, as in the server
        index = packages.blocks_of(h["signature"])
        saved = bool(index) and store.save_blocks(h["signature"], index)
    cache.save()
    seconds = round(time.perf_counter() - t0, 1)
    log.info("FluxAccel compile process: compiled in %.1f s, package %s", seconds, "saved" if saved else "NOT saved")
    return {"saved": saved, "seconds": seconds, "error": "" if saved else "the package could not be written (its log)"}
