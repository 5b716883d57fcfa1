"""FlashAttention-3's FP8 forward (the `fa3-fwd` wheel, Hopper GPUs) as FluxAccel's FP8 attention calls it.

The wheel's Python interface (`fa3_fwd_interface`) registers `torch.ops.fa3_fwd._flash_attn_forward`, a torch custom
op with a fake implementation, so torch.compile traces it as one node. Its public `flash_attn_func` wraps that op in an
autograd Function, which inference does not need and which would add a layer to trace; FluxAccel calls the op.
"""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

import torch

from . import Unavailable

UPSTREAM = "fa3-fwd"
NAMESPACE, OP = "fa3_fwd", "_flash_attn_forward"


def _version() -> str:
    try:
        return version(UPSTREAM)
    except PackageNotFoundError:
        return "(not installed)"


def available() -> bool | Unavailable:
    """True where the FP8 forward can be called: its interface imports (registering the op) and the op is there."""
    try:
        import fa3_fwd_interface  # noqa: F401  (registers the op)
    except Exception as e:  # noqa: BLE001 -- absent, or built for another torch/CUDA: either way not callable here
        return Unavailable(UPSTREAM, _version(), "fa3_fwd_interface", f"{type(e).__name__}: {e}")
    try:
        getattr(getattr(torch.ops, NAMESPACE), OP)
    except AttributeError:
        return Unavailable(UPSTREAM, _version(), f"torch.ops.{NAMESPACE}.{OP}")
    return True


def fp8_forward(qkv: tuple, descales: tuple, softmax_scale: float) -> torch.Tensor:
    """Attention of FP8 (batch, tokens, heads, dim) Q, K, V (qkv) with their (batch, heads) descales (the same order);
    bf16 out, same layout."""
    op = getattr(getattr(torch.ops, NAMESPACE), OP)
    (q8, k8, v8), (q_descale, k_descale, v_descale) = qkv, descales
    return op(q8, k8, v8, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, softmax_scale=softmax_scale)[0]
