"""RoPE inside FluxAccel's compiled FLUX: plain torch, so that inductor fuses it with the QK norm before it.

ComfyUI 0.33 routes FLUX's RoPE through comfy-kitchen's `apply_rope`, a torch.library custom op that inductor cannot
see into; 0.3.75's plain-torch RoPE fused with the norm. For the duration of the compiled call only,
`comfy.ldm.flux.math.apply_rope` is the host's own plain-torch formula (its `_apply_rope1` on q and on k), restored
in `finally`: the pattern ComfyUI's own apply_model wrappers use for `diffusion_model`. ComfyUI runs one prompt at
a time, so no other model sees it. On hosts without kitchen RoPE (0.3.75) nothing changes.
"""
from __future__ import annotations

import contextlib


def _torch_apply_rope(xq, xk, freqs_cis):
    import comfy.ldm.flux.math as fm

    return fm._apply_rope1(xq, freqs_cis), fm._apply_rope1(xk, freqs_cis)


def kitchen_rope() -> bool:
    """True where FLUX's RoPE goes through comfy-kitchen (ComfyUI 0.33 and newer)."""
    import comfy.ldm.flux.math as fm

    return hasattr(fm, "_apply_rope1")  # 0.33 split the plain formula off the kitchen dispatch; 0.3.75 has none


@contextlib.contextmanager
def torch_rope():
    import comfy.ldm.flux.math as fm

    if not kitchen_rope():
        yield
        return
    orig = fm.apply_rope
    fm.apply_rope = _torch_apply_rope
    try:
        yield
    finally:
        fm.apply_rope = orig
