"""CUDA graphs captured around the compiled call, for processes whose allocator is cudaMallocAsync.

ComfyUI 0.33 runs PyTorch's cudaMallocAsync allocator by default, and inductor's CUDA-graph trees do not work under
it ("cudaMallocAsync does not yet support checkPoolLiveAllocations", bench/NOTES.md). A plain `torch.cuda.CUDAGraph`
does: the async allocator is built to be captured (allocations become graph memory nodes at fixed addresses). So
does core ComfyUI's own per-block graphs (comfy/model_prefetch.py, `torch.cuda.graph(..., capture_error_mode=
"thread_local")`). Here the whole compiled FLUX call is captured the same way:

  * one graph per call signature: the shapes, dtypes and strides of every tensor argument, and every non-tensor
    argument (rope options, the attention override, block regions' table) -- these are baked into the graph;
  * the first call of a signature runs the compiled model uncaptured (it compiles, autotunes, initialises cuBLAS and
    cuDNN); the second one captures; later ones copy their inputs into the graph's static buffers and replay;
  * the graph reads the weights at the addresses they had at capture: the addresses of every parameter and buffer
    are compared before each replay, and a moved model (a reload after /free, new LoRA weights set as new
    tensors) is captured again -- counted as a recapture;
  * the output lives in graph memory that the next replay overwrites, so the caller gets a copy.

Nothing here is silent: a capture that fails is logged with its error, and every later call of that signature runs
without graphs, counted in `ungraphed_calls` (the Compile node's stats, report and badge read it).
"""
from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

log = logging.getLogger("fluxaccel.compile")

_PRIMITIVE = (int, float, bool, str, bytes, type(None))


def _leaf_key(leaf):
    if isinstance(leaf, torch.Tensor):
        return ("tensor", tuple(leaf.shape), leaf.dtype, leaf.device, tuple(leaf.stride()))
    if isinstance(leaf, _PRIMITIVE):
        return leaf
    return ("object", type(leaf).__qualname__, id(leaf))  # functions, modules, dtypes: by identity


def signature(args: tuple, kwargs: dict) -> tuple:
    """What a captured graph is specialised to: the argument structure, tensor metadata and non-tensor values."""
    leaves, spec = tree_flatten((args, kwargs))
    return (str(spec), tuple(_leaf_key(x) for x in leaves))


def _storage_ptrs(t: torch.Tensor) -> tuple:
    if type(t) in (torch.Tensor, torch.nn.Parameter) or not hasattr(t, "__tensor_flatten__"):
        return (t.data_ptr(),)
    names, _ = t.__tensor_flatten__()  # a tensor subclass (torchao's Float8Tensor): its inner tensors
    return tuple(itertools.chain.from_iterable(_storage_ptrs(getattr(t, n)) for n in names))


def weight_addresses(module: torch.nn.Module) -> tuple:
    """Device addresses of every parameter and buffer of `module` (what a captured graph reads in place)."""
    return tuple(itertools.chain.from_iterable(_storage_ptrs(t) for t in
                                               itertools.chain(module.parameters(), module.buffers())))


@dataclass
class Captured:
    graph: object  # torch.cuda.CUDAGraph
    inputs: list  # static tensor buffers, in flatten order
    spec: object
    leaves: list  # the flattened arguments with tensors replaced by `inputs`
    output: torch.Tensor
    weights: tuple


@dataclass
class CaptureStats:
    captures: int = 0  # graphs captured (first captures and recaptures)
    recaptures: int = 0  # captured again because the weights moved
    replays: int = 0
    ungraphed_calls: int = 0  # calls that ran compiled but without a graph (a signature's first call, a failure)
    failed: dict = field(default_factory=dict)  # signature description -> the capture error


def _cuda_capture(fn: Callable[[], torch.Tensor]):
    """Capture fn() into a new CUDA graph (ComfyUI's own way: thread-local capture mode) and return (graph, out)."""
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out = fn()
    return graph, out


class CapturedGraphs:
    """Runs `fn(*args, **kwargs)` through one captured CUDA graph per call signature."""

    def __init__(self, fn: Callable, module: torch.nn.Module, capture: Callable = _cuda_capture):
        self._fn, self._module, self._capture = fn, module, capture
        self._graphs: dict[tuple, Captured] = {}
        self._seen: set[tuple] = set()
        self.stats = CaptureStats()

    def __len__(self) -> int:
        return len(self._graphs)

    def reset(self) -> None:
        """Drop every graph (their memory goes back to the allocator)."""
        for c in self._graphs.values():
            reset = getattr(c.graph, "reset", None)
            if reset is not None:
                reset()
        self._graphs.clear()
        self._seen.clear()

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        sig = signature(args, kwargs)
        if sig in self.stats.failed or sig not in self._seen:
            self._seen.add(sig)  # first call of this signature: compile and initialise, uncaptured
            self.stats.ungraphed_calls += 1
            return self._fn(*args, **kwargs)
        weights = weight_addresses(self._module)
        cap = self._graphs.get(sig)
        if cap is not None and cap.weights != weights:
            log.info("FluxAccel: the model's weights moved (reloaded or re-patched); capturing its CUDA graph again")
            self.stats.recaptures += 1
            self._drop(sig)
            cap = None
        if cap is None:
            cap = self._capture_for(sig, args, kwargs, weights)
            if cap is None:
                self.stats.ungraphed_calls += 1
                return self._fn(*args, **kwargs)
        else:
            leaves, _ = tree_flatten((args, kwargs))
            for buf, x in zip(cap.inputs, (x for x in leaves if isinstance(x, torch.Tensor))):
                buf.copy_(x)
        cap.graph.replay()
        self.stats.replays += 1
        return cap.output.clone()

    def _drop(self, sig) -> None:
        c = self._graphs.pop(sig)
        reset = getattr(c.graph, "reset", None)
        if reset is not None:
            reset()

    def _capture_for(self, sig, args, kwargs, weights) -> Captured | None:
        leaves, spec = tree_flatten((args, kwargs))
        inputs = [x.clone() for x in leaves if isinstance(x, torch.Tensor)]
        it = iter(inputs)
        static = [next(it) if isinstance(x, torch.Tensor) else x for x in leaves]

        def run():
            a, kw = tree_unflatten(static, spec)
            return self._fn(*a, **kw)

        try:
            graph, out = self._capture(run)
        except Exception as e:  # logged, counted and shown; this signature runs without graphs from now on
            self.stats.failed[sig] = f"{type(e).__name__}: {e}"[:300]
            log.warning("FluxAccel: capturing the compiled FLUX call as a CUDA graph failed (%s); this shape runs "
                        "compiled without CUDA graphs", self.stats.failed[sig])
            return None
        if not isinstance(out, torch.Tensor):
            self.stats.failed[sig] = f"the compiled call returned {type(out).__name__}, not a tensor"
            log.warning("FluxAccel: %s; this shape runs compiled without CUDA graphs", self.stats.failed[sig])
            return None
        self.stats.captures += 1
        cap = Captured(graph, inputs, spec, static, out, weights)
        self._graphs[sig] = cap
        return cap
