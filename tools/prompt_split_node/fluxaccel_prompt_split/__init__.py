"""A ComfyUI custom node package of FluxAccel's tools, never of the plugin: loaded only by servers that
tools/comfy_server.py starts with prompt_split set. It times where each prompt's time goes, inside the server, and
appends one JSON line per prompt to the file named by FLUXACCEL_PROMPT_SPLIT (its one node, FluxAccelPerModulePatches,
is for an A/B of how FluxAccel lays out its object patches; see PerModulePatches):

- prompt_s: PromptExecutor.execute_async, host wall time (what ComfyUI's execution_start → execution_success spans);
- nodes_s: each node class's host time in execution.execute (cached nodes included: their lookup);
- load_models_gpu_s, sample_s: comfy.model_management.load_models_gpu and comfy.sample.sample, host wall time;
- model_calls, calls_host_s: BaseModel.apply_model's calls and the host's time inside them;
- gpu (CUDA only, else null): from CUDA events recorded at the prompt's start and around every model call, read once
  the prompt has ended (no synchronization inside it): calls_s (the GPU's time from each call's first to its last
  work), first_call_start_s, last_call_end_s, end_s (the prompt's end as the GPU reached it), all from the prompt's
  start. The GPU is idle for first_call_start_s before the first call, for (last_call_end_s − first_call_start_s −
  calls_s) between calls, and the prompt goes on for prompt_s − last_call_end_s after the last call's work.

The wrappers cost a few microseconds per call; nothing else changes in the server.

With FLUXACCEL_PROMPT_PROFILE=1 each prompt also runs under cProfile (the worker thread's Python functions) and
torch.profiler (torch ops and CUDA runtime calls on the host, and the GPU's kernels, those replayed by a CUDA graph
included), and its line carries the tables ("python": the functions by cumulative time, "torch": ops and runtime calls
by self host time, "kernels": the GPU's kernels by total time, "kernel_classes": that time summed by kind, all
milliseconds per prompt). With FLUXACCEL_PROMPT_PROFILE set to a file's path, only the prompts that start while that
file exists are profiled. The profilers slow the host: such a prompt says where the host's time goes and what the GPU
ran, not how long a prompt takes.
"""
from __future__ import annotations

import cProfile
import contextlib
import functools
import io
import json
import logging
import os
import re
import time

log = logging.getLogger("fluxaccel.prompt_split")


def _swaps():
    """The plugin's core.models.swaps as the server loaded it (under the plugin folder's name; importing it again as
    `fluxaccel` would make a second copy of core)."""
    import sys

    return next(m for n, m in list(sys.modules.items()) if n.endswith(".core.models.swaps"))


class PerModulePatches:
    """A clone of the model with FluxAccel's block patches laid out again as one object patch per swapped module, as
    FluxAccel patched before it grouped them per block: the same modules run, ComfyUI re-applies more patches at every
    prompt. For the same-server A/B of the two layouts (tools/first_prompts.py's `fluxaccel-per-module`)."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",)}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "run"
    CATEGORY = "FluxAccel/tools"

    def run(self, model):
        swapped_in = _swaps().swapped_in
        clone = model.clone()
        for key, obj in list(clone.object_patches.items()):
            inside = swapped_in(obj)
            if inside is not None:
                del clone.object_patches[key]
                for name, module in inside.items():
                    clone.add_object_patch(f"{key}.{name}", module)
        return (clone,)


NODE_CLASS_MAPPINGS: dict = {"FluxAccelPerModulePatches": PerModulePatches}


class _Prompt:
    """What one prompt measured (ComfyUI runs one prompt at a time)."""

    def __init__(self, prompt_id: str):
        import torch

        self.prompt_id, self.t0 = prompt_id, time.perf_counter()
        self.nodes: dict[str, float] = {}
        self.load = self.sample = self.calls_host = 0.0
        self.n_calls = 0
        self.first_call_host = self.last_return_host = None
        self.cuda = torch.cuda.is_available()
        self.start_event = self._event()
        self.call_events: list[tuple] = []
        self.end = self.end_event = None  # finish()

    def _event(self):
        if not self.cuda:
            return None
        import torch

        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def finish(self) -> None:
        """The prompt's end, on the host and as the GPU reaches it (before any profiler's own teardown)."""
        self.end, self.end_event = time.perf_counter(), self._event()

    def line(self) -> dict:
        end, end_event = self.end, self.end_event
        gpu = None
        if self.cuda:
            import torch

            torch.cuda.synchronize()  # the prompt has ended: nothing of its timing waits on this
            at = lambda e: round(self.start_event.elapsed_time(e) / 1000, 5)  # noqa: E731
            gpu = {"calls_s": round(sum(a.elapsed_time(b) for a, b in self.call_events) / 1000, 5),
                   "first_call_start_s": at(self.call_events[0][0]) if self.call_events else None,
                   "last_call_end_s": at(self.call_events[-1][1]) if self.call_events else None,
                   "end_s": at(end_event)}
        rel = lambda t: None if t is None else round(t - self.t0, 5)  # noqa: E731
        return {"prompt_id": self.prompt_id, "prompt_s": round(end - self.t0, 5),
                "nodes_s": {k: round(v, 5) for k, v in self.nodes.items()},
                "load_models_gpu_s": round(self.load, 5), "sample_s": round(self.sample, 5),
                "model_calls": self.n_calls, "calls_host_s": round(self.calls_host, 5),
                "first_call_host_s": rel(self.first_call_host), "last_return_host_s": rel(self.last_return_host),
                "gpu": gpu}


_NOW: list[_Prompt] = []  # the prompt running now, if any


def _timed(add):
    """A wrapper adding the wrapped function's host time to the running prompt through add(prompt, seconds)."""
    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if _NOW:
                    add(_NOW[0], time.perf_counter() - t)
        return inner
    return wrap


@contextlib.contextmanager
def _profiled(tables: dict, rows: int = 80):
    """cProfile and torch.profiler around a prompt; their tables land in `tables` (see the module's notes)."""
    import pstats

    import torch

    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                    if torch.cuda.is_available() else [])
    py = cProfile.Profile()
    with torch.profiler.profile(activities=acts) as tp:
        py.enable()
        try:
            yield
        finally:
            py.disable()
    st = pstats.Stats(py, stream=io.StringIO())
    top = sorted(st.stats.items(), key=lambda kv: -kv[1][3])[:rows]
    tables["python"] = [[f"{os.path.basename(f)}:{line} {name}", nc, round(ct * 1000, 3), round(tt * 1000, 3)]
                        for (f, line, name), (_, nc, tt, ct, _) in top]
    ops = sorted(tp.key_averages(), key=lambda e: -e.self_cpu_time_total)[:rows]
    tables["torch"] = [[e.key, e.count, round(e.self_cpu_time_total / 1000, 3), round(e.cpu_time_total / 1000, 3)]
                       for e in ops]
    tables.update(_kernel_tables(tp.events(), rows))


# a kernel's kind, by its name (the first match, in this order): Triton kernels (inductor's, named after the ops they
# fuse, attention's included; FluxAccel's own activation-quantization kernels), attention kernels (cuDNN's SDPA,
# FlashAttention's, itself a CUTLASS kernel), GEMMs (cuBLAS's nvjet/xmma kernels and their split-K reductions,
# CUTLASS), copies and fills
KERNEL_CLASSES = (("triton", re.compile(r"^triton_|_rowwise_fp8_kernel$")),
                  ("attention", re.compile(r"sdpa|fmha|flash|FlashAttn", re.I)),
                  ("gemm", re.compile(r"gemm|xmma|nvjet|cutlass|splitKreduce", re.I)),
                  ("copy", re.compile(r"memcpy|memset|copy|fill", re.I)))


def _kernel_tables(events, rows: int) -> dict:
    """The GPU's kernels of a profiled prompt: name, count, total ms, the largest first; and the total by kind."""
    from torch.autograd import DeviceType

    totals: dict[str, list] = {}
    for e in events:
        if e.device_type == DeviceType.CUDA:
            t = totals.setdefault(e.name, [0, 0.0])
            t[0] += 1
            t[1] += e.time_range.elapsed_us() / 1000
    classes = {k: 0.0 for k, _ in KERNEL_CLASSES} | {"other": 0.0}
    for name, (_, ms) in totals.items():
        classes[next((k for k, rx in KERNEL_CLASSES if rx.search(name)), "other")] += ms
    top = sorted(totals.items(), key=lambda kv: -kv[1][1])[:rows]
    return {"kernels": [[name, n, round(ms, 3)] for name, (n, ms) in top],
            "kernel_classes": {k: round(v, 3) for k, v in classes.items()},
            "kernels_total_ms": round(sum(ms for _, ms in totals.values()), 3),
            "kernel_launches": sum(n for n, _ in totals.values())}


def _install(path: str) -> None:
    import comfy.model_base
    import comfy.model_management
    import comfy.sample
    import execution

    run_prompt = execution.PromptExecutor.execute_async
    profile_when = os.environ.get("FLUXACCEL_PROMPT_PROFILE", "")
    profiled = (lambda: True) if profile_when == "1" else (lambda: bool(profile_when) and os.path.exists(profile_when))

    @functools.wraps(run_prompt)
    async def execute_async(self, prompt, prompt_id, *args, **kwargs):
        _NOW[:] = [_Prompt(prompt_id)]
        tables: dict = {}
        try:
            with _profiled(tables) if profiled() else contextlib.nullcontext():
                try:
                    return await run_prompt(self, prompt, prompt_id, *args, **kwargs)
                finally:
                    _NOW[0].finish()
        finally:
            p = _NOW.pop()
            with open(path, "a") as f:
                f.write(json.dumps({**p.line(), **tables}) + "\n")

    run_node = execution.execute

    @functools.wraps(run_node)
    async def execute(server, dynprompt, caches, current_item, *args, **kwargs):
        t = time.perf_counter()
        try:
            return await run_node(server, dynprompt, caches, current_item, *args, **kwargs)
        finally:
            if _NOW:
                cls = dynprompt.get_node(current_item)["class_type"]
                _NOW[0].nodes[cls] = _NOW[0].nodes.get(cls, 0.0) + time.perf_counter() - t

    apply_model = comfy.model_base.BaseModel.apply_model

    @functools.wraps(apply_model)
    def timed_apply_model(self, *args, **kwargs):
        p = _NOW[0] if _NOW else None
        if p is None:
            return apply_model(self, *args, **kwargs)
        t = time.perf_counter()
        p.first_call_host = p.first_call_host or t
        before = p._event()
        try:
            return apply_model(self, *args, **kwargs)
        finally:
            p.last_return_host = time.perf_counter()
            p.calls_host += p.last_return_host - t
            p.n_calls += 1
            if p.cuda:
                p.call_events.append((before, p._event()))

    def add_load(p, s):
        p.load += s

    def add_sample(p, s):
        p.sample += s

    execution.PromptExecutor.execute_async = execute_async
    execution.execute = execute
    comfy.model_base.BaseModel.apply_model = timed_apply_model
    comfy.model_management.load_models_gpu = _timed(add_load)(comfy.model_management.load_models_gpu)
    comfy.sample.sample = _timed(add_sample)(comfy.sample.sample)
    log.info("timing each prompt's parts into %s", path)


if os.environ.get("FLUXACCEL_PROMPT_SPLIT"):
    _install(os.environ["FLUXACCEL_PROMPT_SPLIT"])
