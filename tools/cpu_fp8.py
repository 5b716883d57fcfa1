"""Tests and tools only: FP8 on the CPU through torchao's real Float8Tensor path.

torchao refuses FP8 off-GPU by one capability gate (`_check_hardware_support`, asked by `quantize_` and by
FluxAccel's device check, core/env.py). Lifting that gate is all it takes: Float8Tensor, torch._scaled_mm's CPU
kernel and F.linear's dispatch are torchao's and torch's own code. The plugin never lifts it; these do, in
processes that exist to test or demo it: pytest (the `cpu_fp8` fixture), the CPU runs of tools/bench.py and
tools/reliability.py (their ComfyUI server loads cpu_fp8_node/, see ComfyServer(cpu_fp8=True)), probes.
"""
from __future__ import annotations

import logging

log = logging.getLogger("fluxaccel.tools")

GATES = ("torchao.quantization.quant_api", "torchao.float8.inference")


def _open(granularities) -> None:
    return None


def lift_torchao_gate(monkeypatch=None) -> None:
    """Let torchao quantize to FP8 on the CPU in this process (with pytest's monkeypatch: for one test only)."""
    import importlib

    for name in GATES:
        mod = importlib.import_module(name)
        if monkeypatch is not None:
            monkeypatch.setattr(mod, "_check_hardware_support", _open)
        else:
            mod._check_hardware_support = _open
    log.info("FluxAccel tools: torchao's FP8 hardware gate lifted in this process (CPU FP8 for tests and demos)")
