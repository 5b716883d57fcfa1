"""FP8 attention's inputs from a FLUX single block's QKV projection in one kernel: QK-norm, RoPE and the FP8 casts.

With FP8 attention (fp8_attention.py) the single block's Q and K go through RMSNorm, then RoPE, then a cast to FP8.
Inductor fuses the three into one kernel per block, but that kernel reads RoPE's rotations once per head and runs
at about a third of the memory's rate (H200, FLUX.1-dev 1024²: ~95 µs per block, 38 blocks, bench/NOTES.md). Here
one Triton program per token reads the token's whole QKV row once, normalizes, rotates and casts every head of Q and K
with the token's rotations read once, and takes V's absmax on the way (V's scale needs the whole tensor's, so V is
cast after it); the outputs are in the layout FlashAttention-3 takes, (batch, tokens, heads, head_dim).

Numbers: as ComfyUI's path rounds them (torch's rms_norm rounds to the input's dtype, ComfyUI's RoPE formula computes
in float32 and rounds to it), then divided by the scale, clamped and cast, as fp8_attention._fp8. On the GPU the
kernel's float32 sums differ from torch's in their last bits now and then (an FP8 value one step apart); off the GPU
the operator runs the same in torch.

It runs in FluxAccel's single-block forward (single_block.py) where FP8 attention takes Q's and K's scales from the
QK-norm bound (block regions) and the block's attention is the one FluxAccel read; anything else (a mask, an attention
patch, a norm ComfyUI changes per call, another layout) goes the usual way, which gives the same numbers.
"""
from __future__ import annotations

import hashlib
import inspect
import textwrap

import torch
import torch.nn.functional as F

from ..quant.act_quant import register_op
from ..upstream import fa3_internals
from .attention import OVERRIDE_KEY
from .fp8_attention import FP8_MAX, HEAD_DIMS, SCALES_KEY, sdpa_fp8

OP_NAME = "fluxaccel::qk_norm_rope_fp8"
KEY = "fp8-qk-kernel-1"  # in the compile cache's key: graphs with the kernel apart from those without
NUM_WARPS = 4  # per token's program (FLUX.1: 24 heads of 128, three times)
# SHA-256 of the dedented source of ComfyUI's FLUX `attention(q, k, v, pe, mask, transformer_options)` FluxAccel read:
# RoPE on q and k, then optimized_attention
KNOWN_ATTENTION = {"04c2ff3e8ba8ad69fb7c62f97546542a58e6b81793792dbf6be46e6d1f5b77e1": "ComfyUI 0.33.0"}


def rope(x: torch.Tensor, pe: torch.Tensor) -> torch.Tensor:
    """ComfyUI's RoPE formula (comfy.ldm.flux.math._apply_rope1) on x (batch, heads, tokens, head_dim) with FLUX's
    rotations pe (batch or 1, 1, tokens, head_dim / 2, 2, 2)."""
    x_ = x.to(pe.dtype).reshape(*x.shape[:-1], -1, 1, 2)
    return (pe[..., 0] * x_[..., 0] + pe[..., 1] * x_[..., 1]).reshape(*x.shape).type_as(x)


def _cast(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).transpose(1, 2).contiguous()


def reference(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, pe: torch.Tensor,
              scales: torch.Tensor, heads: int, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(Q in FP8, K in FP8, V's absmax (1,) float32) of qkv (batch, tokens, >= 3 x heads x head_dim) as ComfyUI's
    single block computes Q and K, cast as FP8 attention casts them; Q and K (batch, tokens, heads, head_dim)."""
    b, n, _ = qkv.shape
    d = q_weight.shape[-1]
    q, k, v = qkv[..., :3 * heads * d].reshape(b, n, 3, heads, d).permute(2, 0, 3, 1, 4)
    q, k = (rope(F.rms_norm(t, (d,), w, eps), pe) for t, w in ((q, q_weight), (k, k_weight)))
    return _cast(q, scales[0]), _cast(k, scales[1]), v.abs().amax().float().reshape(1)


def _kernel():
    """The Triton kernel (fp8_qk_kernel.py imports triton: imported here, at a GPU call, not with FluxAccel)."""
    from .fp8_qk_kernel import qk_norm_rope_fp8_kernel

    return qk_norm_rope_fp8_kernel


def _gpu(qkv, q_weight, k_weight, pe, scales, heads, eps):
    import triton
    from torch.library import wrap_triton

    b, n, _ = qkv.shape
    d = q_weight.shape[-1]
    q = torch.empty((b, n, heads, d), device=qkv.device, dtype=torch.float8_e4m3fn)
    k = torch.empty_like(q)
    vmax = torch.zeros(1, device=qkv.device, dtype=torch.float32)
    wrap_triton(_kernel())[(n, b)](
        qkv, q_weight, k_weight, pe, scales, q, k, vmax, qkv.stride(0), qkv.stride(1),
        pe.stride(0) if pe.shape[0] > 1 else 0, pe.stride(2), q.stride(0), q.stride(1), 0, heads, eps,
        HEAD_DIM=d, BLOCK_H=triton.next_power_of_2(heads), BLOCK_V=triton.next_power_of_2(heads * d),
        num_warps=NUM_WARPS)
    return q, k, vmax


def _body(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, pe: torch.Tensor, scales: torch.Tensor,
          heads: int, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if qkv.device.type == "cuda":
        return _gpu(qkv, q_weight, k_weight, pe, scales, heads, eps)
    return reference(qkv, q_weight, k_weight, pe, scales, heads, eps)


_OP, UNAVAILABLE = register_op(OP_NAME, _body)


def qk_norm_rope_fp8(qkv, q_weight, k_weight, pe, scales, heads: int, eps: float):
    """(Q, K, V's absmax): see reference(). qkv's last dimension must be contiguous, pe's three last ones."""
    if _OP is None:
        raise RuntimeError(UNAVAILABLE)
    return _OP(qkv, q_weight.to(qkv.dtype).contiguous(), k_weight.to(qkv.dtype).contiguous(), pe,
               scales.float().contiguous(), int(heads), float(eps))


def source_hash(fn) -> str:
    """SHA-256 of a function's dedented source; '' where Python cannot read it."""
    try:
        return hashlib.sha256(textwrap.dedent(inspect.getsource(fn)).encode()).hexdigest()
    except (OSError, TypeError):
        return ""


def _eps(norm) -> float:
    """The norm's epsilon as torch's rms_norm takes it: None is float32's (the type it computes bf16 and fp16 in)."""
    return norm.eps if norm.eps is not None else torch.finfo(torch.float32).eps


def _rms_norm_weight(norm) -> torch.Tensor | None:
    """The weight of a plain RMSNorm as it runs (None where ComfyUI casts or patches it per call)."""
    if not isinstance(norm, torch.nn.RMSNorm) or getattr(norm, "comfy_cast_weights", False):
        return None
    if getattr(norm, "weight_function", None) or getattr(norm, "bias_function", None):
        return None
    return norm.weight if isinstance(norm.weight, torch.Tensor) else None


def why_not(block, attention) -> str:
    """Why this single block's Q and K cannot come out of the fused kernel with FP8 attention on ('' if they can):
    the operator, the block's attention function (`attention`, the one its forward calls) and its QK-norm. Not to be
    called in a trace (it reads source files)."""
    if _OP is None:
        return UNAVAILABLE
    if source_hash(attention) not in KNOWN_ATTENTION:
        return f"{getattr(attention, '__module__', '?')}.attention is not the one FluxAccel read"
    norm = getattr(block, "norm", None)
    weights = [_rms_norm_weight(getattr(norm, n, None)) for n in ("query_norm", "key_norm")]
    if any(w is None or w.ndim != 1 for w in weights) or weights[0].shape != weights[1].shape:
        return "the block's QK-norm is not a plain RMSNorm FluxAccel can read"
    if weights[0].shape[0] not in HEAD_DIMS or weights[0].shape[0] * block.num_heads != block.hidden_size:
        return f"head size {weights[0].shape[0]} is not one FlashAttention-3's FP8 kernel is built for"
    if _eps(norm.query_norm) != _eps(norm.key_norm):
        return "the block's query and key norms have different epsilons"
    return ""


def takes(block, qkv: torch.Tensor, pe, attn_mask, patches: dict, options: dict) -> bool:
    """Whether this call of a block why_not() cleared runs through fused_attention(): FP8 attention with Q's and K's
    scales from the QK-norm bound, no mask or attention patch (the usual way applies them), FLUX's rotations and
    layout. Everything here is a constant of the traced call."""
    d = block.hidden_size // block.num_heads
    return (options.get(SCALES_KEY) is not None and options.get(OVERRIDE_KEY) is sdpa_fp8 and attn_mask is None
            and not patches.get("attn1_patch") and qkv.dtype in (torch.bfloat16, torch.float16)
            and qkv.shape[-1] == 3 * block.hidden_size and qkv.stride(-1) == 1
            and isinstance(pe, torch.Tensor) and pe.dtype == torch.float32 and pe.ndim == 6 and pe.shape[1] == 1
            and pe.shape[0] in (1, qkv.shape[0]) and tuple(pe.shape[2:]) == (qkv.shape[1], d // 2, 2, 2)
            and pe.stride()[3:] == (4, 2, 1) and block.norm.query_norm.weight.device == qkv.device)


def fused_attention(block, qkv: torch.Tensor, pe: torch.Tensor, options: dict) -> torch.Tensor:
    """FP8 attention of a single block's QKV projection (batch, tokens, 3 x hidden) as fp8_attention.sdpa_fp8
    computes it, Q and K made by the fused kernel: (batch, tokens, hidden) in qkv's dtype."""
    b, n, _ = qkv.shape
    h, d = block.num_heads, block.hidden_size // block.num_heads
    norm, scales = block.norm, options[SCALES_KEY]
    q8, k8, vmax = qk_norm_rope_fp8(qkv, norm.query_norm.weight, norm.key_norm.weight, pe, scales, h,
                                    _eps(norm.query_norm))
    vs = (vmax[0] / FP8_MAX).clamp(min=1e-12)
    v8 = (qkv[..., 2 * h * d:].reshape(b, n, h, d).float() / vs).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    descale = [s.reshape(1, 1).expand(b, h) for s in (scales[0], scales[1], vs)]
    out = fa3_internals.fp8_forward(q8, k8, v8, *descale, softmax_scale=d ** -0.5)
    return out.to(qkv.dtype).reshape(b, n, h * d)
