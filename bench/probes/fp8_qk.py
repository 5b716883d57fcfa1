"""Probe (GPU): FP8 attention's Q/K norm, RoPE and casts at FLUX.1-dev's single-block shape (1024², 512 text
tokens: 4608 tokens, 24 heads of 128): hand-written Triton kernels (fp8_qk_variants.py) against what inductor makes
of the torch code FluxAccel's compiled single block runs, each captured in a CUDA graph and replayed (device time, no
launch overhead), with FlashAttention-3's FP8 forward after it; the values compared with eager torch.
Outcome (bench/NOTES.md, 2026-12-04): the best variant ~94 µs with V's cast against inductor's 100 µs; not kept.

Run on the device:  python3 bench/probes/fp8_qk.py [--out DIR]   (the fa3-fwd wheel importable for the attention rows)
Prints one JSON line per measurement ("PROBE {...}"), writes DIR/fp8_qk.json.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tools.plugin import register  # noqa: E402  (the plugin as the package fluxaccel)
register()
from bench.probes.replay import Record, graph_ms  # noqa: E402
from fluxaccel.core.compile import fp8_attention as fa  # noqa: E402

REC: Record | None = None  # main()'s record of measurements
N_TXT, N_IMG, HEADS, D, MLP = 512, 4096, 24, 128, 12288


def emit(kind: str, **kw):
    REC.emit(kind=kind, **kw)


def inputs():
    """linear1's output of a single block (QKV and MLP stream side by side; QKV is a strided slice of it), QK-norm
    weights, FLUX.1's rotations for 512 text + 64 x 64 image tokens, the QK-norm bound's scales."""
    from comfy.ldm.flux.layers import EmbedND

    g = torch.Generator(device="cuda").manual_seed(0)
    n, hidden = N_TXT + N_IMG, HEADS * D
    lin1 = (torch.randn(1, n, 3 * hidden + MLP, device="cuda", generator=g) * 2).to(torch.bfloat16)
    wq, wk = ((torch.rand(D, device="cuda", generator=g) * 0.8 + 0.6).to(torch.bfloat16) for _ in range(2))
    ids = torch.zeros(1, n, 3, device="cuda")
    ids[0, N_TXT:, 1] = torch.arange(N_IMG, device="cuda") // 64
    ids[0, N_TXT:, 2] = torch.arange(N_IMG, device="cuda") % 64
    pe = EmbedND(dim=D, theta=10000, axes_dim=[16, 56, 56])(ids)
    bound = torch.stack([wq.abs().amax(), wk.abs().amax()]).float() * (D ** 0.5 * fa.MARGIN / fa.FP8_MAX)
    return lin1[..., :3 * hidden], wq, wk, pe, bound


def rope(x, pe):
    """ComfyUI's RoPE formula (comfy.ldm.flux.math._apply_rope1)."""
    x_ = x.to(pe.dtype).reshape(*x.shape[:-1], -1, 1, 2)
    return (pe[..., 0] * x_[..., 0] + pe[..., 1] * x_[..., 1]).reshape(*x.shape).type_as(x)


def unfused(qkv, wq, wk, pe, scales):
    """What FluxAccel's compiled single block computes: ComfyUI's QK-norm (torch's rms_norm, eps None: float32's)
    and RoPE, then fp8_attention's casts (inductor fuses them as it can)."""
    b, n, _ = qkv.shape
    q, k, v = qkv.view(b, n, 3, HEADS, D).permute(2, 0, 3, 1, 4)
    eps = torch.finfo(torch.float32).eps
    q = rope(F.rms_norm(q, (D,), wq, eps), pe)
    k = rope(F.rms_norm(k, (D,), wk, eps), pe)
    vs = fa._absmax_scale(v)
    return fa._fp8(q, scales[0]), fa._fp8(k, scales[1]), fa._fp8(v, vs), vs


def grouped(qkv, wq, wk, pe, scales, hb=8, warps=2):
    """The best variant (groups of 8 heads of Q, K or V per program), then V's cast: Q, K in (batch, tokens, heads,
    head_dim)."""
    import triton

    from bench.probes import fp8_qk_variants as kv

    b, n, _ = qkv.shape
    q = torch.empty((b, n, HEADS, D), device=qkv.device, dtype=torch.float8_e4m3fn)
    k, vmax = torch.empty_like(q), torch.zeros(1, device=qkv.device)
    kv.grouped_kernel[(n, triton.cdiv(HEADS, hb), 3 * b)](
        qkv, wq, wk, pe, scales, q, k, vmax, qkv.stride(0), qkv.stride(1), 0, pe.stride(2), q.stride(0),
        q.stride(1), 0, HEADS, torch.finfo(torch.float32).eps, HEAD_DIM=D, BLOCK_H=hb, BLOCK_V=4096, V_MODE=1,
        num_warps=warps)
    vs = (vmax[0] / fa.FP8_MAX).clamp(min=1e-12)
    v8 = (qkv[..., 2 * HEADS * D:].reshape(b, n, HEADS, D).float() / vs).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, k, v8, vs


def with_attention(make):
    def run(qkv, wq, wk, pe, scales):
        q8, k8, v8, vs = make(qkv, wq, wk, pe, scales)
        desc = [s.reshape(1, 1).expand(1, HEADS) for s in (scales[0], scales[1], vs)]
        return torch.ops.fa3_fwd._flash_attn_forward(q8, k8, v8, q_descale=desc[0], k_descale=desc[1],
                                                     v_descale=desc[2], softmax_scale=D ** -0.5)[0]
    return run


def compared(name, got, want):
    """FP8 tensors of the same layout: the share of values that differ and the largest difference in e4m3 steps."""
    g, w = got.float(), want.float()
    diff = g != w
    step = (w.abs().clamp(min=2 ** -6) * 2 ** -3)  # one e4m3 step at the value's size (normal range)
    emit("values", name=name, differ=float(diff.float().mean()), max_steps=float(((g - w).abs() / step).max()))


def variants_of_the_kernel(args):
    """Which shape of program pays: one per token holding all heads ([heads, 128] tiles, partners loaded again) or
    small ones (a group of heads of Q, K or V); warps swept; registers, spills and shared memory per program."""
    import triton

    from bench.probes import fp8_qk_variants as kv

    qkv, wq, wk, pe, scales = args
    b, n, _ = qkv.shape
    moved = qkv.numel() // 3 * 6
    q = torch.empty((b, n, HEADS, D), device="cuda", dtype=torch.float8_e4m3fn)
    k, vmax = torch.empty_like(q), torch.zeros(n + 1, device="cuda")
    cases = [("partner", kv.partner_kernel, 1, 32, w) for w in (4, 8)]
    cases += [(f"grouped {hb} heads", kv.grouped_kernel, 1, hb, w) for hb in (2, 4, 8) for w in (1, 2, 4)]
    for kname, kernel, v_mode, hb, warps in cases:
            if True:
                handle = []
                grid = (n, b) if kname == "partner" else (n, triton.cdiv(HEADS, hb), 3 * b)

                def launch():
                    handle.append(kernel[grid](
                        qkv, wq, wk, pe, scales, q, k, vmax, qkv.stride(0), qkv.stride(1), 0, pe.stride(2),
                        q.stride(0), q.stride(1), 0, HEADS, 1e-6, HEAD_DIM=D, BLOCK_H=hb,
                        BLOCK_V=4096, V_MODE=v_mode, num_warps=warps))
                try:
                    ms = graph_ms(launch, ())
                    h = handle[0]
                    emit("time", name=f"variant {kname}, v_mode {v_mode}, {warps} warps", ms=round(ms, 4),
                         qk_tb_s=round(moved / ms / 1e9, 2), regs=getattr(h, "n_regs", None),
                         spills=getattr(h, "n_spills", None),
                         shared=getattr(getattr(h, "metadata", None), "shared", None))
                except Exception as e:  # noqa: BLE001
                    emit("time", name=f"variant {kname}, v_mode {v_mode}, {warps} warps",
                         error=f"{type(e).__name__}: {e}"[:300])


def main():
    global REC
    REC = Record("fp8_qk.json")
    args = inputs()
    qkv = args[0]
    moved = qkv.numel() // 3 * 2 * 2 + qkv.numel() // 3 * 2 * 1  # Q, K read (bf16) and written (e4m3)
    opts = {"emulate_precision_casts": True}
    with torch.inference_mode():
        ref = [t.contiguous() for t in unfused(*args)[:2]]  # eager torch, FluxAccel's path uncompiled
        inductor = torch.compile(unfused, dynamic=False, options=opts)
        outs = {"inductor": inductor(*args), "grouped": grouped(*args)}
        for name, out in outs.items():
            compared(f"{name} q vs eager torch", out[0].contiguous(), ref[0])
            compared(f"{name} k vs eager torch", out[1].contiguous(), ref[1])
        compared("grouped v vs inductor v", outs["grouped"][2], outs["inductor"][2].contiguous())
        for name, fn in (("inductor", inductor), ("grouped", grouped)):
            ms = graph_ms(fn, args)
            emit("time", name=f"{name}: q, k, v to FP8", ms=round(ms, 4), per_step_ms=round(38 * ms, 3),
                 qk_tb_s=round(moved / ms / 1e9, 2))
        variants_of_the_kernel(args)
        try:
            import fa3_fwd_interface  # noqa: F401  (registers torch.ops.fa3_fwd)
        except Exception as e:  # noqa: BLE001
            emit("time", name="with attention", error=f"{type(e).__name__}: {e}"[:300])
        else:
            for name, make in (("inductor", inductor), ("grouped", grouped)):
                ms = graph_ms(with_attention(make), args)
                emit("time", name=f"{name} + FlashAttention-3 FP8", ms=round(ms, 4), per_step_ms=round(38 * ms, 3))
    print("TABLE", json.dumps([r for r in REC.results if r["kind"] == "time"]))


if __name__ == "__main__":
    main()
