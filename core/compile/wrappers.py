"""Other nodes' diffusion-model wrappers (ComfyUI's WrappersMP.DIFFUSION_MODEL: EasyCache and the like) run around the
compiled call, never inside it.

ComfyUI's FLUX forward runs them itself, inside the model call; there they would be captured into the call's CUDA
graph with whatever they decided at capture time (EasyCache's skip or not). So the compiled model takes them out of
the call's transformer_options and runs them first, as ComfyUI would (its WrapperExecutor, the same positional
arguments as the model's own forward hands them), with the compiled call as their innermost function: a step a
wrapper skips makes no model call at all.
"""
from __future__ import annotations

import inspect
from typing import Callable

import torch

from ..upstream import Unavailable, comfy_internals, say


def outer(transformer_options: dict) -> list:
    """This call's diffusion-model wrappers ([] where there are none, or where this ComfyUI keeps them elsewhere: then
    they stay in the options and the compiled call refuses them by name, options.refuse_unsupported)."""
    found = comfy_internals.diffusion_model_wrappers(transformer_options)
    if isinstance(found, Unavailable):
        say(found, "other nodes' diffusion-model wrappers (EasyCache, ...) are refused by the compiled model")
        return []
    return found


def run_around(call: Callable, dm: torch.nn.Module, wrappers: list, named: dict):
    """call(named) inside `wrappers`: named holds the model call's x, timestep, context, control, transformer_options
    (without the wrappers) and its other inputs; the wrappers get them as dm's own forward takes them."""
    params = [p for p in list(inspect.signature(type(dm).forward).parameters.values())[1:]
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    names, rest = [], dict(named)
    for p in params:  # positionally up to transformer_options, as ComfyUI's FLUX forward hands them on
        names.append(p.name)
        if p.name == "transformer_options":
            break
    args = tuple(rest.pop(n, None) for n in names)

    def inner(*args, **kwargs):
        got = {**dict(zip(names, args)), **kwargs}
        return call({k: v for k, v in got.items() if v is not None or k in ("context", "control")})

    return comfy_internals.run_wrapped(inner, dm, wrappers, args, rest)
