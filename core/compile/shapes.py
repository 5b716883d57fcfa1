"""The fixed-shape contract of a compiled FLUX model: what a compiled graph is specialised to (ShapeKey) and which
shapes may run compiled under the Compile node's resolution_policy (ShapePolicy). Pure: no torch.compile here."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Literal, Sequence

import torch

from ..budget import call_tokens
from ..errors import FluxAccelError

log = logging.getLogger("fluxaccel.compile")


@dataclass(frozen=True, order=True)
class ShapeKey:
    """What a compiled graph is specialised to: batch, latent H x W, text tokens, dtype, and the reference latents
    (FLUX.1 Kontext, FLUX.2 editing: their tokens are appended to the image's) as latent (H, W) per reference, with
    the method that places them. scale: pixels per latent cell (8 for FLUX.1 and Chroma, 16 for FLUX.2), for
    messages only."""

    batch: int
    height: int
    width: int
    text_len: int
    dtype: str
    refs: tuple[tuple[int, int], ...] = ()
    ref_method: str = ""
    scale: int = field(default=8, compare=False)

    def tokens(self, token_px: int) -> int:
        """The tokens of one model call of this shape (`token_px`: the model's pixels per token side,
        models.flux.token_px): the image's, its references', the text."""
        s = self.scale
        return call_tokens(self.width * s, self.height * s, self.text_len, token_px,
                           [(w * s, h * s) for h, w in self.refs])

    def describe(self) -> str:
        s = self.scale
        text = (f"batch {self.batch}, latent {self.height}x{self.width} ({self.width * s}x{self.height * s} px), "
                f"{self.text_len} text tokens, {self.dtype}")
        return text + (f", {self.describe_refs()}" if self.refs else "")

    def describe_refs(self) -> str:
        if not self.refs:
            return "no reference image"
        sizes = ", ".join(f"{w * self.scale}x{h * self.scale} px" for h, w in self.refs)
        method = f" ({self.ref_method})" if self.ref_method else ""
        return f"reference latents {sizes}{method}"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def references(latents, method) -> tuple[tuple[tuple[int, int], ...], str]:
    """Reference latents as a shape key holds them: latent (H, W) per reference, and the method (only with some)."""
    refs = tuple((int(r.shape[-2]), int(r.shape[-1])) for r in (latents or ()))
    return refs, (str(method or "") if refs else "")


def shape_key(x: torch.Tensor, context: torch.Tensor | None, kwargs: dict | None = None, scale: int = 8) -> ShapeKey:
    """The key of one diffusion-model call; kwargs: its other inputs (ref_latents, ref_latents_method)."""
    text = int(context.shape[1]) if context is not None else 0
    kwargs = kwargs or {}
    refs, method = references(kwargs.get("ref_latents"), kwargs.get("ref_latents_method"))
    return ShapeKey(int(x.shape[0]), int(x.shape[-2]), int(x.shape[-1]), text, dtype_name(x.dtype), refs, method,
                    scale)


REFERENCE_INPUTS = ("ref_latents", "ref_latents_method")
_said_unread: list[bool] = []


def without_references(kwargs: dict) -> dict:
    """A call's inputs without reference latents, for an architecture that does not read them (Chroma: ComfyUI hands
    them over as to FLUX.1, and its forward ignores them): they neither reach the graph nor make a new shape."""
    if not any(k in kwargs for k in REFERENCE_INPUTS):
        return kwargs
    if not _said_unread:
        _said_unread.append(True)
        log.info("FluxAccel: this model's architecture does not read reference latents (ComfyUI's own forward ignores "
                 "them); the compiled call leaves them out")
    return {k: v for k, v in kwargs.items() if k not in REFERENCE_INPUTS}


def _what_is_new(key: ShapeKey, allowed: Sequence[ShapeKey]) -> str:
    """' The reference image is new: ...' when the call differs from a compiled shape only in its references."""
    same_base = [k for k in allowed if (k.batch, k.height, k.width, k.text_len, k.dtype) ==
                 (key.batch, key.height, key.width, key.text_len, key.dtype)]
    if not same_base:
        return ""
    return (f" Only the reference image differs: {key.describe_refs()} where the compiled shape has "
            f"{same_base[0].describe_refs()}; resize the reference (e.g. ImageScale / FluxKontextImageScale) to the "
            f"compiled size or add the pair in the Warmup node.")


Decision = Literal["known", "new", "eager"]


@dataclass(frozen=True)
class ShapePolicy:
    """resolution_policy and max_shapes applied to the shapes a model has allowed so far (the caller keeps the list).

    recompile (the default): each new shape compiled when first met, up to max_shapes, and any more run uncompiled
    (counted, said once per shape); strict: the first shape only, another is an error that says what to change
    (fleets that must never run uncompiled); eager_fallback: the first shape compiled, others run uncompiled."""

    policy: str
    max_shapes: int
    said: set = field(default_factory=set, compare=False)  # shapes already said to run uncompiled

    def decide(self, key: ShapeKey, allowed: Sequence[ShapeKey]) -> Decision:
        """'known' (compiled already or allowed), 'new' (allow it: the caller appends it), 'eager' (run uncompiled)."""
        if key in allowed:
            return "known"
        if not allowed:
            return "new"
        compiled = "; ".join(k.describe() for k in allowed)
        if self.policy == "eager_fallback":
            self._say_once(key, f"it is not a compiled shape (compiled: {compiled}); its calls run uncompiled, counted "
                                f"(resolution_policy eager_fallback)")
            return "eager"
        if self.policy == "recompile" and len(allowed) < self.max_shapes:
            log.info("FluxAccel: compiling a new shape %s (%d of at most %d)", key.describe(), len(allowed) + 1,
                     self.max_shapes)
            return "new"
        if self.policy == "recompile":
            self._say_once(key, f"the compiled model holds its {self.max_shapes} shapes already (max_shapes): "
                                f"{compiled}; its calls run uncompiled, counted. Raise max_shapes on the Compile node "
                                f"to compile it too.")
            return "eager"
        raise FluxAccelError(
            f"This FLUX model is compiled for {compiled}, but received {key.describe()}.{_what_is_new(key, allowed)} "
            f"Use the compiled resolution, batch size, prompt length (text tokens) and reference-image size, or set "
            f"resolution_policy to 'recompile' (or add the shape in the Warmup node), or 'eager_fallback' on the "
            f"Compile node.")

    def _say_once(self, key: ShapeKey, why: str) -> None:
        if key not in self.said:
            self.said.add(key)
            log.warning("FluxAccel: %s: %s", key.describe(), why)

    def register(self, key: ShapeKey, allowed: Sequence[ShapeKey]) -> bool:
        """Warmup's explicit request, whatever the policy, bounded by max_shapes: True if the caller appends it."""
        if key in allowed:
            return False
        if len(allowed) >= self.max_shapes:
            raise FluxAccelError(
                f"Warmup asks for more shapes than the Compile node's max_shapes ({self.max_shapes}); compiled: "
                f"{'; '.join(k.describe() for k in allowed)}; asked: {key.describe()}. Raise max_shapes.")
        return True
