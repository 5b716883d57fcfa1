"""CUDA graphs of whole model calls, captured by FluxAccel, under any CUDA allocator.

Inductor's cudagraph trees do not run under PyTorch's cudaMallocAsync allocator, ComfyUI's default. The blocks are
compiled on their own with inductor's C++ wrapper (which launches its kernels without the Python launcher's pointer
check, the step that fails on memory a capture allocates; config.inductor_options), the model around them runs as
ComfyUI's code, and each call is captured here whole, into one `torch.cuda.CUDAGraph` per call structure:

  * a structure's first call runs uncaptured (it compiles or loads the compiled call, and does first-launch work such
    as loading kernels); its second is captured with static copies of its tensor inputs, then replayed; later calls
    copy their tensors into those copies and replay;
  * a structure is the shape key and every input: tensors by shape, stride, dtype and device; other values by value
    (numbers, strings) or by identity (objects such as the block regions' table, which the graph keeps alive);
    transformer_options arrive filtered (options.py: the sampler's per-call values are not passed);
  * before each replay the model's weights' addresses are compared with the capture's: ComfyUI may unload and reload
    a model, and a graph replays the addresses it captured. Moved weights are captured again (counted, logged);
  * a failed capture is counted and said: its structure runs compiled without graphs from then on. What the failed
    capture allocated is kept (freeing it outside the capture aborts the process under cudaMallocAsync);
  * a shape whose calls keep bringing new structures (an input object made anew for each call) would never replay:
    past CHURN structures met once and never again it is said, naming the first input that differs, and runs without
    graphs. A structure's objects are kept while it is remembered, so that a freed object's id, reused by the next
    one, never passes for it;
  * the output is copied out of graph memory (the next replay overwrites it; the sampler keeps outputs).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..upstream import torch_internals

log = logging.getLogger("fluxaccel.compile")

Capture = Callable[[Callable[[], torch.Tensor]], tuple[object, torch.Tensor]]


def cuda_capture(run: Callable[[], torch.Tensor]) -> tuple[object, torch.Tensor]:
    """(graph, its output): `run` captured into a torch.cuda.CUDAGraph (thread-local mode: other threads' CUDA calls
    are not this capture's concern). graph.replay() runs it again."""
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out = run()
    return graph, out


def structure(value) -> tuple[object, list[torch.Tensor], list[object]]:
    """(spec, tensors, objects): a call's inputs as a hashable spec, its tensors and its other objects (in order)."""
    tensors: list[torch.Tensor] = []
    objects: list[object] = []

    def walk(v):
        if isinstance(v, torch.Tensor):
            tensors.append(v)
            return "T", tuple(v.shape), tuple(v.stride()), str(v.dtype), str(v.device), v.requires_grad
        if isinstance(v, dict):
            return "dict", tuple((k, walk(x)) for k, x in v.items())
        if isinstance(v, (list, tuple)):
            return type(v).__name__, tuple(walk(x) for x in v)
        if v is None or isinstance(v, (bool, int, float, str)):
            return "v", type(v).__name__, v
        objects.append(v)
        return "id", id(v)

    return walk(value), tensors, objects


def rebuilt(value, tensors: list[torch.Tensor]):
    """`value` with its tensors (in structure's order) replaced by `tensors`."""
    it = iter(tensors)

    def walk(v):
        if isinstance(v, torch.Tensor):
            return next(it)
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return type(v)(walk(x) for x in v)
        return v

    return walk(value)


def weight_addresses(module: torch.nn.Module) -> tuple[int, ...]:
    """Where the module's weights and buffers are: what a captured graph reads."""
    return tuple(t.data_ptr() for t in torch_internals.module_tensors(module))


CHURN = 8  # structures of one shape key met once and not again, past which its inputs are said to churn


def first_difference(a, b, where: str = "call") -> str:
    """Where two structures (structure()'s specs) first differ, as a path into the call's inputs."""
    if a == b:
        return ""
    if isinstance(a, tuple) and isinstance(b, tuple) and a[:1] == b[:1] and a[:1] in (("dict",), ("list",), ("tuple",)):
        if a[0] == "dict":
            ka, kb = [k for k, _ in a[1]], [k for k, _ in b[1]]
            if ka != kb:
                return f"{where} (keys {sorted(map(str, set(ka) ^ set(kb)))})"
            return next(first_difference(x, y, f"{where}[{k!r}]") for (k, x), (_, y) in zip(a[1], b[1]) if x != y)
        if len(a[1]) != len(b[1]):
            return f"{where} (length {len(a[1])} vs {len(b[1])})"
        return next(first_difference(x, y, f"{where}[{i}]") for i, (x, y) in enumerate(zip(a[1], b[1])) if x != y)
    return where


@dataclass
class Graph:
    graph: object
    inputs: list[torch.Tensor]  # the static copies the graph reads
    out: torch.Tensor  # the output in graph memory
    weights: tuple[int, ...]
    held: list[object]  # the call's objects, alive while the graph stands for them (the spec holds their ids)


@dataclass
class CallGraphs:
    """The captured calls of one compiled model: at most `limit` graphs (each holds its call's device memory); a call
    past them runs compiled without a graph, counted and said. Counters: replays, captures, recaptures (weights moved),
    uncaptured (compiled calls that ran without a graph, a structure's first call included) and failed (why, per
    structure)."""

    limit: int = 8
    capture: Capture = cuda_capture
    graphs: dict = field(default_factory=dict)
    seen: dict = field(default_factory=dict)  # structures met once, not captured, with their objects (see the notes)
    failed: dict = field(default_factory=dict)
    kept: list = field(default_factory=list)  # what failed captures allocated (see the module's notes)
    replays: int = 0
    captures: int = 0
    recaptures: int = 0
    uncaptured: int = 0
    over_limit: int = 0
    last: dict = field(default_factory=dict)  # per shape key: the structure met before (to say what differs)
    churn: dict = field(default_factory=dict)  # shape keys whose inputs change at every call, with where

    def __call__(self, key, model: torch.nn.Module, fn: Callable, args: tuple, kwargs: dict) -> torch.Tensor:
        """fn(*args, **kwargs), through this call structure's graph where there is one. `model`: whose weights the
        graph reads; `key`: the shape key (it names the structure in messages)."""
        spec, tensors, objects = structure((args, kwargs))
        spec = (key, spec)
        g = self.graphs.get(spec)
        if g is not None and g.weights != weight_addresses(model):
            self.recaptures += 1
            log.warning("FluxAccel: the model's weights moved since the CUDA graph of %s was captured (ComfyUI "
                        "reloaded it): capturing it again", key.describe())
            del self.graphs[spec]
            self.seen[spec] = objects  # known: captured again now
            g = None
        if g is None:
            if spec in self.failed or key in self.churn or spec not in self.seen or not self._room(key):
                self._see(key, spec, objects)
                self.uncaptured += 1
                return fn(*args, **kwargs)
            g = self._capture(spec, model, (fn, args, kwargs), tensors, objects)
            if g is None:
                self.uncaptured += 1
                return fn(*args, **kwargs)
        else:
            for static, t in zip(g.inputs, tensors):
                static.copy_(t)
        g.graph.replay()
        self.replays += 1
        return g.out.clone()

    def _see(self, key, spec, objects: list) -> None:
        """Remember a structure's first call; a shape whose structures keep changing with no replay is said once."""
        if spec in self.seen or key in self.churn:
            return
        self.seen[spec] = objects
        before, self.last[key] = self.last.get(key), spec
        if sum(s[0] == key for s in self.seen) > CHURN:
            where = first_difference(before[1], spec[1]) if before is not None else "?"
            self.churn[key] = f"its inputs change at every call ({where} differs), so no graph is replayed"
            self.seen = {s: o for s, o in self.seen.items() if s[0] != key}
            log.warning("FluxAccel: %s: %s; it runs compiled without a graph", key.describe(), self.churn[key])

    def _room(self, key) -> bool:
        if len(self.graphs) < self.limit:
            return True
        self.over_limit += 1
        if self.over_limit == 1:
            log.warning("FluxAccel: %d CUDA graphs are captured for this model (its limit): %s and any further call "
                        "structure run compiled without a graph", self.limit, key.describe())
        return False

    def _capture(self, spec, model, call: tuple, tensors, objects) -> Graph | None:
        """Capture call = (fn, args, kwargs) on static copies of its tensors; spec = (shape key, structure)."""
        key, (fn, args, kwargs) = spec[0], call
        inputs = [t.clone() for t in tensors]
        s_args, s_kwargs = rebuilt((args, kwargs), inputs)
        t0 = time.perf_counter()
        try:
            graph, out = self.capture(lambda: fn(*s_args, **s_kwargs))
        except Exception as e:  # noqa: BLE001 -- any capture failure: said, counted, the call runs without a graph
            why = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]
            self.failed[spec] = why
            self.kept.append((e, inputs))
            log.warning("FluxAccel: the CUDA graph of %s could not be captured (%s); this call runs compiled without "
                        "a graph from now on", key.describe(), why)
            return None
        self.captures += 1
        self.seen.pop(spec, None)
        log.info("FluxAccel: captured the CUDA graph of %s in %.2f s (%d graph(s) for this model)", key.describe(),
                 time.perf_counter() - t0, len(self.graphs) + 1)
        g = Graph(graph, inputs, out, weight_addresses(model), objects)
        self.graphs[spec] = g
        return g

    def counts(self) -> dict:
        """What the captures did (the model's stats)."""
        return {"captured": len(self.graphs), "captures": self.captures, "replays": self.replays,
                "recaptures": self.recaptures, "uncaptured_calls": self.uncaptured, "over_limit_calls": self.over_limit,
                "failed": {k.describe(): why for k, why in self.failures().items()}}

    def failures(self) -> dict:
        """The shape keys running without graphs (a capture failed, or their inputs change at every call), with why."""
        return {**{spec[0]: why for spec, why in self.failed.items()}, **self.churn}
