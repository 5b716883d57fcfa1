"""How a node's inputs become its config: the config dataclass is the one home of each default; the node's schema
reads the defaults from it, and the inputs are checked against its fields. Inputs a node had once, which saved
workflows may still set, are said in one log line and left to FluxAccel."""
from __future__ import annotations

import dataclasses
import logging

from .errors import FluxAccelError

log = logging.getLogger("fluxaccel.nodes")


def node_field(**meta) -> dict:
    """A config field's metadata: shown on the node (advanced=True: among the node's advanced inputs)."""
    return {"node": True, **meta}


def known_inputs(inputs: dict, known, removed: tuple[str, ...], node: str) -> dict:
    """The inputs named in `known`; inputs in `removed` (a node had them once; saved workflows may still set them) are
    said in one log line and left to FluxAccel; any other input is refused by name."""
    gone = {k: v for k, v in inputs.items() if k in removed}
    unknown = {k: v for k, v in inputs.items() if k not in known and k not in removed}
    if unknown:
        raise FluxAccelError(" ".join(f"{node} has no input {k!r} (set to {shown(v)}); remove it from the workflow."
                                      for k, v in unknown.items()))
    if gone:
        log.info("FluxAccel: %s: this workflow sets inputs the node no longer has (%s); FluxAccel decides them itself "
                 "now, and says what it decided in the node's text", node,
                 ", ".join(f"{k}={v!r}" for k, v in gone.items()))
    return {k: v for k, v in inputs.items() if k in known}


def shown(value, limit: int = 60) -> str:
    """A value as a message shows it: its repr, cut at `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def conditioning(value, node: str, name: str):
    """A CONDITIONING input as ComfyUI's sampler takes it ([[tensor, dict], ...]) or None (not connected), else an
    error naming the input."""
    import torch

    if value is None:
        return None
    if not (isinstance(value, list) and value and all(
            isinstance(c, (list, tuple)) and len(c) == 2 and torch.is_tensor(c[0]) and isinstance(c[1], dict)
            for c in value)):
        raise FluxAccelError(f"{node}: {name} is not conditioning (got {shown(value)}); connect a CONDITIONING "
                             f"output (a text encoder's, or Synthetic FLUX Conditioning's) or leave it unconnected")
    return value


def node_inputs(cls, inputs: dict, removed: tuple[str, ...], node: str) -> dict:
    """The keyword arguments of `cls` (a config dataclass) among a node's inputs (its fields shown on the node), as
    known_inputs takes them."""
    return known_inputs(inputs, node_defaults(cls), removed, node)


def node_defaults(cls) -> dict:
    """{field: (default, advanced)} of the fields a config dataclass shows on its node, in order."""
    return {f.name: (f.default, bool(f.metadata.get("advanced"))) for f in dataclasses.fields(cls)
            if f.metadata.get("node")}
