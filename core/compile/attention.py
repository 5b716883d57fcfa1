"""The attention FLUX runs inside FluxAccel's compiled model: PyTorch SDPA with cuDNN's fused attention first.

ComfyUI 0.33 asks SDPA for FlashAttention first, then cuDNN (comfy/ops.py, SDPA_BACKEND_PRIORITY). On Hopper
cuDNN's fused attention is the faster of the two at FLUX's shapes, so FluxAccel's compiled blocks ask for it first.

The compiled clone passes `sdpa_cudnn_first` as ComfyUI's `optimized_attention_override` in the options of its own
call only: nothing process-wide changes, other branches keep ComfyUI's attention, and an override the workflow set
(e.g. ComfyUI's ModelAttentionBackend node) is passed through instead. The backend choice is made when the graph is
traced, so it costs nothing per call.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..upstream import comfy_internals

OVERRIDE_KEY = "optimized_attention_override"  # ComfyUI's transformer_options key (comfy/ldm/modules/attention.py)


def priority() -> list:
    return [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA of (batch, heads, tokens, head_dim) tensors with cuDNN first, then flash, mem-efficient, math."""

    if mask is not None:  # as ComfyUI's attention_pytorch: broadcast a (tokens, tokens) or (b, t, t) mask over heads
        if mask.ndim == 2:
            mask = mask.unsqueeze(0)
        if mask.ndim == 3:
            mask = mask.unsqueeze(1)
    with sdpa_kernel(priority(), set_priority=True):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False)


# ComfyUI's attentions that query free memory inside the model call (psutil, torch.cuda.mem_get_info): dynamo cannot
# trace that inside a compiled block region ("UncapturedHigherOrderOpError ... builtin open"). ComfyUI picks one of
# them on a CPU unless started with --use-pytorch-cross-attention.
UNTRACEABLE = ("attention_sub_quad", "attention_split")


def comfy_attention_name() -> str:
    """The attention function ComfyUI chose at start for FLUX (comfy.ldm.flux.math.optimized_attention)."""
    fm = comfy_internals.flux_math()
    fn = getattr(fm.optimized_attention, "__wrapped__", fm.optimized_attention)
    return getattr(fn, "__name__", repr(fn))


def sdpa_cudnn_first(func, q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                     skip_output_reshape=False, **kwargs):
    """An optimized_attention_override: FLUX's call (head-split q/k/v, skip_reshape=True) on CUDA goes to `sdpa`, and
    on any device where ComfyUI's own choice cannot be compiled (UNTRACEABLE: PyTorch SDPA is what
    --use-pytorch-cross-attention would pick); anything else to ComfyUI's own attention function `func`, unchanged."""
    fits = skip_reshape and not kwargs.get("enable_gqa")
    if not (fits and (q.is_cuda or getattr(func, "__name__", "") in UNTRACEABLE)):
        return func(q, k, v, heads, mask=mask, attn_precision=attn_precision, skip_reshape=skip_reshape,
                    skip_output_reshape=skip_output_reshape, **kwargs)
    b, _, _, dim_head = q.shape
    out = sdpa(q, k, v, mask)
    if skip_output_reshape:
        return out
    return out.transpose(1, 2).reshape(b, -1, heads * dim_head)
