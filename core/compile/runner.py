"""The compiled call itself, read top to bottom: mark a CUDA-graph step, call the compiled whole model (from its
warm-start package where there is one), copy the output out of graph memory."""
from __future__ import annotations

import contextlib
import functools

import torch

from ..errors import FluxAccelError
from ..upstream import Unavailable, comfy_internals, say, torch_internals
from .attention import sdpa_cudnn_first
from .options import call_options
from .reductions import persistent
from .rope import torch_rope

# dynamo's recompile budget is counted per code object: every compiled FLUX compiles the same Flux.forward, so all
# FluxAccel models of a process would share torch's default (8 entries), and a shape past it would run eager with no
# error. FluxAccel's calls run with a budget above anything max_shapes allows (for the duration of our call only).
RECOMPILE_LIMIT = 1024


def recompile_budget():
    return torch_internals.recompile_budget(RECOMPILE_LIMIT)


@contextlib.contextmanager
def one_graph():
    """A graph break (the model cannot be one graph) as an error naming the op, where and the versions."""
    breaks = torch_internals.graph_break_error()
    if isinstance(breaks, Unavailable):
        say(breaks, "a graph break is reported as torch raises it, not as FluxAccel's own message")
        yield
        return
    try:
        yield
    except breaks as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        site = torch_internals.graph_break_site(e)
        raise FluxAccelError(
            f"Compile (FluxAccel) compiles the whole FLUX model as one graph, and torch.compile cannot trace it in one "
            f"piece: {first}{f' (at {site})' if site else ''}. ComfyUI {comfy_internals.comfyui_version()}, torch "
            f"{torch.__version__}. Bypass the Compile node for this model or workflow (Quantize FP8 works without it)."
        ) from e


class Runner:
    """Runs one compiled model call. `compiled` is torch.compile of the whole diffusion model (fullgraph: one graph
    per shape, a graph break is an error), or the model itself where its blocks are compiled on their own; `packages`
    (warm_start.Packages, or None) hands out the call's saved compiled function where it has one. CUDA graphs: `graphs` -- inductor's cudagraph trees (a step mark before each
    call); `call_graphs` (call_graphs.CallGraphs, or None) -- each call captured whole by FluxAccel. `paused`: the
    Comfy model compiler's answer for the last call."""

    def __init__(self, dm: torch.nn.Module, options: dict, graphs: bool, regions=None, packages=None,
                 attention=sdpa_cudnn_first, call_graphs=None, whole: bool = True, mod_table=None):
        self.dm, self.graphs, self.regions, self.packages = dm, graphs, regions, packages
        self.mod_table = mod_table  # mod_table.ModTable: block modulations looked up per call, or None
        self.call_graphs = call_graphs
        self.attention = attention  # the attention override FluxAccel compiles with (options.attention_override)
        # whole: torch.compile of the whole model; else the model runs as it is and its blocks are compiled on their
        # own through the regions' table (graph_capture "call")
        self.compiled = torch.compile(dm, backend="inductor", dynamic=False, fullgraph=True, options=options) \
            if whole else dm
        self.paused = False

    def call_kwargs(self, context, transformer_options: dict, kwargs: dict) -> dict:
        """The keyword arguments of the compiled call (the model's own, with call_options' transformer_options)."""
        return dict(context=context, transformer_options=call_options(transformer_options, self.regions,
                                                                       self.attention), **kwargs)

    def __call__(self, key, x, timestep, context, transformer_options: dict, kwargs: dict,
                 loading=contextlib.nullcontext):
        if self.graphs:
            torch.compiler.cudagraph_mark_step_begin()  # the previous call's outputs may be overwritten from here on
        call_kwargs = self.call_kwargs(context, transformer_options, kwargs)
        if self.regions is not None:  # per-block warm-start packages name the shape they are for, and say their load
            self.regions.shape, self.regions.loading = key, loading
        # plain-torch RoPE (rope.py); persistent row reductions (reductions.py); outside the Comfy model compiler's
        # memory plan, should one be recording
        with one_graph(), recompile_budget(), torch_rope(), persistent(), \
                comfy_internals.outside_model_compiler() as self.paused:
            package = self.packages.get(key, self.dm, (x, timestep), call_kwargs, loading) if self.packages else None
            fn = self.compiled if package is None else functools.partial(package, self.dm)
            if self.mod_table is not None:  # built at a run's first call; the rows looked up inside the call
                fn = self.mod_table.around(fn, self.mod_table.prepare(self.dm, x, timestep, kwargs, transformer_options))
            if self.call_graphs is not None:  # captured (or replayed) whole; its output is already a copy
                return self.call_graphs(key, self.dm, fn, (x, timestep), call_kwargs)
            out = fn(x, timestep, **call_kwargs)
        return out.clone() if self.graphs else out  # the sampler keeps outputs; graph memory is reused on replay
