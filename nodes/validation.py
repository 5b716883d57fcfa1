"""Checks our nodes run at prompt validation (V3 validate_inputs), so a bad API prompt is rejected by ComfyUI's
/prompt with a validation error before anything executes. Combo values, minimums and maximums are left to ComfyUI's
own checks: an input named in validate_inputs is not checked by ComfyUI, and a failed validate_inputs is reported
against every input it takes, so each node validates at most the one input ComfyUI cannot (Warmup's resolutions, the Benchmark's label),
and checks its type itself."""
from __future__ import annotations

from ..core.errors import FluxAccelError


def parses(fn, value) -> bool | str:
    """True if fn(value) accepts it, else the FluxAccelError's message (e.g. a malformed resolutions list)."""
    try:
        fn(value)
    except FluxAccelError as e:
        return str(e)
    return True
