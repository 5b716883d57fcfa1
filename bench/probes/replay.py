"""What the GPU probes of single kernels share: device time per call replayed in a CUDA graph (no launch overhead),
and a record of PROBE lines kept as one JSON file in the output folder."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def graph_ms(fn, args=(), replays=200) -> float:
    """Device time per call of fn(*args) captured in a CUDA graph (median of 5 runs of `replays` replays)."""
    for _ in range(3):
        fn(*args)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn(*args)
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(replays):
            g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / replays)
    return sorted(times)[2]


class Record:
    """The probe's measurements: each printed as a PROBE line and the whole list rewritten to out/name after each."""

    def __init__(self, name: str, argv=None):
        ap = argparse.ArgumentParser()
        ap.add_argument("--out", default=".")
        self.out = Path(ap.parse_args(argv).out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.path, self.results = self.out / name, []

    def emit(self, **kw) -> None:
        self.results.append(kw)
        print("PROBE", json.dumps(kw), flush=True)
        self.path.write_text(json.dumps(self.results, indent=1))
