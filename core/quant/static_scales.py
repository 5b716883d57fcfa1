"""Static FP8 activation scales (opt-in, set by the Warmup node): each FP8 Linear quantizes its input with one scale
fixed ahead of the call, calibrated over a real sampling run, instead of each call's row-wise absmax. The activation's
quantization then becomes a pointwise cast that the compiled graph fuses into the kernel making the activation,
without a reduction over each row (H200, FLUX.1-dev 1024²: -4 % per image, the same error; bench/NOTES.md).

How it stays out of everyone else's way:
  * the scales live on StaticFp8Linear, a small module wrapping one of Quantize FP8's Linears (which it holds as a
    submodule: ComfyUI moves the shared FP8 weights with it, in place, as it moves them for any clone); the wrappers
    go into a clone through object patches, so Quantize FP8's and Compile's outputs keep computing as before;
  * calibration runs that clone uncompiled with the wrappers observing (dynamic scales, the range of every input
    recorded); only then are the scales set, before the clone's own compiled model traces them;
  * a Linear that calibration never reached keeps dynamic scales, and the report says how many.

One scale covers every step: a value beyond the calibrated range saturates at FP8's largest value (torchao's
quantization clamps), so the scale leaves headroom (StaticScalesConfig) above the largest value seen; FP8 e4m3 keeps
the same relative precision over its range, so the headroom costs only the smallest values of a tensor.
"""
from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass

import torch

from ..errors import FluxAccelError
from ..models import swaps
from .linear import is_fp8_linear
from .patch import fp8_state

log = logging.getLogger("fluxaccel.fp8")

STATIC_KEY = "fluxaccel_static_scales"  # ModelPatcher attachment (StaticScales)
E4M3_MAX = 448.0


@dataclass(frozen=True)
class StaticScalesConfig:
    """headroom: the calibrated scale maps headroom x the largest activation seen to FP8's largest value."""
    headroom: float = 2.0

    def __post_init__(self):
        if not self.headroom >= 1.0:
            raise FluxAccelError(f"static activation scales: headroom must be at least 1, got {self.headroom!r}")


class StaticFp8Linear(torch.nn.Module):
    """One of Quantize FP8's plain-layout Linears (`inner`, shared) run with a static activation scale (`act_scale`,
    a buffer of one value, which moves with the module). Without one the call is inner's own (dynamic scales); while
    `observing` (from creation until set_scale) the largest absolute input value is recorded in `amax`."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner
        self.register_buffer("act_scale", None)
        self.amax: torch.Tensor | None = None
        self.observing = True

    in_features = property(lambda self: self.inner.in_features)
    out_features = property(lambda self: self.inner.out_features)

    def forward(self, x, *args, **kwargs):
        q = self.inner
        if self.act_scale is None:  # calibrating, or not reached by calibration: dynamic scales
            if self.observing:
                seen = q.activation_input(x.detach()).abs().amax().float()
                self.amax = seen if self.amax is None else torch.maximum(self.amax, seen)
            return q(x, *args, **kwargs)
        # float32 again where a cast of the model rounded the buffer (the cast and the GEMM use the same value anyway)
        return q.fp8_forward(x, self.act_scale.float())

    def set_scale(self, headroom: float) -> bool:
        """The static scale from the range seen (False, and dynamic scales kept, where calibration never reached it);
        observing ends."""
        self.observing = False
        if self.amax is None:
            return False
        self.act_scale = (self.amax * headroom / E4M3_MAX).clamp(min=1e-12).reshape(1).to(torch.float32)
        self.amax = None
        return True


@dataclass(frozen=True)
class StaticScales:
    """What static_scales put on a clone: a ModelPatcher attachment (STATIC_KEY), never mutated."""
    config: StaticScalesConfig
    keys: tuple[str, ...]  # object-patch keys now holding a StaticFp8Linear
    dynamic: tuple[str, ...]  # of those, the ones calibration never reached (dynamic scales)
    calibration: str  # what the scales were calibrated on, in words

    def summary(self) -> str:
        line = (f"static FP8 activation scales on {len(self.keys) - len(self.dynamic)} of {len(self.keys)} Linears "
                f"(headroom {self.config.headroom:g}x), calibrated on {self.calibration}")
        if self.dynamic:
            shown = ", ".join(k.removeprefix("diffusion_model.") for k in self.dynamic[:4])
            line += (f"; {len(self.dynamic)} not reached by calibration keep dynamic scales: {shown}"
                     + (" ..." if len(self.dynamic) > 4 else ""))
        return line


def static_scales_state(model) -> StaticScales | None:
    """The static scales on this model, if its object patches still hold them (remove_fp8 takes them off with the
    FP8 Linears they wrap)."""
    state = model.get_attachment(STATIC_KEY)
    if state is None or not isinstance(swaps.get(model, state.keys[0]), StaticFp8Linear):
        return None
    return state


def _fp8_linears(model, node: str) -> dict[str, torch.nn.Module]:
    """Quantize FP8's plain-layout Linears of this clone, by object-patch key (those of an earlier static-scales clone
    unwrapped: calibrating again starts from them)."""
    st = fp8_state(model)
    if st is None:
        raise FluxAccelError(f"{node}: activation_scales 'static' sets the scales of FP8 Linears, and this model has "
                             f"none: put Quantize FP8 (FluxAccel) before Compile, or set activation_scales 'dynamic'.")
    if st.config.layout != "plain":
        raise FluxAccelError(f"{node}: activation_scales 'static' needs Quantize FP8's 'plain' layout (this model is "
                             f"'{st.config.layout}'): set layout 'plain' on Quantize FP8 (FluxAccel), or set "
                             f"activation_scales 'dynamic'.")
    out = {}
    for key in st.keys:
        obj = swaps.get(model, key)
        if isinstance(obj, StaticFp8Linear):
            obj = obj.inner
        if obj is not None and is_fp8_linear(obj):
            out[key] = obj
    return out


def with_observers(model, node: str):
    """(clone, its StaticFp8Linears): a clone of `model` whose FP8 Linears are wrapped, observing until calibrated."""
    linears = _fp8_linears(model, node)
    clone = model.clone()
    wrappers = {key: StaticFp8Linear(inner) for key, inner in linears.items()}
    swaps.add(clone, wrappers)
    # other modules in the live tree than the input's: ComfyUI patches the model again when it switches clones
    clone.patches_uuid = uuid.uuid4()
    return clone, wrappers


def calibrate(clone, wrappers: dict[str, StaticFp8Linear], cfg: StaticScalesConfig, run, calibration: str):
    """Run `run()` (sampling with the clone uncompiled: the wrappers observe), then fix each wrapper's scale and put
    the StaticScales attachment on the clone. Returns its StaticScales."""
    for w in wrappers.values():
        w.act_scale, w.amax, w.observing = None, None, True
    run()
    dynamic = tuple(k for k, w in wrappers.items() if not w.set_scale(cfg.headroom))
    if len(dynamic) == len(wrappers):
        raise FluxAccelError("static activation scales: the calibration run reached none of the FP8 Linears; set "
                             "activation_scales 'dynamic'.")
    state = StaticScales(cfg, tuple(wrappers), dynamic, calibration)
    clone.set_attachments(STATIC_KEY, state)
    log.info("FluxAccel: %s", state.summary())
    return state


def remove_static_scales(model):
    """A clone running Quantize FP8's own Linears (dynamic scales) again."""
    state = static_scales_state(model)
    if state is None:
        return model
    clone = model.clone()
    inner = {key: obj.inner for key in state.keys if isinstance(obj := swaps.get(clone, key), StaticFp8Linear)}
    swaps.add(clone, inner)
    clone.remove_attachments(STATIC_KEY)
    clone.patches_uuid = uuid.uuid4()
    return clone

