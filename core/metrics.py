"""Fidelity measures of an output against a reference, computed in float64."""
from __future__ import annotations

import math

import torch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| (Frobenius), in float64."""
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-300))


def sqnr_db(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: 20 log10(||ref|| / ||out - ref||); inf when equal."""
    e = rel_err(out, ref)
    return math.inf if e == 0 else -20.0 * math.log10(e)
