"""The FP8 Linear as ComfyUI runs it: a quantized copy of one of ComfyUI's Linear op classes (quantize_linear) whose
weights move between devices as ComfyUI loads and unloads the model and keep their FP8 dtype; weight patches (LoRA)
reach it through FluxAccel's patcher (models/patcher.py -> quant/store.py), and any other way of patching it is
refused -- the hooks ComfyUI calls on a Linear (Module._apply, comfy_patched_weights, convert_weight/set_weight,
weight_function). Numerics are fp8.py's (torchao)."""
from __future__ import annotations

import copy

import comfy.ops
import torch

from ..env import require_torchao
from ..errors import FluxAccelError
from ..upstream import Unavailable, say, torch_internals
from .fp8 import Fp8Config, float8_ops, fp8_linear, fp8_linear_act, fp8_linear_act_pair, is_fp8_weight


class _Fp8Linear:
    """Mixin of FluxAccel's FP8 Linears: weight = FP8 data (a plain float8 Parameter), buffer fp8_weight_scale = its
    scales; forward runs fp8_linear with the torchao kwargs kept from quantization. ComfyUI's per-call cast and
    weight-function paths are bypassed (the FP8 GEMM returns the activation dtype itself; weight patches that arrive
    after quantization are refused: convert_weight)."""

    # act_fusion.py: the MLP activation done here ("gelu", or FLUX.2's "silu_gate") and the first input column it
    # applies to; the activation and the row-wise quantization run in one pass
    fused_act = None
    act_from = None

    def _apply(self, fn, recurse=True):
        """The FP8 data and its scale move devices but keep their dtypes: a dtype cast of the module
        (.to(torch.bfloat16), .half()) would turn FP8 data into plain values without their scale. Everything else
        (the bias) follows fn as usual."""
        w, scale = self._parameters.get("weight"), self._buffers.get("fp8_weight_scale")
        if w is None or scale is None:
            return super()._apply(fn, recurse)
        del self._parameters["weight"], self._buffers["fp8_weight_scale"]
        try:
            super()._apply(fn, recurse)  # bias and anything else the usual way
        finally:
            target = fn(torch.empty(0, device=w.device)).device
            if target != w.device:
                w = torch.nn.Parameter(w.to(target), requires_grad=False)
            self._parameters["weight"] = w
            self._buffers["fp8_weight_scale"] = scale.to(target)
        return self

    # ComfyUI's load skips a module it marked as patched (comfy_patched_weights) until it unpatches the model. An FP8
    # Linear is shared by the clones of its set, so it is never marked: every load asks FluxAccel's patcher for its
    # weights, which merges them only where the loading clone's patches differ from what the Linear holds.
    comfy_patched_weights = property(lambda self: False, lambda self, value: None, lambda self: None)

    def convert_weight(self, weight, inplace=False, **kwargs):
        """ComfyUI calls this (found by get_key_weight) when its own weight patching reaches this Linear. FluxAccel's
        patcher merges patches into FP8 Linears itself (models/patcher.py); a patch that reaches ComfyUI's own code
        here came another way (a patcher of another class, a per-call weight function) and is refused, rather than
        patched into FP8 data or dropped."""
        raise FluxAccelError(
            "A weight patch reaches a Linear that Quantize FP8 (FluxAccel) quantized through a path FluxAccel does not "
            "merge (a model patcher of another node's class, or a per-call weight function). Put that node before "
            "Quantize FP8 (FluxAccel), or report which node it is.")

    set_weight = convert_weight

    def forward(self, x, *args, **kwargs):
        return self.fp8_forward(x)

    def fp8_forward(self, x):
        """The FP8 GEMM of x; where an MLP activation was fused into this Linear (fused_act), the activation and the
        row-wise quantization in one pass."""
        if self.weight_function or self.bias_function:
            self.convert_weight(self.weight)  # a lowvram/LoRA weight function reached an FP8 Linear: refuse
        if self.fused_act is not None:
            return fp8_linear_act(x, self)
        return fp8_linear(x, self)

    def fp8_forward_pair(self, a, m):
        """forward(torch.cat((a, m), -1)) for a Linear whose fused activation starts at a's end (act_from), without
        the concatenation written: the activation, the row-wise quantization and the row's assembly in one pass
        (compile/single_block.py)."""
        if self.fused_act is None or self.act_from != a.shape[-1]:
            raise FluxAccelError(f"fp8_forward_pair: this Linear's fused activation starts at column {self.act_from}, "
                                 f"not at the first input's end ({a.shape[-1]})")
        if self.weight_function or self.bias_function:
            self.convert_weight(self.weight)  # a lowvram/LoRA weight function reached an FP8 Linear: refuse
        return fp8_linear_act_pair(a, m, self)


def takes_pair(m: torch.nn.Module, first: int) -> bool:
    """Whether m is an FP8 Linear whose fused activation starts at column `first`, i.e. can run fp8_forward_pair on
    (a, m) with `first` columns in a."""
    return isinstance(m, _Fp8Linear) and m.fused_act is not None and m.act_from == first


def is_fp8_linear(m: torch.nn.Module) -> bool:
    """A Linear quantized by quantize_linear."""
    return isinstance(m, _Fp8Linear)


_FP8_CLASSES: dict[type, type] = {}


def _fp8_class(cls: type) -> type:
    """The quantized variant of a Linear class (ComfyUI's op classes differ per model): cls + our mixin."""
    if cls not in _FP8_CLASSES:
        _FP8_CLASSES[cls] = type(f"FluxAccelFp8{cls.__name__}", (_Fp8Linear, cls), {"__module__": __name__})
    return _FP8_CLASSES[cls]


def fp8_class_origin(cls: type) -> type | None:
    """The ComfyUI Linear class an FP8 Linear class was made from; None for any other class."""
    return next((origin for origin, made in _FP8_CLASSES.items() if made is cls), None)


def rebuild_fp8_class(cls: type) -> type:
    """The FP8 Linear class of `cls` in this process (a pickled model's FP8 Linears are rebuilt with it); torchao's
    functions are found here, outside any trace, as quantizing finds them."""
    float8_ops()
    return _fp8_class(cls)


def _to_plain(q: torch.nn.Linear) -> None:
    """Replace a Float8Tensor weight by its data and scale as plain tensors (the same storage, no copy)."""
    float8_ops()  # refuses here, before any model call, where torchao moved them
    w = q.weight
    q.fp8_act_kwargs, q.fp8_mm_config = w.act_quant_kwargs, w.mm_config
    q.weight = torch.nn.Parameter(w.qdata, requires_grad=False)
    q.register_buffer("fp8_weight_scale", w.scale)
    for attr in ("weight_function", "bias_function"):
        if not hasattr(q, attr):
            setattr(q, attr, [])


def detached_copy(linear: torch.nn.Linear, device: torch.device, compute_dtype=None,
                   params: dict[str, torch.Tensor] | None = None) -> torch.nn.Linear:
    """A Linear of the same class sharing nothing mutable with the original (new Parameter objects).

    params: tensors to use instead of the Linear's own weight/bias (e.g. with a LoRA merged in).

    compute_dtype: ComfyUI's manual-cast compute dtype, if the model has one (bf16 weights computed in
    float32 on the CPU). The FP8 GEMM returns the activation dtype itself, so the copy must not be cast per
    call: its bias is stored in the compute dtype and ComfyUI's per-call weight cast is turned off.
    """
    new = torch_internals.module_shallow_copy(linear)
    if isinstance(new, Unavailable):
        say(new, "Quantize FP8 copies each Linear whole (its weights too) before quantizing: more memory while it runs")
        new = copy.deepcopy(linear)
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
    """Return an FP8 copy of `linear` on `device` (torchao's quantization, kept as plain FP8 data and scales),
    quantized from `params` (weight/bias) where given; `linear` is untouched."""
    require_torchao()
    from torchao.quantization import quantize_

    device = torch.device(device)
    new = detached_copy(linear, device, compute_dtype, params)
    with torch.no_grad():
        quantize_(new, cfg.torchao_config())
    if not is_fp8_weight(new.weight):
        raise FluxAccelError(f"torchao left a {tuple(linear.weight.shape)} Linear unquantized; report this as a bug.")
    _to_plain(new)
    new.__class__ = _fp8_class(type(linear))
    return new


def plain_from_parts(linear: torch.nn.Linear, params: dict[str, torch.Tensor], scale: torch.Tensor,
                     like: torch.nn.Linear, device: torch.device | str, compute_dtype=None) -> torch.nn.Linear:
    """The FP8 Linear of `linear` from stored FP8 data (params' weight) and scales (the FP8 weights cache) instead
    of quantizing: `like`, a Linear quantize_linear made with the same config, gives torchao's activation and GEMM
    settings; params' bias, where given, is the bias."""
    new = detached_copy(linear, torch.device(device), compute_dtype, params)
    new.fp8_act_kwargs, new.fp8_mm_config = like.fp8_act_kwargs, like.fp8_mm_config
    new.register_buffer("fp8_weight_scale", scale.to(device))
    for attr in ("weight_function", "bias_function"):
        if not hasattr(new, attr):
            setattr(new, attr, [])
    new.__class__ = _fp8_class(type(linear))
    return new


def comfy_linear(mod, params: dict[str, torch.Tensor], device: torch.device, cast: bool) -> torch.nn.Linear:
    """A plain ComfyUI Linear (the class a bf16 checkpoint loads; with cast, the manual-cast one that casts its weight
    to the activation dtype per call) with params' weight and bias, standing in for `mod` (a Linear of ComfyUI's
    mixed-precision ops): made with its class's own constructor on the meta device, then given the tensors."""

    cls = (comfy.ops.manual_cast if cast else comfy.ops.disable_weight_init).Linear
    empty = cls(mod.in_features, mod.out_features, bias="bias" in params, device="meta")
    return detached_copy(empty, device, None, params)
