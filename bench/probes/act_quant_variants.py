"""Probe-only variants of core/quant/act_quant_kernel.py's kernel, timed against it by flux_blocks.py --fused.

recompute: the row kept in registers as bf16 only (half the registers of keeping GELU's fp32 output), GELU evaluated
again after the row's maximum: more arithmetic, more programs resident per SM. Same numbers as the product kernel.
silu_gate, silu_gate_pair: FLUX.2's SiLU-gated MLP (SiLU(m1) * m2) and its row-wise FP8 quantization in one pass, for
the double blocks' MLPs and the single block's linear2 (flux_blocks.py --flux2-rows).
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


_NEG_LOG2E = tl.constexpr(-1.4426950408889634)  # SiLU(x) = x / (1 + 2^(-log2(e) x))


@triton.jit
def _silu_gated(m_row, ch, hm, n_h):
    """SiLU(m1) * m2 of one row m = [m1 | m2] (n_h columns each) at columns ch (mask hm), rounded to m's dtype after
    each op as eager rounds (ComfyUI's SiLUActivation: gate_fn(x1) * x2), as float32."""
    x1 = tl.load(m_row + ch, mask=hm, other=0.0)
    x2 = tl.load(m_row + n_h + ch, mask=hm, other=0.0)
    x1f = x1.to(tl.float32)
    g = tl.fdiv(x1f, 1.0 + tl.exp2(x1f * _NEG_LOG2E)).to(x1.dtype).to(tl.float32)
    return (g * x2.to(tl.float32)).to(x1.dtype).to(tl.float32)


@triton.jit
def silu_gate_rowwise_fp8_kernel(m_ptr, q_ptr, s_ptr, n_h, m_stride, q_stride, BLOCK_H: tl.constexpr):
    """FLUX.2's SiLU-gated MLP: the second Linear's input SiLU(m1) * m2 (ComfyUI's SiLUActivation, rounded to m's dtype
    after each op as eager rounds) and its row-wise FP8 quantization in one pass, from the first Linear's output
    m = [m1 | m2] (n_h columns each): the gated row is never written in bf16."""
    row = tl.program_id(0).to(tl.int64)
    ch = tl.arange(0, BLOCK_H)
    hm = ch < n_h
    h = _silu_gated(m_ptr + row * m_stride, ch, hm, n_h)
    scale = tl.math.div_rn(tl.max(tl.abs(h), 0), 448.0).to(m_ptr.dtype.element_ty).to(tl.float32)
    tl.store(q_ptr + row * q_stride + ch, tl.clamp(h * (1.0 / scale), -448.0, 448.0).to(q_ptr.dtype.element_ty),
             mask=hm)
    tl.store(s_ptr + row, scale)


@triton.jit
def silu_gate_pair_rowwise_fp8_kernel(a_ptr, m_ptr, q_ptr, s_ptr, n_a, n_h, a_stride, m_stride, q_stride,
                                      BLOCK_A: tl.constexpr, BLOCK_H: tl.constexpr):
    """FLUX.2's single block: linear2's input [a | SiLU(m1) * m2] (the attention output and the gated MLP stream, a
    strided view of linear1's output) quantized row-wise in one pass, its concatenation never written."""
    row = tl.program_id(0).to(tl.int64)
    ch = tl.arange(0, BLOCK_H)
    hm = ch < n_h
    h = _silu_gated(m_ptr + row * m_stride, ch, hm, n_h)
    ca = tl.arange(0, BLOCK_A)
    a = tl.load(a_ptr + row * a_stride + ca, mask=ca < n_a, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(h), 0), tl.max(tl.abs(a), 0))
    scale = tl.math.div_rn(amax, 448.0).to(m_ptr.dtype.element_ty).to(tl.float32)
    r = 1.0 / scale
    q_row = q_ptr + row * q_stride
    tl.store(q_row + ca, tl.clamp(a * r, -448.0, 448.0).to(q_ptr.dtype.element_ty), mask=ca < n_a)
    tl.store(q_row + n_a + ch, tl.clamp(h * r, -448.0, 448.0).to(q_ptr.dtype.element_ty), mask=hm)
    tl.store(s_ptr + row, scale)


def silu_gate(m, num_warps=32, out_dtype=None):
    """(q, scale) of SiLU(m1) * m2 row by row: m (rows, 2 n_h) with unit column stride."""
    import torch

    rows, n_h = m.shape[0], m.shape[1] // 2
    q = torch.empty((rows, n_h), device=m.device, dtype=out_dtype or torch.float8_e4m3fn)
    s = torch.empty((rows, 1), device=m.device, dtype=torch.float32)
    silu_gate_rowwise_fp8_kernel[(rows,)](m, q, s, n_h, m.stride(0), q.stride(0),
                                          BLOCK_H=triton.next_power_of_2(n_h), num_warps=num_warps)
    return q, s


def silu_gate_pair(a, m, num_warps=32, out_dtype=None):
    """(q, scale) of [a | SiLU(m1) * m2] row by row: a (rows, n_a), m (rows, 2 n_h), each with unit column stride."""
    import torch

    rows, n_a = a.shape
    n_h = m.shape[1] // 2
    q = torch.empty((rows, n_a + n_h), device=a.device, dtype=out_dtype or torch.float8_e4m3fn)
    s = torch.empty((rows, 1), device=a.device, dtype=torch.float32)
    silu_gate_pair_rowwise_fp8_kernel[(rows,)](a, m, q, s, n_a, n_h, a.stride(0), m.stride(0), q.stride(0),
                                               BLOCK_A=triton.next_power_of_2(n_a),
                                               BLOCK_H=triton.next_power_of_2(n_h), num_warps=num_warps)
    return q, s
