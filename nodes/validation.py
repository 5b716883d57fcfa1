"""Checks our nodes run at prompt validation (V3 validate_inputs), so a bad API prompt is rejected by ComfyUI's
/prompt with a validation error before anything executes. Combo values, minimums and maximums are left to ComfyUI's
own checks: an input named in validate_inputs is not checked by ComfyUI, and a failed validate_inputs is reported
against every input it takes, so each node validates at most the one input ComfyUI cannot (Warmup's resolutions)."""
from __future__ import annotations

import dataclasses
import logging

from ..core.errors import FluxAccelError

log = logging.getLogger("fluxaccel.nodes")


def parses(fn, value) -> bool | str:
    """True if fn(value) accepts it, else the FluxAccelError's message (e.g. a malformed resolutions list)."""
    try:
        fn(value)
    except FluxAccelError as e:
        return str(e)
    return True


# inputs our nodes no longer have, which saved workflows may still carry, and what to do instead
RETIRED = {
    "clear_cache": "clear_cache is no longer a setting of the Compile node: a workflow saved with it on would delete "
                   "the compile cache of every machine that runs it. Nothing was cleared. Clear it explicitly with "
                   "`python custom_nodes/comfyui-fluxaccel/tools/clear_cache.py` (or delete ComfyUI's "
                   "user/fluxaccel/compile-cache folder), and re-add the Compile node in this workflow.",
}


def refuse_unknown_inputs(unknown: dict) -> None:
    """Inputs a prompt gives a node that its schema does not have (the node accepts all inputs so as to see them):
    an error naming each, except a retired one set to what is now done anyway (clear_cache off)."""
    named = {k: v for k, v in unknown.items() if not (k in RETIRED and v is False)}
    if named:
        raise FluxAccelError(" ".join(RETIRED.get(k, f"This node has no input {k!r} (set to {v!r}); remove it from "
                                                       f"the workflow.") for k, v in named.items()))


_SAID: set[str] = set()  # the nodes accept_all_inputs has said it of


def accept_all_inputs(schema_class, node: str) -> dict:
    """The schema option that hands this node every input a prompt gives it ({"accept_all_inputs": True}), so that
    refuse_unknown_inputs sees inputs the node no longer has; {} where this ComfyUI's node schema has no such option
    (0.3.75), said once per node: ComfyUI then drops such inputs before the node sees them."""
    fields = {f.name for f in dataclasses.fields(schema_class)} if dataclasses.is_dataclass(schema_class) else set()
    if "accept_all_inputs" in fields:
        return {"accept_all_inputs": True}
    if node not in _SAID:
        _SAID.add(node)
        log.warning("FluxAccel: this ComfyUI's node schema has no accept_all_inputs: inputs the %s node no longer has "
                    "(e.g. clear_cache in an old workflow) are dropped by ComfyUI without a message", node)
    return {}

