"""Probe (GPU): a FLUX block's LayerNorm + modulation + row-wise FP8 quantization of the next Linear's input (single
block's pre_norm, double block's norm1/norm2, then apply_mod's addcmul, then torchao's dynamic row-wise FP8), at
FLUX.1-dev 1024²'s shapes: what inductor makes of the torch code against a hand-written one-pass Triton kernel (one
program per row, the row in registers), each replayed in a CUDA graph; warps swept; values compared.

Run on the device:  python3 bench/probes/ln_fp8.py [--out DIR]
Prints one JSON line per measurement ("PROBE {...}"), writes DIR/ln_fp8.json.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from bench.probes.replay import Record, graph_ms  # noqa: E402

EPS = 1e-6  # FLUX's LayerNorms


@triton.jit
def ln_mod_rowwise_fp8_kernel(x_ptr, mult_ptr, shift_ptr, q_ptr, s_ptr, n_cols, x_stride, q_stride, eps,
                              BLOCK: tl.constexpr):
    """LayerNorm (no affine; float32, rounded to the input's dtype), then addcmul(shift, y, mult) (rounded once), the
    row's absmax / 448 (rounded to the input's dtype) as its scale, the row divided by it, clamped, cast."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    mean = tl.sum(xf, 0) / n_cols
    d = tl.where(mask, xf - mean, 0.0)
    rstd = tl.math.rsqrt(tl.sum(d * d, 0) / n_cols + eps)
    y = (d * rstd).to(x.dtype).to(tl.float32)
    m = tl.load(mult_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(shift_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    h = tl.where(mask, (y * m + s).to(x.dtype).to(tl.float32), 0.0)
    scale = tl.math.div_rn(tl.max(tl.abs(h), 0), 448.0).to(x.dtype).to(tl.float32)
    tl.store(q_ptr + row * q_stride + cols, tl.clamp(h / scale, -448.0, 448.0).to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, scale)


def torch_path(x, mult, shift):
    """What the compiled block computes before the Linear: ComfyUI's LayerNorm and apply_mod, torchao's row-wise
    FP8 (act_quant.rowwise's numbers)."""
    h = torch.addcmul(shift, F.layer_norm(x, (x.shape[-1],), eps=EPS), mult)
    scale = (h.abs().amax(-1, keepdim=True) / 448.0).float()
    return (h.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn), scale


def kernel_path(x, mult, shift, warps):
    q = torch.empty(x.shape, device=x.device, dtype=torch.float8_e4m3fn)
    s = torch.empty((x.shape[0], 1), device=x.device, dtype=torch.float32)
    ln_mod_rowwise_fp8_kernel[(x.shape[0],)](x, mult, shift, q, s, x.shape[1], x.stride(0), q.stride(0), EPS,
                                             BLOCK=triton.next_power_of_2(x.shape[1]), num_warps=warps)
    return q, s


def main():
    rec = Record("ln_fp8.json")
    g = torch.Generator(device="cuda").manual_seed(0)
    mult = (1 + 0.3 * torch.randn(3072, device="cuda", generator=g)).to(torch.bfloat16)
    shift = (0.3 * torch.randn(3072, device="cuda", generator=g)).to(torch.bfloat16)
    compiled = torch.compile(torch_path, dynamic=False, options={"emulate_precision_casts": True})
    with torch.inference_mode():
        for rows, per_step in ((4608, 38), (4096, 38), (512, 38)):  # single pre_norm; double img / txt norm1 + norm2
            x = (torch.randn(rows, 3072, device="cuda", generator=g) * 2 + 0.5).to(torch.bfloat16)
            moved = rows * 3072 * 3
            ref = torch_path(x, mult, shift)
            ind = compiled(x, mult, shift)
            ms = graph_ms(lambda: compiled(x, mult, shift), ())
            rec.emit(rows=rows, path="inductor", ms=round(ms, 4), tb_s=round(moved / ms / 1e9, 2),
                 per_step_ms=round(per_step * ms, 3), fp8_differ_vs_eager=float((ind[0].float() != ref[0].float())
                                                                              .float().mean()))
            for warps in (4, 8, 16):
                q, s = kernel_path(x, mult, shift, warps)
                ms = graph_ms(lambda w=warps: kernel_path(x, mult, shift, w), ())
                rec.emit(rows=rows, path=f"kernel, {warps} warps", ms=round(ms, 4), tb_s=round(moved / ms / 1e9, 2),
                     per_step_ms=round(per_step * ms, 3),
                     fp8_differ_vs_eager=float((q.float() != ref[0].float()).float().mean()),
                     scales_max_rel=float(((s - ref[1]) / ref[1]).abs().max()))


if __name__ == "__main__":
    main()
