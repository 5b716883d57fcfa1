"""Kernel variants of core/compile/fp8_qk_kernel.py for bench/probes/fp8_qk.py --variants: which part of the
kernel costs (V's absmax as an atomic, tl.split/tl.join's layout changes, the tile shape)."""
import triton
import triton.language as tl


@triton.jit
def _v_absmax(v_row, width, vmax_ptr, t, BLOCK_V: tl.constexpr, V_MODE: tl.constexpr):
    """V_MODE 0: nothing; 1: V's row absmax into vmax_ptr[0], a relaxed atomic; 2: the same, acq_rel (Triton's
    default); 3: stored per program at vmax_ptr[1 + t]."""
    if V_MODE > 0:
        cols = tl.arange(0, BLOCK_V)
        m = tl.max(tl.abs(tl.load(v_row + cols, mask=cols < width, other=0.0).to(tl.float32)), 0)
        if V_MODE == 1:
            tl.atomic_max(vmax_ptr, m, sem="relaxed")
        elif V_MODE == 2:
            tl.atomic_max(vmax_ptr, m)
        else:
            tl.store(vmax_ptr + 1 + t, m)


@triton.jit
def _one_split(src, w_ptr, scale, dst, offs, mask, pairs, f00, f01, f10, f11, eps, HEAD_DIM: tl.constexpr):
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
def split_kernel(x_ptr, wq_ptr, wk_ptr, pe_ptr, s_ptr, q_ptr, k_ptr, vmax_ptr, x_sb, x_st, pe_sb, pe_st,
                 o_sb, o_st, tok_off, heads, eps, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                 BLOCK_V: tl.constexpr, V_MODE: tl.constexpr):
    """One program per token, all heads of Q and K as [heads, D/2, 2] tiles, pairs by tl.split/tl.join; V as
    _v_absmax's V_MODE."""
    t = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    pairs = tl.arange(0, HEAD_DIM // 2)
    offs = (tl.arange(0, BLOCK_H)[:, None, None] * HEAD_DIM + pairs[None, :, None] * 2
            + tl.arange(0, 2)[None, None, :])
    width = heads * HEAD_DIM
    mask = offs < width
    row = x_ptr + b * x_sb + t * x_st
    rot = pe_ptr + b * pe_sb + (t + tok_off) * pe_st + pairs * 4
    f00, f01 = tl.load(rot), tl.load(rot + 1)
    f10, f11 = tl.load(rot + 2), tl.load(rot + 3)
    out = b * o_sb + (t + tok_off) * o_st
    _one_split(row, wq_ptr, tl.load(s_ptr), q_ptr + out, offs, mask, pairs, f00, f01, f10, f11, eps, HEAD_DIM)
    _one_split(row + width, wk_ptr, tl.load(s_ptr + 1), k_ptr + out, offs, mask, pairs, f00, f01, f10, f11, eps,
               HEAD_DIM)
    _v_absmax(row + 2 * width, width, vmax_ptr, t, BLOCK_V, V_MODE)


@triton.jit
def _one_strided(src, w_ptr, scale, dst, offs2, mask2, pairs, f00, f01, f10, f11, eps, HEAD_DIM: tl.constexpr):
    """Even and odd elements loaded and stored apart (offs2: [heads, HEAD_DIM / 2], the even ones)."""
    xe = tl.load(src + offs2, mask=mask2, other=0.0)
    xo = tl.load(src + offs2 + 1, mask=mask2, other=0.0)
    ef, of = xe.to(tl.float32), xo.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(ef * ef + of * of, 1) / HEAD_DIM + eps)
    we = tl.load(w_ptr + pairs * 2).to(tl.float32)
    wo = tl.load(w_ptr + pairs * 2 + 1).to(tl.float32)
    ye = (ef * rstd[:, None] * we[None, :]).to(xe.dtype).to(tl.float32)
    yo = (of * rstd[:, None] * wo[None, :]).to(xe.dtype).to(tl.float32)
    oe = (f00[None, :] * ye + f01[None, :] * yo).to(xe.dtype).to(tl.float32) / scale
    oo = (f10[None, :] * ye + f11[None, :] * yo).to(xe.dtype).to(tl.float32) / scale
    tl.store(dst + offs2, tl.clamp(oe, -448.0, 448.0).to(dst.dtype.element_ty), mask=mask2)
    tl.store(dst + offs2 + 1, tl.clamp(oo, -448.0, 448.0).to(dst.dtype.element_ty), mask=mask2)


@triton.jit
def strided_kernel(x_ptr, wq_ptr, wk_ptr, pe_ptr, s_ptr, q_ptr, k_ptr, vmax_ptr, x_sb, x_st, pe_sb, pe_st,
                   o_sb, o_st, tok_off, heads, eps, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                   BLOCK_V: tl.constexpr, V_MODE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    pairs = tl.arange(0, HEAD_DIM // 2)
    offs2 = tl.arange(0, BLOCK_H)[:, None] * HEAD_DIM + pairs[None, :] * 2
    width = heads * HEAD_DIM
    mask2 = offs2 < width
    row = x_ptr + b * x_sb + t * x_st
    rot = pe_ptr + b * pe_sb + (t + tok_off) * pe_st + pairs * 4
    f00, f01 = tl.load(rot), tl.load(rot + 1)
    f10, f11 = tl.load(rot + 2), tl.load(rot + 3)
    out = b * o_sb + (t + tok_off) * o_st
    _one_strided(row, wq_ptr, tl.load(s_ptr), q_ptr + out, offs2, mask2, pairs, f00, f01, f10, f11, eps, HEAD_DIM)
    _one_strided(row + width, wk_ptr, tl.load(s_ptr + 1), k_ptr + out, offs2, mask2, pairs, f00, f01, f10, f11, eps,
                 HEAD_DIM)
    _v_absmax(row + 2 * width, width, vmax_ptr, t, BLOCK_V, V_MODE)


@triton.jit
def partner_kernel(x_ptr, wq_ptr, wk_ptr, pe_ptr, s_ptr, q_ptr, k_ptr, vmax_ptr, x_sb, x_st, pe_sb, pe_st,
                   o_sb, o_st, tok_off, heads, eps, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                   BLOCK_V: tl.constexpr, V_MODE: tl.constexpr):
    """[heads, HEAD_DIM] tiles as inductor lays them out: each element's RoPE partner (r ^ 1) loaded again (L1), the
    rotation's coefficients on itself and on its partner loaded per column."""
    t = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    cols = tl.arange(0, HEAD_DIM)
    offs = tl.arange(0, BLOCK_H)[:, None] * HEAD_DIM + cols[None, :]
    width = heads * HEAD_DIM
    mask = offs < width
    row = x_ptr + b * x_sb + t * x_st
    rot = pe_ptr + b * pe_sb + (t + tok_off) * pe_st + (cols // 2) * 4 + (cols % 2) * 2
    c_self = tl.load(rot + cols % 2)[None, :]
    c_partner = tl.load(rot + 1 - cols % 2)[None, :]
    out = b * o_sb + (t + tok_off) * o_st
    for which in tl.static_range(2):
        src = row + which * width
        w_ptr = wq_ptr if which == 0 else wk_ptr
        x = tl.load(src + offs, mask=mask, other=0.0)
        xp = tl.load(src + (offs ^ 1), mask=mask, other=0.0)
        xf, pf = x.to(tl.float32), xp.to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(xf * xf, 1) / HEAD_DIM + eps)[:, None]
        y = (xf * rstd * tl.load(w_ptr + cols).to(tl.float32)[None, :]).to(x.dtype).to(tl.float32)
        yp = (pf * rstd * tl.load(w_ptr + (cols ^ 1)).to(tl.float32)[None, :]).to(x.dtype).to(tl.float32)
        o = (c_self * y + c_partner * yp).to(x.dtype).to(tl.float32) / tl.load(s_ptr + which)
        dst = q_ptr if which == 0 else k_ptr
        tl.store(dst + out + offs, tl.clamp(o, -448.0, 448.0).to(dst.dtype.element_ty), mask=mask)
    _v_absmax(row + 2 * width, width, vmax_ptr, t, BLOCK_V, V_MODE)


@triton.jit
def grouped_kernel(x_ptr, wq_ptr, wk_ptr, pe_ptr, s_ptr, q_ptr, k_ptr, vmax_ptr, x_sb, x_st, pe_sb, pe_st,
                   o_sb, o_st, tok_off, heads, eps, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                   BLOCK_V: tl.constexpr, V_MODE: tl.constexpr):
    """Small programs, many resident per SM: grid (tokens, head groups of BLOCK_H, 3 x batch); the third axis picks
    Q, K (norm, RoPE, cast) or V (its absmax over the group). Tiles [BLOCK_H, HEAD_DIM], partners loaded again."""
    t = tl.program_id(0).to(tl.int64)
    grp = tl.program_id(1)
    which = tl.program_id(2) % 3
    b = (tl.program_id(2) // 3).to(tl.int64)
    cols = tl.arange(0, HEAD_DIM)
    hs = grp * BLOCK_H + tl.arange(0, BLOCK_H)
    offs = hs[:, None] * HEAD_DIM + cols[None, :]
    mask = (hs < heads)[:, None]
    src = x_ptr + b * x_sb + t * x_st + which * heads * HEAD_DIM
    x = tl.load(src + offs, mask=mask, other=0.0)
    if which == 2:
        tl.atomic_max(vmax_ptr, tl.max(tl.max(tl.abs(x.to(tl.float32)), 1), 0), sem="relaxed")
    else:
        rot = pe_ptr + b * pe_sb + (t + tok_off) * pe_st + (cols // 2) * 4 + (cols % 2) * 2
        c_self = tl.load(rot + cols % 2)[None, :]
        c_partner = tl.load(rot + 1 - cols % 2)[None, :]
        if which == 0:
            w_ptr = wq_ptr
            dst = q_ptr
        else:
            w_ptr = wk_ptr
            dst = k_ptr
        xp = tl.load(src + (offs ^ 1), mask=mask, other=0.0)
        xf, pf = x.to(tl.float32), xp.to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(xf * xf, 1) / HEAD_DIM + eps)[:, None]
        y = (xf * rstd * tl.load(w_ptr + cols).to(tl.float32)[None, :]).to(x.dtype).to(tl.float32)
        yp = (pf * rstd * tl.load(w_ptr + (cols ^ 1)).to(tl.float32)[None, :]).to(x.dtype).to(tl.float32)
        o = (c_self * y + c_partner * yp).to(x.dtype).to(tl.float32) / tl.load(s_ptr + which)
        dst += b * o_sb + (t + tok_off) * o_st
        tl.store(dst + offs, tl.clamp(o, -448.0, 448.0).to(q_ptr.dtype.element_ty), mask=mask)
