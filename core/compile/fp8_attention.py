"""FP8 attention (opt-in on the Compile node): FLUX's attention as FlashAttention-3's FP8 kernel.

FlashAttention-3 (the `fa3-fwd` wheel: `pip install fa3-fwd`, Hopper GPUs) runs attention on FP8 e4m3 Q, K and V with
one scale each. The casts happen inside the compiled graph, where Q, K and V are made, so inductor fuses each cast
into the kernel that makes the tensor (QK-norm and RoPE for Q and K): no separate quantization pass.

Scales: FLUX normalises Q and K per head (RMSNorm with a learned weight) before RoPE, so no element of Q can exceed
sqrt(head_dim) x the largest |weight| (an RMS-normed vector's element is at most sqrt(head_dim) in size, and RoPE
rotates pairs, which keeps their length). Q's and K's scales come from that bound (1 % over it, for rounding), read
from the block's norm weights inside the compiled block: no reduction over Q or K. V has no such bound: its scale is
each call's absmax. A block whose norm weights cannot be read takes each call's absmax for Q and K too (the Compile
node says so). Values are clamped to FP8's range before the cast.
"""
from __future__ import annotations

import math

import torch

from ..upstream import comfy_internals, fa3_internals
from .attention import sdpa_cudnn_first

SCALES_KEY = "fluxaccel_fp8_attention_qk_scales"  # transformer_options key: (2,) float32, Q's and K's scale
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
MARGIN = 1.01  # over the QK-norm bound, for rounding in the norm and RoPE
HEAD_DIMS = (64, 96, 128, 192, 256)  # what FlashAttention-3's FP8 kernel is built for


def why_not(device: torch.device) -> str | None:
    """Why FP8 attention cannot run on `device` here (what to do about it), or None."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"it runs on NVIDIA Hopper GPUs only; this model runs on {device}"
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return (f"FlashAttention-3 runs on Hopper GPUs (compute capability 9.x, e.g. H100, H200); this GPU is "
                f"{major}.{minor}")
    ok = fa3_internals.available()
    if not ok:
        return f"FlashAttention-3's FP8 kernel cannot be called ({ok}); install it with `pip install fa3-fwd`"
    return None


def _norms(block) -> list | None:
    """The QK-norm modules of a FLUX double block (image and text) or single block, or None."""
    parts = [getattr(block, "img_attn", None), getattr(block, "txt_attn", None)] if hasattr(block, "img_attn") else [block]
    norms = [getattr(p, "norm", None) for p in parts]
    if any(n is None or not hasattr(n, "query_norm") or not hasattr(n, "key_norm") for n in norms):
        return None
    return norms


def _norm_weight(norm) -> torch.Tensor | str:
    """The weight an RMSNorm multiplies by, as it runs; or why FluxAccel cannot take its bound from it."""
    if getattr(norm, "weight_function", None) or getattr(norm, "bias_function", None):
        return "ComfyUI changes its QK-norm weights at each call (a LoRA or another patch on them)"
    w = comfy_internals.rms_norm_weight(norm)
    return w if isinstance(w, torch.Tensor) else f"its QK-norm weight cannot be read ({w})"


def _qk_weights(block) -> list[list[torch.Tensor]] | str:
    """The block's query-norm weights and key-norm weights (image and text stream each), or why not."""
    norms = _norms(block)
    if norms is None:
        return "it has no QK-norm FluxAccel knows"
    weights = [[_norm_weight(getattr(n, which)) for n in norms] for which in ("query_norm", "key_norm")]
    return next((w for pair in weights for w in pair if isinstance(w, str)), weights)


def why_no_qk_bound(block) -> str:
    """Why this block's Q/K FP8 scales cannot come from its QK-norm weights ("" where they can)."""
    weights = _qk_weights(block)
    return weights if isinstance(weights, str) else ""


def why_qk_bound_off(dm: torch.nn.Module) -> str:
    """FP8 attention takes each block's Q/K scales from its QK-norm weights; a block where they cannot be read takes
    each call's absmax of Q and K instead (one more pass over Q and K): how many and why ('' where none)."""
    blocks = [*getattr(dm, "double_blocks", ()), *getattr(dm, "single_blocks", ())]
    whys = [w for w in map(why_no_qk_bound, blocks) if w]
    return f"{len(whys)} of {len(blocks)} blocks take each call's absmax of Q and K instead: {whys[0]}" if whys else ""


def qk_scales(block) -> torch.Tensor | None:
    """Q's and K's FP8 scales of this block from its QK-norm weights ((2,) float32), or None where the block has no
    QK-norm FluxAccel knows or its weights change per call (Q and K then take each call's absmax; why_no_qk_bound says
    why). An RMS-normed vector's element is at most sqrt(head_dim) x max |weight|."""
    weights = _qk_weights(block)
    if isinstance(weights, str):
        return None
    head_dim = weights[0][0].shape[-1]
    top = torch.stack([torch.stack([w.detach().abs().amax().float() for w in pair]).amax() for pair in weights])
    return top.to(torch.float32) * (math.sqrt(head_dim) * MARGIN / FP8_MAX)


def _absmax_scale(t: torch.Tensor) -> torch.Tensor:
    return (t.detach().abs().amax().float() / FP8_MAX).clamp(min=1e-12)


def _fp8(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(batch, heads, tokens, dim) -> FP8 (batch, tokens, heads, dim), as FlashAttention takes it."""
    return (t.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).transpose(1, 2)


def sdpa_fp8(func, q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False,
             transformer_options=None, **kwargs):
    """An optimized_attention_override: FLUX's call (head-split q/k/v of shape (batch, heads, tokens, head_dim),
    skip_reshape=True) through FlashAttention-3's FP8 kernel. A call FLUX does not make (a mask: the compiled call
    refuses workflows that pass one; another layout or head size) goes to cuDNN-first SDPA, as without FP8 attention."""
    if not (skip_reshape and mask is None and q.shape[-1] in HEAD_DIMS and not kwargs.get("enable_gqa")):
        return sdpa_cudnn_first(func, q, k, v, heads, mask=mask, attn_precision=attn_precision,
                                skip_reshape=skip_reshape, skip_output_reshape=skip_output_reshape,
                                transformer_options=transformer_options, **kwargs)
    b, h, n, d = q.shape
    qk = (transformer_options or {}).get(SCALES_KEY)
    qs, ks = (qk[0], qk[1]) if qk is not None else (_absmax_scale(q), _absmax_scale(k))
    vs = _absmax_scale(v)
    descale = [s.reshape(1, 1).expand(b, h) for s in (qs, ks, vs)]
    out = fa3_internals.fp8_forward((_fp8(q, qs), _fp8(k, ks), _fp8(v, vs)), tuple(descale), softmax_scale=d ** -0.5)
    out = out.to(q.dtype)  # (batch, tokens, heads, dim)
    if skip_output_reshape:
        return out.transpose(1, 2)
    return out.reshape(b, n, h * d)
