"""The Triton kernel of act_quant.py (imported only where a GPU call needs it: triton is imported with it)."""
import triton
import triton.language as tl


@triton.jit
def gelu_rowwise_fp8_kernel(x_ptr, q_ptr, s_ptr, n_cols, x_stride, q_stride, lb, ub,
                            GELU_FROM: tl.constexpr, HAS_LB: tl.constexpr, HAS_UB: tl.constexpr,
                            BLOCK: tl.constexpr):
    """One program per row, the whole row in registers: GELU(tanh) from column GELU_FROM on, rounded to the input's
    dtype; the row's absmax (bounded by lb/ub where set) / 448, rounded to the input's dtype, as its scale; the row divided, clamped, cast to e4m3."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    inner = 0.7978845608028654 * (xf + 0.044715 * xf * xf * xf)
    g = (xf * tl.sigmoid(2.0 * inner)).to(x.dtype)  # 0.5 x (1 + tanh(z)) = x sigmoid(2z)
    h = tl.where(cols >= GELU_FROM, g, x).to(tl.float32)
    amax = tl.max(tl.where(mask, tl.abs(h), 0.0), 0)
    if HAS_LB:
        amax = tl.maximum(amax, lb).to(x.dtype).to(tl.float32)
    if HAS_UB:
        amax = tl.minimum(amax, ub).to(x.dtype).to(tl.float32)
    scale = tl.math.div_rn(amax, 448.0).to(x.dtype).to(tl.float32)  # divided in the input's dtype, as torchao does
    q = tl.clamp(tl.math.div_rn(h, scale), -448.0, 448.0).to(q_ptr.dtype.element_ty)  # e4m3 (float32: unrounded)
    tl.store(q_ptr + row * q_stride + cols, q, mask=mask)
    tl.store(s_ptr + row, scale)
