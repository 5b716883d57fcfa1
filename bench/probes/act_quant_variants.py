"""Probe-only variants of core/quant/act_quant_kernel.py's kernel, timed against it by flux_blocks.py --fused.

recompute: the row kept in registers as bf16 only (half the registers of keeping GELU's fp32 output), GELU evaluated
again after the row's maximum: more arithmetic, more programs resident per SM. Same numbers as the product kernel.
(FLUX.2's SiLU-gate kernels, first written here, are the product's now: act_quant_kernel.py.)
"""
import triton
import triton.language as tl

from fluxaccel.core.quant.act_quant_kernel import _C1, _C3  # GELU's constants, the product kernel's


@triton.jit
def _gelu_bf16(x, cols, GELU_FROM: tl.constexpr):
    xf = x.to(tl.float32)
    g = tl.fdiv(xf, 1.0 + tl.exp2(xf * (_C1 + _C3 * xf * xf)))
    return tl.where(cols >= GELU_FROM, g.to(x.dtype), x).to(tl.float32)


@triton.jit
def gelu_rowwise_fp8_recompute_kernel(x_ptr, q_ptr, s_ptr, n_cols, x_stride, q_stride,
                                      GELU_FROM: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    amax = tl.max(tl.abs(_gelu_bf16(x, cols, GELU_FROM)), 0)
    scale = tl.math.div_rn(amax, 448.0).to(x.dtype).to(tl.float32)
    q = tl.clamp(_gelu_bf16(x, cols, GELU_FROM) * (1.0 / scale), -448.0, 448.0).to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + row * q_stride + cols, q, mask=mask)
    tl.store(s_ptr + row, scale)


def recompute(x, gelu_from, num_warps):
    import torch

    m, n = x.shape
    q = torch.empty((m, n), device=x.device, dtype=torch.float8_e4m3fn)
    s = torch.empty((m, 1), device=x.device, dtype=torch.float32)
    gelu_rowwise_fp8_recompute_kernel[(m,)](x, q, s, n, x.stride(0), q.stride(0), GELU_FROM=gelu_from,
                                            BLOCK=triton.next_power_of_2(n), num_warps=num_warps)
    return q, s
