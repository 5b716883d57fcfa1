"""The Triton kernel of fp8_qk.py (imported only where a GPU call needs it: triton is imported with it)."""
import triton
import triton.language as tl


@triton.jit
def _norm_rope_fp8(src, w_ptr, scale, dst, offs, mask, pairs, f00, f01, f10, f11, eps, HEAD_DIM: tl.constexpr):
    """One token's heads of Q or K ([heads, HEAD_DIM / 2, 2] at src + offs): RMSNorm over each head (float32, times
    the weight, rounded to the input's dtype as torch's rms_norm rounds), RoPE on each (even, odd) pair with this
    token's 2x2 rotation (float32, rounded to the input's dtype as ComfyUI's formula rounds), divided by the scale,
    clamped and cast to the output's dtype (e4m3)."""
    x = tl.load(src + offs, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(tl.sum(xf * xf, 2), 1) / HEAD_DIM + eps)
    w = tl.load(w_ptr + pairs[:, None] * 2 + tl.arange(0, 2)[None, :]).to(tl.float32)
    y = (xf * rstd[:, None, None] * w[None, :, :]).to(x.dtype).to(tl.float32)
    ye, yo = tl.split(y)
    out = tl.join(f00[None, :] * ye + f01[None, :] * yo, f10[None, :] * ye + f11[None, :] * yo)
    out = out.to(x.dtype).to(tl.float32) / scale
    tl.store(dst + offs, tl.clamp(out, -448.0, 448.0).to(dst.dtype.element_ty), mask=mask)


@triton.jit
def qk_norm_rope_fp8_kernel(x_ptr, wq_ptr, wk_ptr, pe_ptr, s_ptr, q_ptr, k_ptr, vmax_ptr, x_sb, x_st, pe_sb, pe_st,
                            o_sb, o_st, tok_off, heads, eps, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                            BLOCK_V: tl.constexpr):
    """One program per (token, batch): the token's row of a FLUX QKV projection ([Q | K | V], heads x HEAD_DIM each)
    read once; Q and K normed, rotated and cast to FP8 (their scales at s_ptr[0], s_ptr[1]) into (batch, tokens,
    heads, HEAD_DIM) outputs at token t + tok_off; V's absmax into vmax_ptr (an atomic max: V's scale needs the
    whole tensor's, so V is cast after this kernel)."""
    t = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    pairs = tl.arange(0, HEAD_DIM // 2)
    offs = (tl.arange(0, BLOCK_H)[:, None, None] * HEAD_DIM + pairs[None, :, None] * 2
            + tl.arange(0, 2)[None, None, :])
    width = heads * HEAD_DIM
    mask = offs < width
    row = x_ptr + b * x_sb + t * x_st
    rot = pe_ptr + b * pe_sb + (t + tok_off) * pe_st + pairs * 4  # ComfyUI's (HEAD_DIM / 2, 2, 2) rotations
    f00, f01 = tl.load(rot), tl.load(rot + 1)
    f10, f11 = tl.load(rot + 2), tl.load(rot + 3)
    out = b * o_sb + (t + tok_off) * o_st
    _norm_rope_fp8(row, wq_ptr, tl.load(s_ptr), q_ptr + out, offs, mask, pairs, f00, f01, f10, f11, eps, HEAD_DIM)
    _norm_rope_fp8(row + width, wk_ptr, tl.load(s_ptr + 1), k_ptr + out, offs, mask, pairs, f00, f01, f10, f11, eps,
                   HEAD_DIM)
    cols = tl.arange(0, BLOCK_V)
    v = tl.load(row + 2 * width + cols, mask=cols < width, other=0.0)
    tl.atomic_max(vmax_ptr, tl.max(tl.abs(v.to(tl.float32)), 0))
