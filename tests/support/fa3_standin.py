"""A CPU stand-in for FlashAttention-3's FP8 operator (torch.ops.fa3_fwd._flash_attn_forward), for tests only: the
fa3-fwd wheel runs on Hopper GPUs. It computes what the kernel computes -- attention of the dequantized FP8 Q, K, V
(FP8 values times their descale) -- in float32, and records each call's descales, so tests can check what FluxAccel's
compiled graph hands the kernel. Registered once per process (the real wheel is never installed on test machines)."""
import torch

CALLS: list[dict] = []
_lib = None


def register() -> None:
    global _lib
    if _lib is not None:
        return
    _lib = torch.library.Library("fa3_fwd", "FRAGMENT")
    _lib.define("_flash_attn_forward(Tensor q, Tensor k, Tensor v, *, Tensor? q_descale=None, Tensor? k_descale=None, "
                "Tensor? v_descale=None, float? softmax_scale=None) -> (Tensor, Tensor)")

    def cpu(q, k, v, q_descale=None, k_descale=None, v_descale=None, softmax_scale=None):
        assert q.dtype == k.dtype == v.dtype == torch.float8_e4m3fn, (q.dtype, k.dtype, v.dtype)
        CALLS.append({"q_descale": q_descale.clone(), "k_descale": k_descale.clone(), "v_descale": v_descale.clone()})

        def deq(t, s):  # (batch, tokens, heads, dim) FP8 and (batch, heads) descales -> (batch, heads, tokens, dim)
            return t.float().transpose(1, 2) * s.float()[:, :, None, None]

        out = torch.nn.functional.scaled_dot_product_attention(deq(q, q_descale), deq(k, k_descale),
                                                               deq(v, v_descale), scale=softmax_scale)
        return out.transpose(1, 2).to(torch.bfloat16).contiguous(), torch.zeros(q.shape[0], q.shape[2], q.shape[1])

    def fake(q, k, v, q_descale=None, k_descale=None, v_descale=None, softmax_scale=None):
        return (torch.empty(q.shape, dtype=torch.bfloat16, device=q.device),
                torch.empty(q.shape[0], q.shape[2], q.shape[1], device=q.device))

    _lib.impl("_flash_attn_forward", cpu, "CPU")
    torch.library.register_fake("fa3_fwd::_flash_attn_forward", fake, lib=_lib)
