"""Fidelity measures of an output against a reference, computed in float64."""
from __future__ import annotations

import math

import torch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| (Frobenius), in float64."""
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-300))


def sqnr_db(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB, 20 log10(||ref|| / ||out - ref||), by torchao's compute_error (the
    measure torchao reports its own quantization by; in float64 here); inf when equal. Without torchao (a bf16-only
    Benchmark), the same formula from rel_err."""
    e = rel_err(out, ref)
    if e == 0:
        return math.inf
    try:
        from torchao.quantization.utils import compute_error
    except ImportError:
        return -20.0 * math.log10(e)
    return float(compute_error(ref.detach().double().cpu(), out.detach().double().cpu()))
