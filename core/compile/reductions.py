"""Which reductions the compiled model runs as persistent kernels (the whole row held in registers, read once).

Inductor loops over rows above 1,024 elements (64 for reductions it cannot classify as rows). FLUX's LayerNorm +
modulation + FP8 quantization kernels reduce rows of 3,072 (FLUX.1) and 6,144 (FLUX.2 [dev]) and its per-head RMS
norms fall in the second group: all run faster persistent, up to rows of 8,192. The GELU's own 12,288-wide rows
were slower persistent, so the limit stays below them. Decided at compile time, so a warm-start package holds plain
kernels.
"""
from __future__ import annotations

from ..upstream import torch_internals

ROWS = 8192  # row reductions (over a contiguous last dimension) up to this many elements
OTHER = 1024  # reductions inductor hints DEFAULT up to this many elements
KEY = f"persistent={ROWS}/{OTHER}"  # part of the compile cache's key: kernels lowered otherwise are not reused


def persistent():
    """Context for a compile (or a call that may compile): inductor lowers with the limits above."""
    return torch_internals.persistent_reductions(ROWS, OTHER)
