"""Probe (GPU): the floor of a FLUX.1-dev 1024² step (512 text tokens) under FluxAccel's fastest recipe, at the clock
the card holds while sampling. One step's work is captured in a CUDA graph and replayed 28 times per "prompt", as the
sampler runs it, in three variants:
- gemms: the step's 228 FP8 GEMMs (cuBLAS row-wise torch._scaled_mm, bf16 out with bias, the model's shapes, each
  block its own FP8 weights: 8.6 GB, as the model's);
- + attention: the step's 57 FlashAttention-3 FP8 calls (4608 tokens, 24 heads of 128);
- + row bytes: the bytes the step's norm / modulation / RoPE / activation / quantization / residual kernels read and
  write (~30 GB, counted from their tensors), moved by plain casts, adds and one absmax each: what those kernels
  would cost at a simple kernel's memory rate.
While each runs, nvidia-smi samples the SM clock and the board power every 100 ms. The model's own step (its kernel
profile, torch.profiler) compares with these: what the GEMMs and attention alone take at the power limit, and what
is left for the rest.

Run on the device:  python3 bench/probes/step_floor.py [--out DIR]   (the fa3-fwd wheel importable for attention)
schnell 512², 4 steps:  ... --image-tokens 1024 --text-tokens 256 --steps 4 --gap-ms 20   (each "prompt" after a
host gap with the GPU idle, as ComfyUI's work before the first model call leaves it)
Prints one JSON line per measurement ("PROBE {...}"), writes DIR/step_floor[-IMGxTXTxSTEPS].json.
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from bench.probes.replay import Record  # noqa: E402

HEADS, D, HIDDEN, MLP = 24, 128, 3072, 12288
TXT, IMG, STEPS, GAP_S, PROMPTS = 512, 4096, 28, 0.0, 6  # main() sets them from its arguments
TOKENS = TXT + IMG
F8 = torch.float8_e4m3fn
# (rows, in, out) of a double block's four Linears per stream, and of a single block's two
DOUBLE = [(HIDDEN, 3 * HIDDEN), (HIDDEN, HIDDEN), (HIDDEN, MLP), (MLP, HIDDEN)]
SINGLE = [(HIDDEN, 3 * HIDDEN + MLP), (HIDDEN + MLP, HIDDEN)]


class Gemm:
    """One FP8 Linear of the model: its weight (out, in) row-major, row-wise scales, bf16 bias."""

    def __init__(self, k: int, n: int, g: torch.Generator):
        self.w = (torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) * 0.5).to(F8)
        self.scale = torch.full((1, n), 1e-2, device="cuda")
        self.bias = torch.zeros(n, device="cuda", dtype=torch.bfloat16)

    def __call__(self, a: torch.Tensor, a_scale: torch.Tensor) -> torch.Tensor:
        return torch._scaled_mm(a, self.w.t(), scale_a=a_scale, scale_b=self.scale, bias=self.bias,
                                out_dtype=torch.bfloat16, use_fast_accum=True)


class Step:
    """One step's GEMMs, attention calls and row traffic on fixed inputs."""

    def __init__(self, attention: bool, rows: bool):
        g = torch.Generator(device="cuda").manual_seed(0)
        self.attention, self.rows = attention, rows
        self.double = [[[Gemm(k, n, g) for k, n in DOUBLE] for _ in range(2)] for _ in range(19)]
        self.single = [[Gemm(k, n, g) for k, n in SINGLE] for _ in range(38)]
        self.a = {(m, k): (torch.randn(m, k, device="cuda", generator=g).to(F8),
                           torch.full((m, 1), 1e-2, device="cuda"))
                  for m in (IMG, TXT, TOKENS) for k in (HIDDEN, MLP, HIDDEN + MLP)}
        self.q = torch.randn(1, TOKENS, HEADS, D, device="cuda", generator=g).to(F8)
        self.descale = torch.ones(1, HEADS, device="cuda")
        bf = lambda *s: torch.randn(*s, device="cuda", generator=g, dtype=torch.bfloat16)  # noqa: E731
        self.x, self.y = bf(TOKENS, HIDDEN), bf(TOKENS, HIDDEN)
        self.qkv, self.pair, self.mlp = bf(TOKENS, 3 * HIDDEN), bf(TOKENS, HIDDEN + MLP), bf(TOKENS, MLP)

    def attend(self):
        if self.attention:
            from fluxaccel.core.upstream import fa3_internals
            fa3_internals.fp8_forward(self.q, self.q, self.q, self.descale, self.descale, self.descale, D ** -0.5)

    def move(self, *what: str):
        """The row kernels' bytes: 'norm' (a LayerNorm + modulation + FP8 of the hidden state), 'qkv' (QK-norm, RoPE
        and FP8 of Q, K, V, V's absmax), 'out' (attention output to FP8), 'gelu' / 'pair' (GELU + FP8 of the MLP
        stream, alone or beside the attention output), 'residual' (x + gate * y)."""
        if not self.rows:
            return
        for w in what:
            if w == "norm":
                self.x.to(F8)
            elif w == "qkv":
                self.qkv.to(F8)
                self.qkv[:, 2 * HIDDEN:].amax()
            elif w == "out":
                self.y.to(F8)
            elif w in ("gelu", "pair"):
                (self.mlp if w == "gelu" else self.pair).to(F8)
            elif w == "residual":
                torch.add(self.x, self.y)

    def __call__(self):
        for streams in self.double:
            self.move("norm", "qkv")
            for (qkv, *_), m in zip(streams, (IMG, TXT)):
                qkv(*self.a[(m, HIDDEN)])
            self.attend()
            self.move("out", "residual", "norm")
            for (_, proj, mlp0, _), m in zip(streams, (IMG, TXT)):
                proj(*self.a[(m, HIDDEN)])
                mlp0(*self.a[(m, HIDDEN)])
            self.move("gelu", "residual")
            for (*_, mlp2), m in zip(streams, (IMG, TXT)):
                mlp2(*self.a[(m, MLP)])
        for lin1, lin2 in self.single:
            self.move("norm")
            lin1(*self.a[(TOKENS, HIDDEN)])
            self.move("qkv")
            self.attend()
            self.move("pair")
            lin2(*self.a[(TOKENS, HIDDEN + MLP)])
            self.move("residual")


class Sampler:
    """nvidia-smi's SM clock and board power every 100 ms, in the background; window() gives a span's medians."""

    def __init__(self):
        self.proc = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw", "--format=csv,noheader,nounits",
             "-lms", "100"], stdout=subprocess.PIPE, text=True)

    def stop(self) -> list[tuple[datetime.datetime, float, float]]:
        self.proc.terminate()
        out = []
        for line in self.proc.stdout.read().splitlines():
            try:
                ts, clock, power = (p.strip() for p in line.split(","))
                out.append((datetime.datetime.strptime(ts, "%Y/%m/%d %H:%M:%S.%f"), float(clock), float(power)))
            except ValueError:
                continue
        return out


def window(samples, start, end) -> dict:
    inside = [(c, p) for t, c, p in samples if start <= t <= end]
    if not inside:
        return {"samples": 0}
    return {"samples": len(inside), "sm_clock_mhz_median": statistics.median(c for c, _ in inside),
            "power_w_median": statistics.median(p for _, p in inside), "power_w_max": max(p for _, p in inside)}


def run(step: Step) -> tuple[list[float], float, datetime.datetime, datetime.datetime]:
    """Per-prompt ms of STEPS replays each (PROMPTS prompts, each after a sync and GAP_S idle), one replay after 3 s
    idle (the boost clock), and the timed span's start and end."""
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    time.sleep(3)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    graph.replay()
    b.record()
    torch.cuda.synchronize()
    burst = a.elapsed_time(b)
    for _ in range(STEPS * 2):  # reach the sustained clock before the timed prompts
        graph.replay()
    torch.cuda.synchronize()
    start, prompts = datetime.datetime.now(), []
    for _ in range(PROMPTS):
        time.sleep(GAP_S)
        a.record()
        for _ in range(STEPS):
            graph.replay()
        b.record()
        torch.cuda.synchronize()
        prompts.append(a.elapsed_time(b))
    return prompts, burst, start, datetime.datetime.now()


def main():
    global TXT, IMG, TOKENS, STEPS, GAP_S, PROMPTS
    ap = argparse.ArgumentParser()
    ap.add_argument("--image-tokens", type=int, default=IMG)
    ap.add_argument("--text-tokens", type=int, default=TXT)
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--gap-ms", type=float, default=0.0)
    a, rest = ap.parse_known_args()
    IMG, TXT, STEPS, GAP_S = a.image_tokens, a.text_tokens, a.steps, a.gap_ms / 1e3
    TOKENS, PROMPTS = IMG + TXT, max(6, 168 // STEPS)
    default = (IMG, TXT, STEPS) == (4096, 512, 28)
    rec = Record("step_floor.json" if default else f"step_floor-{IMG}x{TXT}x{STEPS}.json", rest)
    attention = True
    try:
        from tools.plugin import register
        register()
        import fa3_fwd_interface  # noqa: F401  (registers FlashAttention-3's operator)
    except Exception as e:  # noqa: BLE001
        attention = False
        rec.emit(kind="note", text=f"no FlashAttention-3: {type(e).__name__}: {e}"[:300])
    sampler, spans = Sampler(), []
    variants = [("gemms", False, False)] + ([("gemms + attention", True, False),
                                            ("gemms + attention + row bytes", True, True)] if attention else [])
    with torch.inference_mode():
        for name, attend, rows in variants:
            step = Step(attend, rows)
            prompts, burst, start, end = run(step)
            spans.append((name, prompts, burst, start, end))
            del step
            torch.cuda.empty_cache()
    samples = sampler.stop()
    for name, prompts, burst, start, end in spans:
        ms = statistics.median(prompts)
        rec.emit(kind="step", variant=name, image_tokens=IMG, text_tokens=TXT, steps=STEPS, gap_ms=1e3 * GAP_S,
                 prompt_ms_median=round(ms, 1), step_ms=round(ms / STEPS, 2),
                 prompts_ms=[round(p, 1) for p in prompts], step_ms_after_idle=round(burst, 2),
                 **window(samples, start, end))


if __name__ == "__main__":
    main()
