"""Probe (GPU): FluxAccel's GELU + row-wise FP8 kernels (core/quant/act_quant.py) at FLUX.1-dev 1024²'s shapes, device
time per call replayed in a CUDA graph, for each warps-per-row-program count: the single block's pair kernel (4608
rows of 3072 attention + 12,288 MLP columns) and the double block's one-input kernel (4096 image rows and 512 text
rows of 12,288). FluxAccel's rule (act_quant.num_warps) is one of the rows.

Run on the device:  python3 bench/probes/gelu_fp8.py [--out DIR]
Prints one JSON line per measurement ("PROBE {...}"), writes DIR/gelu_fp8.json.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tools.plugin import register  # noqa: E402  (the plugin as the package fluxaccel)
register()
from bench.probes.replay import Record, graph_ms  # noqa: E402
from fluxaccel.core.quant import act_quant  # noqa: E402

def main():
    rec = Record("gelu_fp8.json")
    g = torch.Generator(device="cuda").manual_seed(0)
    lin1 = torch.randn(4608, 3 * 3072 + 12288, device="cuda", generator=g).to(torch.bfloat16)
    attn = torch.randn(4608, 3072, device="cuda", generator=g).to(torch.bfloat16)
    mlp = lin1[:, 3 * 3072:]  # the single block's MLP stream: a strided view of linear1's output
    img = torch.randn(4096, 12288, device="cuda", generator=g).to(torch.bfloat16)
    txt = torch.randn(512, 12288, device="cuda", generator=g).to(torch.bfloat16)
    cases = {
        "single pair 4608 x (3072 + 12288)": (lambda: act_quant.gelu_pair_rowwise_fp8(attn, mlp), 4608 * 15360 * 3,
                                              38),
        "double image 4096 x 12288": (lambda: act_quant.gelu_rowwise_fp8(img), 4096 * 12288 * 3, 19),
        "double text 512 x 12288": (lambda: act_quant.gelu_rowwise_fp8(txt), 512 * 12288 * 3, 19),
    }
    rule = act_quant.num_warps
    with torch.inference_mode():
        ref = {name: fn() for name, (fn, _, _) in cases.items()}
        for warps in (None, 4, 8, 16, 32):
            act_quant.num_warps = rule if warps is None else (lambda block, w=warps: w)
            for name, (fn, moved, per_step) in cases.items():
                q, s = fn()
                same = bool(torch.equal(q.float(), ref[name][0].float()) and torch.equal(s, ref[name][1]))
                ms = graph_ms(fn, ())
                rec.emit(case=name, warps=warps or f"rule ({rule(16384)})", ms=round(ms, 4),
                     tb_s=round(moved / ms / 1e9, 2), per_step_ms=round(per_step * ms, 3), same_values=same)
    act_quant.num_warps = rule


if __name__ == "__main__":
    main()
