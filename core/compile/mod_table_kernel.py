"""The Triton kernel of mod_table.py (imported only where a GPU call needs it: triton is imported with it)."""
import triton
import triton.language as tl


@triton.jit
def modulation_rows_kernel(vec_ptr, rows_ptr, w_ptr, b_ptr, table_ptr, out_ptr, n, d, vec_stride, w_stride,
                           table_stride, out_stride, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_D: tl.constexpr):
    """One program per (batch row, BLOCK_N outputs). Where the row's entry in rows is a table row, its outputs are
    copied from that row of the table and the weights are not read; elsewhere they are computed: SiLU of the vector
    rounded to its dtype (as eager rounds it), times the weights' rows, in float32, plus the bias."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < n
    r = tl.load(rows_ptr + row).to(tl.int64)
    if r >= 0:
        tl.store(out_ptr + row * out_stride + cols, tl.load(table_ptr + r * table_stride + cols, mask=mask), mask=mask)
    else:
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(0, d, BLOCK_D):
            ds = start + tl.arange(0, BLOCK_D)
            dmask = ds < d
            x = tl.load(vec_ptr + row * vec_stride + ds, mask=dmask, other=0.0)
            xf = x.to(tl.float32)
            s = tl.fdiv(xf, 1.0 + tl.exp(-xf)).to(x.dtype).to(tl.float32)
            w = tl.load(w_ptr + cols[:, None] * w_stride + ds[None, :], mask=mask[:, None] & dmask[None, :], other=0.0)
            acc += tl.sum(w.to(tl.float32) * s[None, :], axis=1)
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * out_stride + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)
