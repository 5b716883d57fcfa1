"""The fixed-shape contract of a compiled FLUX model: what a compiled graph is specialised to (ShapeKey) and which
shapes may run compiled under the Compile node's resolution_policy (ShapePolicy). Pure: no torch.compile here."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal, Sequence

import torch

from ..errors import FluxAccelError

log = logging.getLogger("fluxaccel.compile")


@dataclass(frozen=True, order=True)
class ShapeKey:
    """What a compiled graph is specialised to: batch, latent H x W, text tokens, dtype."""

    batch: int
    height: int
    width: int
    text_len: int
    dtype: str

    def describe(self) -> str:
        return (f"batch {self.batch}, latent {self.height}x{self.width} ({self.width * 8}x{self.height * 8} px), "
                f"{self.text_len} text tokens, {self.dtype}")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def shape_key(x: torch.Tensor, context: torch.Tensor | None) -> ShapeKey:
    text = int(context.shape[1]) if context is not None else 0
    return ShapeKey(int(x.shape[0]), int(x.shape[-2]), int(x.shape[-1]), text, dtype_name(x.dtype))


Decision = Literal["known", "new", "eager"]


@dataclass(frozen=True)
class ShapePolicy:
    """resolution_policy and max_shapes applied to the shapes a model has allowed so far (the caller keeps the list).

    strict: the first shape only; recompile: up to max_shapes, each compiled when first met; eager_fallback: the first
    shape compiled, others run uncompiled. A shape refused is an error that says what to change."""

    policy: str
    max_shapes: int

    def decide(self, key: ShapeKey, allowed: Sequence[ShapeKey]) -> Decision:
        """'known' (compiled already or allowed), 'new' (allow it: the caller appends it), 'eager' (run uncompiled)."""
        if key in allowed:
            return "known"
        if not allowed:
            return "new"
        compiled = "; ".join(k.describe() for k in allowed)
        if self.policy == "eager_fallback":
            log.warning("FluxAccel: %s is not a compiled shape (compiled: %s); running this call uncompiled "
                        "(resolution_policy eager_fallback)", key.describe(), compiled)
            return "eager"
        if self.policy == "recompile" and len(allowed) < self.max_shapes:
            log.info("FluxAccel: compiling a new shape %s (%d of at most %d)", key.describe(), len(allowed) + 1,
                     self.max_shapes)
            return "new"
        if self.policy == "recompile":
            raise FluxAccelError(
                f"The compiled FLUX model already holds {len(allowed)} shapes (max_shapes {self.max_shapes}): "
                f"{compiled}. Received {key.describe()}. Raise max_shapes on the Compile node, or use one of the "
                f"compiled resolutions/batch sizes/prompt lengths.")
        raise FluxAccelError(
            f"This FLUX model is compiled for {compiled}, but received {key.describe()}. Use the compiled "
            f"resolution, batch size and prompt length (text tokens), or set resolution_policy to 'recompile' "
            f"(or add the shape in the Warmup node), or 'eager_fallback' on the Compile node.")

    def register(self, key: ShapeKey, allowed: Sequence[ShapeKey]) -> bool:
        """Warmup's explicit request, whatever the policy, bounded by max_shapes: True if the caller appends it."""
        if key in allowed:
            return False
        if len(allowed) >= self.max_shapes:
            raise FluxAccelError(
                f"Warmup asks for more shapes than the Compile node's max_shapes ({self.max_shapes}); compiled: "
                f"{'; '.join(k.describe() for k in allowed)}; asked: {key.describe()}. Raise max_shapes.")
        return True
