"""The Triton kernels of act_quant.py (imported only where a GPU call needs it: triton is imported with it)."""
import triton
import triton.language as tl

# GELU(tanh)(x) = x sigmoid(2z) = x / (1 + 2^(-2 log2(e) z)), z = sqrt(2/pi) (x + 0.044715 x^3)
_C1 = tl.constexpr(-2.0 * 1.4426950408889634 * 0.7978845608028654)
_C3 = tl.constexpr(-2.0 * 1.4426950408889634 * 0.7978845608028654 * 0.044715)


@triton.jit
def _scale(amax, lb, ub, dtype: tl.constexpr, HAS_LB: tl.constexpr, HAS_UB: tl.constexpr):
    """The row's scale: its absmax (bounded by lb/ub where set) / 448, rounded to the input's dtype as torchao does."""
    if HAS_LB:
        amax = tl.maximum(amax, lb).to(dtype).to(tl.float32)
    if HAS_UB:
        amax = tl.minimum(amax, ub).to(dtype).to(tl.float32)
    return tl.math.div_rn(amax, 448.0).to(dtype).to(tl.float32)


@triton.jit
def gelu_rowwise_fp8_kernel(x_ptr, q_ptr, s_ptr, n_cols, x_stride, q_stride, lb, ub,
                            GELU_FROM: tl.constexpr, HAS_LB: tl.constexpr, HAS_UB: tl.constexpr,
                            BLOCK: tl.constexpr):
    """One program per row, the whole row in registers: GELU(tanh) from column GELU_FROM on, rounded to the input's
    dtype; the row's absmax (bounded by lb/ub where set) / 448, rounded to the input's dtype, as its scale; the row
    times the scale's reciprocal, clamped, cast to the output's dtype (e4m3). Few operations per element: the
    kernel is bound by memory, not arithmetic."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    e = tl.exp2(xf * (_C1 + _C3 * xf * xf))
    g = tl.fdiv(xf, 1.0 + e)  # masked lanes: x = 0, GELU 0, no effect on the absmax
    h = tl.where(cols >= GELU_FROM, g.to(x.dtype), x).to(tl.float32)
    scale = _scale(tl.max(tl.abs(h), 0), lb, ub, x.dtype, HAS_LB, HAS_UB)
    q = tl.clamp(h * (1.0 / scale), -448.0, 448.0).to(q_ptr.dtype.element_ty)  # e4m3 (float32: unrounded)
    tl.store(q_ptr + row * q_stride + cols, q, mask=mask)
    tl.store(s_ptr + row, scale)


@triton.jit
def gelu_pair_rowwise_fp8_kernel(a_ptr, m_ptr, q_ptr, s_ptr, n_a, n_m, a_stride, m_stride, q_stride, lb, ub,
                                 HAS_LB: tl.constexpr, HAS_UB: tl.constexpr, BLOCK_A: tl.constexpr,
                                 BLOCK_M: tl.constexpr):
    """gelu_rowwise_fp8_kernel of the row [a | m] with GELU from a's end on, read from two tensors (the single block's
    attention output and its MLP stream, a strided view of linear1's output), so that the row is never written
    whole before it is quantized. Same numbers as the one-input kernel on the concatenated row."""
    row = tl.program_id(0).to(tl.int64)
    ca = tl.arange(0, BLOCK_A)
    cm = tl.arange(0, BLOCK_M)
    a = tl.load(a_ptr + row * a_stride + ca, mask=ca < n_a, other=0.0).to(tl.float32)
    x = tl.load(m_ptr + row * m_stride + cm, mask=cm < n_m, other=0.0)
    xf = x.to(tl.float32)
    g = tl.fdiv(xf, 1.0 + tl.exp2(xf * (_C1 + _C3 * xf * xf))).to(x.dtype).to(tl.float32)
    scale = _scale(tl.maximum(tl.max(tl.abs(a), 0), tl.max(tl.abs(g), 0)), lb, ub, x.dtype, HAS_LB, HAS_UB)
    r = 1.0 / scale
    q_row = q_ptr + row * q_stride
    tl.store(q_row + ca, tl.clamp(a * r, -448.0, 448.0).to(q_ptr.dtype.element_ty), mask=ca < n_a)
    tl.store(q_row + n_a + cm, tl.clamp(g * r, -448.0, 448.0).to(q_ptr.dtype.element_ty), mask=cm < n_m)
    tl.store(s_ptr + row, scale)


_NEG_LOG2E = tl.constexpr(-1.4426950408889634)  # SiLU(x) = x / (1 + 2^(-log2(e) x))


@triton.jit
def _silu_gated(x1, x2):
    """SiLU(x1) * x2 (FLUX.2's SiLUActivation: gate_fn(x1) * x2), rounded to the inputs' dtype after each op as eager
    rounds, as float32."""
    x1f = x1.to(tl.float32)
    g = tl.fdiv(x1f, 1.0 + tl.exp2(x1f * _NEG_LOG2E)).to(x1.dtype).to(tl.float32)
    return (g * x2.to(tl.float32)).to(x1.dtype).to(tl.float32)


@triton.jit
def silu_gate_rowwise_fp8_kernel(x_ptr, q_ptr, s_ptr, n_out, half, x_stride, q_stride, lb, ub,
                                 GATE_FROM: tl.constexpr, HAS_LB: tl.constexpr, HAS_UB: tl.constexpr,
                                 BLOCK: tl.constexpr):
    """gelu_rowwise_fp8_kernel for FLUX.2's SiLU-gated MLP: the input row is [x0 | m1 | m2] (x0: GATE_FROM columns,
    kept; m1, m2: `half` columns each), the quantized row [x0 | SiLU(m1) * m2] (n_out = GATE_FROM + half columns).
    The gated row is never written in bf16."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_out
    gated = cols >= GATE_FROM
    x_row = x_ptr + row * x_stride
    x = tl.load(x_row + cols, mask=mask, other=0.0)
    x2 = tl.load(x_row + cols + half, mask=mask & gated, other=0.0)  # masked lanes: 0, no effect on the absmax
    h = tl.where(gated, _silu_gated(x, x2), x.to(tl.float32))
    scale = _scale(tl.max(tl.abs(h), 0), lb, ub, x.dtype, HAS_LB, HAS_UB)
    tl.store(q_ptr + row * q_stride + cols, tl.clamp(h * (1.0 / scale), -448.0, 448.0).to(q_ptr.dtype.element_ty),
             mask=mask)
    tl.store(s_ptr + row, scale)


@triton.jit
def silu_gate_pair_rowwise_fp8_kernel(a_ptr, m_ptr, q_ptr, s_ptr, n_a, half, a_stride, m_stride, q_stride, lb, ub,
                                      HAS_LB: tl.constexpr, HAS_UB: tl.constexpr, BLOCK_A: tl.constexpr,
                                      BLOCK_H: tl.constexpr):
    """silu_gate_rowwise_fp8_kernel of the row [a | m1 | m2] with the gate from a's end on, read from two tensors
    (FLUX.2's single block: the attention output and the MLP stream, a strided view of linear1's output), so that
    linear2's input row is never written before it is quantized. Same numbers as the one-input kernel."""
    row = tl.program_id(0).to(tl.int64)
    ca = tl.arange(0, BLOCK_A)
    ch = tl.arange(0, BLOCK_H)
    hm = ch < half
    m_row = m_ptr + row * m_stride
    h = _silu_gated(tl.load(m_row + ch, mask=hm, other=0.0), tl.load(m_row + half + ch, mask=hm, other=0.0))
    a = tl.load(a_ptr + row * a_stride + ca, mask=ca < n_a, other=0.0)
    af = a.to(tl.float32)
    scale = _scale(tl.maximum(tl.max(tl.abs(af), 0), tl.max(tl.abs(h), 0)), lb, ub, a.dtype, HAS_LB, HAS_UB)
    r = 1.0 / scale
    q_row = q_ptr + row * q_stride
    tl.store(q_row + ca, tl.clamp(af * r, -448.0, 448.0).to(q_ptr.dtype.element_ty), mask=ca < n_a)
    tl.store(q_row + n_a + ch, tl.clamp(h * r, -448.0, 448.0).to(q_ptr.dtype.element_ty), mask=hm)
    tl.store(s_ptr + row, scale)
