"""Checks our nodes run at prompt validation (V3 validate_inputs), so a bad API prompt is rejected by ComfyUI's
/prompt with a validation error before anything executes. ComfyUI 0.3.75 does not check V3 combo values itself."""
from __future__ import annotations

from ..core.errors import FluxAccelError


def one_of(**choices: tuple[object, tuple | list]) -> bool | str:
    """choices: input name -> (received value, allowed values). True, or the message ComfyUI shows."""
    for name, (value, allowed) in choices.items():
        if value not in allowed:
            return f"{name} must be one of {', '.join(map(str, allowed))}; got {value!r}"
    return True


def parses(fn, value) -> bool | str:
    """True if fn(value) accepts it, else the FluxAccelError's message (e.g. a malformed resolutions list)."""
    try:
        fn(value)
    except FluxAccelError as e:
        return str(e)
    return True
