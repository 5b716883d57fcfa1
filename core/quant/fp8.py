"""Tensor-level FP8: the config, which Linears of FLUX to quantize, and quantizing one Linear.

Module-level patching of a ComfyUI model lives in fp8_patch.py; this file knows nothing of ComfyUI.
Quantization itself is torchao's: quantize_ with Float8DynamicActivationFloat8WeightConfig
(dynamic FP8 activations, FP8 weights, e4m3), per-tensor or per-row scales. Two layouts of the result:
"subclass" keeps torchao's Float8Tensor weight parameter; "plain" keeps its FP8 data and scale as plain
tensors and runs torchao's own activation quantization and scaled GEMM functions on them (fp8_linear), so a
compiled model takes no tensor-subclass inputs (no per-call flatten/unflatten or subclass guards).
"""
from __future__ import annotations

import copy
import logging
import re
from dataclasses import dataclass, field
from typing import Iterable, Literal

import torch

from ..env import require_torchao
from ..errors import FluxAccelError
from ..upstream.torchao_internals import float8_primitives, map_float8_data

Granularity = Literal["per_tensor", "per_row"]
Scope = Literal["blocks", "blocks+modulation", "all_linear"]
Layout = Literal["subclass", "plain"]
GRANULARITIES: tuple[str, ...] = ("per_tensor", "per_row")
SCOPES: tuple[str, ...] = ("blocks", "blocks+modulation", "all_linear")
LAYOUTS: tuple[str, ...] = ("subclass", "plain")
DEFAULT_LAYOUT: Layout = "plain"  # measured faster on the H200 at both benchmark shapes (bench/NOTES.md, session 4)

_IN_BLOCKS = re.compile(r"^(double_blocks|single_blocks)\.\d+\.")
# FLUX's modulation linears: img_mod/txt_mod in double blocks, modulation in single blocks.
_MODULATION = re.compile(r"\.(img_mod|txt_mod|modulation)\.lin$")


@dataclass(frozen=True)
class Fp8Config:
    """Which Linears of a FLUX diffusion model to quantize, and with which scale granularity.

    scope:
      blocks             the Linears inside double/single blocks, except modulation (default: the GEMMs
                         that carry ~all FLOPs; embedders, modulation and the final layer stay bf16)
      blocks+modulation  also the modulation Linears (small M: they see one token per image)
      all_linear         every Linear, embedders and final layer included

    layout:
      plain              FP8 data + scale as plain tensors, same torchao numerics (see fp8_linear); the
                         default (DEFAULT_LAYOUT)
      subclass           the weight stays torchao's Float8Tensor (F.linear dispatches to torchao)
    """

    granularity: Granularity = "per_row"
    scope: Scope = "blocks"
    layout: Layout = DEFAULT_LAYOUT

    def __post_init__(self):
        if self.granularity not in GRANULARITIES:
            raise FluxAccelError(f"granularity must be one of {GRANULARITIES}, got {self.granularity!r}")
        if self.scope not in SCOPES:
            raise FluxAccelError(f"scope must be one of {SCOPES}, got {self.scope!r}")
        if self.layout not in LAYOUTS:
            raise FluxAccelError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")

    def key(self) -> list[str]:
        """What identifies this config in a model's options (and in compile-cache keys)."""
        return [self.granularity, self.scope, self.layout]

    def torchao_config(self):
        """The torchao config; set_inductor_config=False keeps process-wide inductor settings untouched, and the
        kernel preference is pinned to torchao's TORCH path (torch._scaled_mm), the one fp8_linear replays, so the
        subclass and plain layouts compute the same by construction (AUTO may pick an optional kernel library)."""
        require_torchao()
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, PerTensor

        gran = PerRow() if self.granularity == "per_row" else PerTensor()
        from ..upstream import say, torchao_internals

        torch_path = torchao_internals.torch_kernel_preference()
        pin = {"kernel_preference": torch_path} if torch_path else {}
        if not torch_path:  # an older torchao has only the TORCH path; a newer one may pick another kernel library
            say(torch_path, "torchao picks its FP8 GEMM kernel itself: the 'subclass' and 'plain' layouts may differ "
                            "in rounding", level=logging.INFO)
        return Float8DynamicActivationFloat8WeightConfig(granularity=gran, set_inductor_config=False, **pin)


def in_scope(name: str, scope: str) -> bool:
    """Name filter over diffusion-model-relative Linear names (e.g. 'double_blocks.0.img_attn.qkv')."""
    if scope == "all_linear":
        return True
    if not _IN_BLOCKS.match(name):
        return False
    return scope == "blocks+modulation" or not _MODULATION.search(name)


@dataclass
class Selection:
    chosen: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # name -> reason


def select_linears(named_linears: Iterable[tuple[str, torch.nn.Linear]], cfg: Fp8Config) -> Selection:
    """Split the Linears into those to quantize and those kept, with the reason for each kept one."""
    sel = Selection()
    for name, lin in named_linears:
        w = lin.weight
        if not in_scope(name, cfg.scope):
            sel.skipped[name] = f"outside scope '{cfg.scope}'"
        elif w.shape[0] % 16 or w.shape[1] % 16:
            sel.skipped[name] = f"shape {tuple(w.shape)} not divisible by 16 (FP8 GEMM needs it)"
        elif cfg.granularity == "per_row" and w.dtype != torch.bfloat16:
            raise FluxAccelError(
                f"per_row FP8 needs bfloat16 weights, but {name} is {w.dtype}. Load the model in bf16 "
                f"(UNETLoader weight_dtype 'default' on a bf16 GPU, or ComfyUI's --bf16-unet) or choose "
                f"granularity per_tensor."
            )
        else:
            sel.chosen.append(name)
    return sel


def is_fp8_weight(t: torch.Tensor) -> bool:
    """A torchao Float8Tensor (the "subclass" layout's weight)."""
    return hasattr(t, "qdata") and hasattr(t, "scale")


def is_fp8_linear(m: torch.nn.Module) -> bool:
    """A Linear quantized by quantize_linear, in either layout."""
    return isinstance(m, _Fp8DeviceMove)


def linear_weight_bytes(m: torch.nn.Linear) -> int:
    """Bytes the weight of a Linear occupies: FP8 data plus scales once quantized, plain size otherwise."""
    w = m.weight
    if is_fp8_weight(w):
        return w.qdata.numel() * w.qdata.element_size() + w.scale.numel() * w.scale.element_size()
    scale = getattr(m, "fp8_weight_scale", None)
    extra = scale.numel() * scale.element_size() if scale is not None else 0
    return w.numel() * w.element_size() + extra


_AO = None  # torchao's float8 primitives (upstream/torchao_internals.py), found when a plain-layout Linear is made


def _float8_primitives():
    """torchao's float8 primitives, found once (outside any trace: fp8_linear reads the module global)."""
    global _AO
    if _AO is None:
        found = float8_primitives()
        if not found:
            raise FluxAccelError(f"Quantize FP8's 'plain' layout calls torchao's float8 functions, but {found}. Set "
                                 f"layout to 'subclass' on Quantize FP8, or install torchao 0.17 or 0.18.")
        _AO = found
    return _AO


def fp8_linear(x: torch.Tensor, w_data: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
               act_kwargs, mm_config) -> torch.Tensor:
    """torchao's Float8Tensor linear on plain tensors: the functions its torch-kernel path calls, in its order.

    x: activations (..., K) in the compute dtype; w_data: FP8 weight data (N, K); w_scale: its scales, (N, 1)
    per-row or (1, 1) per-tensor; act_kwargs: the weight's QuantizeTensorToFloat8Kwargs (how torchao quantizes
    activations); mm_config: the weight's Float8MMConfig. Bit-identical to F.linear(x, Float8Tensor weight) in
    eager mode (tests/core/test_fp8.py); torchao's optional MSLK kernels (not installed here) are not used.
    """
    ao = _AO or _float8_primitives()
    block = list(ao.get_block_size(x.shape, act_kwargs.granularity))
    x_scale = ao.choose_scale(x, float8_dtype=act_kwargs.float8_dtype, block_size=block,
                              hp_value_lb=act_kwargs.hp_value_lb, hp_value_ub=act_kwargs.hp_value_ub)
    x_data = ao.quantize(x, x_scale, act_kwargs.float8_dtype)
    a, b = ao.preprocess_data(x_data.reshape(-1, x_data.shape[-1]), w_data.t(), mm_config)
    out = ao.addmm(a, ao.preprocess_scale(x_scale, x.shape), b, w_scale.t(),
                   output_dtype=x.dtype, bias=bias, use_fast_accum=mm_config.use_fast_accum)
    return out.reshape(*x.shape[:-1], w_data.shape[0])


class _Fp8DeviceMove:
    """Mixin for quantized Linears: moves an FP8 weight by moving its plain tensors (qdata, scale), and refuses
    weight patches that arrive after quantization (see convert_weight).

    ComfyUI moves modules with Module.to() when it loads/unloads a model. With torch 2.11 and torchao 0.18,
    Float8Tensor.to(other device) fails in torch's aliasing check of aten.to ("Attempted to set the storage
    of a tensor on device cpu to a storage on different device cuda:0"); torchao's _apply_fn_to_data moves
    the components instead and rebuilds the Float8Tensor, on every torch version.
    """

    def _apply(self, fn, recurse=True):
        """FP8 weights (a Float8Tensor, or the plain layout's float8 data and its fp8_weight_scale) move devices but
        keep their dtypes: a dtype cast of the module (.to(torch.bfloat16), .half()) would turn FP8 data into plain
        values without their scale. Everything else (the bias) follows fn as usual."""
        w = self._parameters.get("weight")
        scale = self._buffers.get("fp8_weight_scale")
        if w is None or not (is_fp8_weight(w) or scale is not None):
            return super()._apply(fn, recurse)
        del self._parameters["weight"]
        if scale is not None:
            del self._buffers["fp8_weight_scale"]
        try:
            super()._apply(fn, recurse)  # bias and anything else the usual way
        finally:
            target = fn(torch.empty(0, device=w.device)).device
            if target != w.device:
                moved = map_float8_data(w, lambda t: t.to(target)) if is_fp8_weight(w) else w.to(target)
                w = torch.nn.Parameter(moved, requires_grad=False)
            self._parameters["weight"] = w
            if scale is not None:
                self._buffers["fp8_weight_scale"] = scale.to(target)
        return self

    def convert_weight(self, weight, inplace=False, **kwargs):
        """ComfyUI calls this (found by get_key_weight) when it applies a weight patch (LoRA, ...) to this Linear,
        before computing the patched weight. Reached only by a patch added *after* quantization (patches present
        before are merged into the FP8 weights by fp8_patch.apply_fp8): refuse, rather than patch or drop it."""
        raise FluxAccelError(
            "A LoRA (or another weight patch) reaches a Linear that Quantize FP8 (FluxAccel) already quantized; FP8 "
            "weights cannot be patched afterwards. Put LoraLoaderModelOnly (and other weight-patching nodes) before "
            "Quantize FP8 (FluxAccel): their changes are then merged into the FP8 weights.")

    set_weight = convert_weight


class _Fp8Plain(_Fp8DeviceMove):
    """The "plain" layout: weight = FP8 data (a plain float8 Parameter), buffer fp8_weight_scale = its scales; forward
    runs fp8_linear with the torchao kwargs kept from quantization. ComfyUI's per-call cast and weight-function
    paths are bypassed (the FP8 GEMM returns the activation dtype itself; weight patches are refused)."""

    def forward(self, x, *args, **kwargs):
        if self.weight_function or self.bias_function:
            self.convert_weight(self.weight)  # a lowvram/LoRA weight function reached an FP8 Linear: refuse
        return fp8_linear(x, self.weight, self.fp8_weight_scale, self.bias, self.fp8_act_kwargs, self.fp8_mm_config)


_FP8_CLASSES: dict[tuple[type, str], type] = {}


def _fp8_class(cls: type, layout: str) -> type:
    """The quantized variant of a Linear class (ComfyUI's op classes differ per model): cls + our mixin."""
    if (cls, layout) not in _FP8_CLASSES:
        mixin = _Fp8Plain if layout == "plain" else _Fp8DeviceMove
        name = f"FluxAccelFp8{'Plain' if layout == 'plain' else ''}{cls.__name__}"
        _FP8_CLASSES[cls, layout] = type(name, (mixin, cls), {"__module__": __name__})
    return _FP8_CLASSES[cls, layout]


def _to_plain(q: torch.nn.Linear) -> None:
    """Replace a Float8Tensor weight by its data and scale as plain tensors (the same storage, no copy)."""
    _float8_primitives()  # refuses the layout here, before any model call, where torchao moved them
    w = q.weight
    q.fp8_act_kwargs, q.fp8_mm_config = w.act_quant_kwargs, w.mm_config
    q.weight = torch.nn.Parameter(w.qdata, requires_grad=False)
    q.register_buffer("fp8_weight_scale", w.scale)
    for attr in ("weight_function", "bias_function"):
        if not hasattr(q, attr):
            setattr(q, attr, [])


def _detached_copy(linear: torch.nn.Linear, device: torch.device, compute_dtype=None,
                   params: dict[str, torch.Tensor] | None = None) -> torch.nn.Linear:
    """A Linear of the same class sharing nothing mutable with the original (new Parameter objects).

    params: tensors to use instead of the Linear's own weight/bias (e.g. with a LoRA merged in).

    compute_dtype: ComfyUI's manual-cast compute dtype, if the model has one (bf16 weights computed in
    float32 on the CPU). The FP8 GEMM returns the activation dtype itself, so the copy must not be cast per
    call: its bias is stored in the compute dtype and ComfyUI's per-call weight cast is turned off.
    """
    new = copy.copy(linear)
    new._parameters = dict(linear._parameters)
    new._buffers = dict(linear._buffers)
    new._modules = dict(linear._modules)
    for attr, value in vars(linear).items():  # hook registries (_forward_hooks, ...): the copy's own
        if attr.endswith(("_hooks", "_hooks_with_kwargs", "_hooks_always_called")) and isinstance(value, dict):
            setattr(new, attr, type(value)(value))
    for attr in ("weight_function", "bias_function"):
        if hasattr(linear, attr):
            setattr(new, attr, list(getattr(linear, attr)))
    new.__dict__.pop("comfy_patched_weights", None)
    params = params or {}
    weight, bias = params.get("weight", linear.weight), params.get("bias", linear.bias)
    new.weight = torch.nn.Parameter(weight.detach().to(device), requires_grad=False)
    if bias is not None:
        new.bias = torch.nn.Parameter(bias.detach().to(device, compute_dtype), requires_grad=False)
    if compute_dtype is not None and hasattr(new, "comfy_cast_weights"):
        new.comfy_cast_weights = False
    return new


def quantize_linear(linear: torch.nn.Linear, cfg: Fp8Config, device: torch.device | str,
                    compute_dtype=None, params: dict[str, torch.Tensor] | None = None) -> torch.nn.Linear:
    """Return an FP8 copy of `linear` on `device` (weight: torchao Float8Tensor, or its plain tensors with
    cfg.layout 'plain'), quantized from `params` (weight/bias) where given; `linear` is untouched."""
    require_torchao()
    from torchao.quantization import quantize_

    device = torch.device(device)
    new = _detached_copy(linear, device, compute_dtype, params)
    with torch.no_grad():
        quantize_(new, cfg.torchao_config())
    if not is_fp8_weight(new.weight):
        raise FluxAccelError(f"torchao left a {tuple(linear.weight.shape)} Linear unquantized; report this as a bug.")
    if cfg.layout == "plain":
        _to_plain(new)
    new.__class__ = _fp8_class(type(linear), cfg.layout)
    return new
