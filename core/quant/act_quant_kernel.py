"""The Triton kernel of act_quant.py (imported only where a GPU call needs it: triton is imported with it)."""
import triton
import triton.language as tl

# GELU(tanh)(x) = x sigmoid(2z) = x / (1 + 2^(-2 log2(e) z)), z = sqrt(2/pi) (x + 0.044715 x^3)
_C1 = tl.constexpr(-2.0 * 1.4426950408889634 * 0.7978845608028654)
_C3 = tl.constexpr(-2.0 * 1.4426950408889634 * 0.7978845608028654 * 0.044715)


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
    amax = tl.max(tl.abs(h), 0)
    if HAS_LB:
        amax = tl.maximum(amax, lb).to(x.dtype).to(tl.float32)
    if HAS_UB:
        amax = tl.minimum(amax, ub).to(x.dtype).to(tl.float32)
    scale = tl.math.div_rn(amax, 448.0).to(x.dtype).to(tl.float32)  # divided in the input's dtype, as torchao does
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
    amax = tl.maximum(tl.max(tl.abs(a), 0), tl.max(tl.abs(g), 0))
    if HAS_LB:
        amax = tl.maximum(amax, lb).to(x.dtype).to(tl.float32)
    if HAS_UB:
        amax = tl.minimum(amax, ub).to(x.dtype).to(tl.float32)
    scale = tl.math.div_rn(amax, 448.0).to(x.dtype).to(tl.float32)
    r = 1.0 / scale
    q_row = q_ptr + row * q_stride
    tl.store(q_row + ca, tl.clamp(a * r, -448.0, 448.0).to(q_ptr.dtype.element_ty), mask=ca < n_a)
    tl.store(q_row + n_a + cm, tl.clamp(g * r, -448.0, 448.0).to(q_ptr.dtype.element_ty), mask=cm < n_m)
    tl.store(s_ptr + row, scale)
