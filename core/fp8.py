"""Tensor-level FP8: the config, which Linears of FLUX to quantize, and quantizing one Linear.

Module-level patching of a ComfyUI model lives in fp8_patch.py; this file knows nothing of ComfyUI.
Quantization itself is torchao's: quantize_ with Float8DynamicActivationFloat8WeightConfig
(dynamic FP8 activations, FP8 weights, e4m3), per-tensor or per-row scales.
"""
from __future__ import annotations

import contextlib
import copy
import re
from dataclasses import dataclass, field
from typing import Iterable, Literal

import torch

from .env import require_torchao
from .errors import FluxAccelError

Granularity = Literal["per_tensor", "per_row"]
Scope = Literal["blocks", "blocks+modulation", "all_linear"]
GRANULARITIES: tuple[str, ...] = ("per_tensor", "per_row")
SCOPES: tuple[str, ...] = ("blocks", "blocks+modulation", "all_linear")

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
    """

    granularity: Granularity = "per_row"
    scope: Scope = "blocks"

    def __post_init__(self):
        if self.granularity not in GRANULARITIES:
            raise FluxAccelError(f"granularity must be one of {GRANULARITIES}, got {self.granularity!r}")
        if self.scope not in SCOPES:
            raise FluxAccelError(f"scope must be one of {SCOPES}, got {self.scope!r}")

    def torchao_config(self):
        """The torchao config; set_inductor_config=False keeps process-wide inductor settings untouched."""
        require_torchao()
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, PerTensor

        gran = PerRow() if self.granularity == "per_row" else PerTensor()
        return Float8DynamicActivationFloat8WeightConfig(granularity=gran, set_inductor_config=False)


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
    return hasattr(t, "qdata") and hasattr(t, "scale")


def weight_bytes(t: torch.Tensor) -> int:
    """Bytes a weight occupies: FP8 data plus scales for a Float8Tensor, plain size otherwise."""
    if is_fp8_weight(t):
        return t.qdata.numel() * t.qdata.element_size() + t.scale.numel() * t.scale.element_size()
    return t.numel() * t.element_size()


@contextlib.contextmanager
def _cpu_gate_lifted(device: torch.device):
    """torchao refuses FP8 off-GPU by a capability gate; on the CPU (opt-in, see env.cpu_fp8_allowed)
    lift only that gate, for this call only, so the real Float8Tensor path runs via torch._scaled_mm."""
    if torch.device(device).type != "cpu":
        yield
        return
    import torchao.quantization.quant_api as qa

    orig = qa._check_hardware_support
    qa._check_hardware_support = lambda granularities: None
    try:
        yield
    finally:
        qa._check_hardware_support = orig


class _Fp8DeviceMove:
    """Mixin for quantized Linears: moves an FP8 weight by moving its plain tensors (qdata, scale), and refuses
    weight patches that arrive after quantization (see convert_weight).

    ComfyUI moves modules with Module.to() when it loads/unloads a model. With torch 2.11 and torchao 0.18,
    Float8Tensor.to(other device) fails in torch's aliasing check of aten.to ("Attempted to set the storage
    of a tensor on device cpu to a storage on different device cuda:0"); torchao's _apply_fn_to_data moves
    the components instead and rebuilds the Float8Tensor, on every torch version.
    """

    def _apply(self, fn, recurse=True):
        w = self._parameters.get("weight")
        if w is None or not is_fp8_weight(w):
            return super()._apply(fn, recurse)
        del self._parameters["weight"]
        try:
            super()._apply(fn, recurse)  # bias and anything else the usual way
        finally:
            target = fn(torch.empty(0, device=w.device)).device
            if target != w.device:
                w = torch.nn.Parameter(w._apply_fn_to_data(lambda t: t.to(target)), requires_grad=False)
            self._parameters["weight"] = w
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


_FP8_CLASSES: dict[type, type] = {}


def _fp8_class(cls: type) -> type:
    """The quantized variant of a Linear class (ComfyUI's op classes differ per model): cls + _Fp8DeviceMove."""
    if cls not in _FP8_CLASSES:
        _FP8_CLASSES[cls] = type(f"FluxAccelFp8{cls.__name__}", (_Fp8DeviceMove, cls), {"__module__": __name__})
    return _FP8_CLASSES[cls]


def _detached_copy(linear: torch.nn.Linear, device: torch.device, compute_dtype=None) -> torch.nn.Linear:
    """A Linear of the same class sharing nothing mutable with the original (new Parameter objects).

    compute_dtype: ComfyUI's manual-cast compute dtype, if the model has one (bf16 weights computed in
    float32 on the CPU). The FP8 GEMM returns the activation dtype itself, so the copy must not be cast per
    call: its bias is stored in the compute dtype and ComfyUI's per-call weight cast is turned off.
    """
    new = copy.copy(linear)
    new._parameters = dict(linear._parameters)
    new._buffers = dict(linear._buffers)
    new._modules = dict(linear._modules)
    for attr in ("weight_function", "bias_function"):
        if hasattr(linear, attr):
            setattr(new, attr, list(getattr(linear, attr)))
    new.__dict__.pop("comfy_patched_weights", None)
    new.weight = torch.nn.Parameter(linear.weight.detach().to(device), requires_grad=False)
    if linear.bias is not None:
        new.bias = torch.nn.Parameter(linear.bias.detach().to(device, compute_dtype), requires_grad=False)
    if compute_dtype is not None and hasattr(new, "comfy_cast_weights"):
        new.comfy_cast_weights = False
    return new


def quantize_linear(linear: torch.nn.Linear, cfg: Fp8Config, device: torch.device | str,
                    compute_dtype=None) -> torch.nn.Linear:
    """Return an FP8 copy of `linear` on `device` (weight: torchao Float8Tensor); `linear` is untouched."""
    require_torchao()
    from torchao.quantization import quantize_

    device = torch.device(device)
    new = _detached_copy(linear, device, compute_dtype)
    with _cpu_gate_lifted(device), torch.no_grad():
        quantize_(new, cfg.torchao_config())
    if not is_fp8_weight(new.weight):
        raise FluxAccelError(f"torchao left a {tuple(linear.weight.shape)} Linear unquantized; report this as a bug.")
    new.__class__ = _fp8_class(type(linear))
    return new
