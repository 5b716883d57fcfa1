"""The compiled call itself, read top to bottom: the model runs as ComfyUI's code with its blocks compiled (the block
table in its transformer_options), its modulations looked up where the table applies, the whole call captured into a
CUDA graph or replayed where FluxAccel captures, the output copied out of graph memory."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ..errors import FluxAccelError
from ..upstream import Unavailable, comfy_internals, say, torch_internals
from .attention import sdpa_cudnn_first
from .options import call_options
from .reductions import persistent
from .rope import torch_rope

# dynamo's recompile budget is counted per code object: every compiled FLUX compiles the same block bodies, so all
# FluxAccel models of a process would share torch's default (8 entries), and a shape past it would run eager with no
# error. FluxAccel's calls run with a budget above anything max_shapes allows (for the duration of our call only).
RECOMPILE_LIMIT = 1024


def recompile_budget():
    return torch_internals.recompile_budget(RECOMPILE_LIMIT)


@contextlib.contextmanager
def one_graph():
    """A graph break (a block cannot be one graph) as an error naming the op, where and the versions."""
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
            f"Compile (FluxAccel) compiles each kind of FLUX block as one graph, and torch.compile cannot trace it in "
            f"one piece: {first}{f' (at {site})' if site else ''}. ComfyUI {comfy_internals.comfyui_version()}, torch "
            f"{torch.__version__}. Bypass the Compile node for this model or workflow (Quantize FP8 works without it)."
        ) from e


@dataclass(frozen=True)
class ModelCall:
    """One call of the diffusion model as ComfyUI makes it: the latent, the timestep, the text, the transformer
    options and the other keyword arguments (y, guidance, reference latents, ...)."""

    x: torch.Tensor
    timestep: torch.Tensor
    context: torch.Tensor | None
    transformer_options: dict
    kwargs: dict

    @classmethod
    def of(cls, named: dict, transformer_options: dict) -> "ModelCall":
        """The call of named inputs (x, timestep, context, control and the rest, control kept only where given)."""
        rest = dict(named)
        x, timestep, context, control = (rest.pop(k, None) for k in ("x", "timestep", "context", "control"))
        return cls(x, timestep, context, transformer_options,
                   {**rest, **({"control": control} if control is not None else {})})

    def run(self, dm: torch.nn.Module):
        """The call on `dm` as ComfyUI would make it (uncompiled)."""
        return dm(self.x, self.timestep, context=self.context, transformer_options=self.transformer_options,
                  **self.kwargs)


class Runner:
    """Runs one compiled model call: `dm` (the diffusion model, run as it is) with `blocks` (blocks.BlockTable: each
    kind of block compiled once); `call_graphs` (call_graphs.CallGraphs, or None): each call captured whole;
    `mod_table` (mod_table.ModTable, or None): block modulations looked up per call. `paused`: the Comfy model
    compiler's answer for the last call."""

    def __init__(self, dm: torch.nn.Module, blocks, attention=sdpa_cudnn_first, call_graphs=None, mod_table=None):
        self.dm, self.blocks, self.attention = dm, blocks, attention
        self.call_graphs, self.mod_table = call_graphs, mod_table
        self.paused = False

    def call_kwargs(self, call: ModelCall) -> dict:
        """The keyword arguments of the compiled call (the model's own, with call_options' transformer_options)."""
        return dict(context=call.context, transformer_options=call_options(call.transformer_options, self.blocks,
                                                                            self.attention), **call.kwargs)

    def __call__(self, key, call: ModelCall, loading=contextlib.nullcontext):
        call_kwargs, x, timestep = self.call_kwargs(call), call.x, call.timestep
        self.blocks.shape, self.blocks.loading = key, loading  # per-block packages name the shape, say their load
        # plain-torch RoPE (rope.py); persistent row reductions (reductions.py); outside the Comfy model compiler's
        # memory plan, should one be recording
        with one_graph(), recompile_budget(), torch_rope(), persistent(), \
                comfy_internals.outside_model_compiler() as self.paused:
            fn = self.dm
            if self.mod_table is not None:  # built at a run's first call; the rows looked up inside the call
                fn = self.mod_table.around(fn, self.mod_table.prepare(self.dm, call))
            if self.call_graphs is not None:  # captured (or replayed) whole; its output is already a copy
                return self.call_graphs(key, self.dm, fn, (x, timestep), call_kwargs)
            return fn(x, timestep, **call_kwargs)
