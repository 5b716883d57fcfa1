"""RoPE inside FluxAccel's compiled FLUX: plain torch, so that inductor fuses it with the QK norm before it.

ComfyUI 0.33 and newer route FLUX's RoPE through comfy-kitchen's `apply_rope`, a torch.library custom op that
inductor cannot see into; the plain formula beside it (`_apply_rope1`) fuses with the norm. For the duration of the
compiled call only, `comfy.ldm.flux.math.apply_rope` is the host's own plain-torch formula on q and on k, restored in
`finally`: the pattern ComfyUI's own apply_model wrappers use for `diffusion_model`. ComfyUI runs one prompt at a
time, so no other model sees it. Where RoPE is plain torch already nothing changes; where the plain formula cannot
be found (a ComfyUI that moved it) the kitchen op runs inside the graph, correct but unfused, and the log says so.
"""
from __future__ import annotations

import contextlib

from ..upstream import comfy_internals, say


_rope1 = None  # the host's plain formula, found by torch_rope (a module-level function: dynamo guards its identity)


def _torch_apply_rope(xq, xk, freqs_cis):
    return _rope1(xq, freqs_cis), _rope1(xk, freqs_cis)


@contextlib.contextmanager
def torch_rope():
    global _rope1
    rope1 = comfy_internals.flux_plain_rope1()
    if not rope1:
        if rope1 is not None:
            say(rope1, "the compiled model runs comfy-kitchen's RoPE op (correct, not fused with the QK norm)")
        yield
        return
    _rope1 = rope1
    with comfy_internals.flux_apply_rope_as(_torch_apply_rope):
        yield
