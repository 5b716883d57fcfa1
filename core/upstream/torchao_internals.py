"""torchao internals FluxAccel reaches (see the package docstring): its FP8 hardware gate, the kernel preference of
its dynamic-FP8 config, and the float8 primitives its torch-kernel path calls (which the 'plain' FP8 layout replays
on plain tensors, core/quant/fp8.py)."""
from __future__ import annotations

import importlib
import importlib.metadata as md
from types import SimpleNamespace

from . import Unavailable

UPSTREAM = "torchao"


def torchao_version() -> str:
    try:
        return md.version("torchao")
    except md.PackageNotFoundError:
        return "(not installed)"


def _missing(name: str, detail: str = "") -> Unavailable:
    return Unavailable(UPSTREAM, torchao_version(), name, detail)


def _get(module: str, name: str):
    try:
        mod = importlib.import_module(module)
    except ImportError:
        return _missing(f"{module}.{name}")
    value = getattr(mod, name, None)
    return value if value is not None else _missing(f"{module}.{name}")


def fp8_gate_open() -> bool | Unavailable:
    """Whether torchao's own hardware gate (what its quantize_ asks before dynamic FP8) accepts this process."""
    check = _get("torchao.quantization.quant_api", "_check_hardware_support")
    per_tensor = _get("torchao.quantization.granularity", "PerTensor")
    if isinstance(check, Unavailable) or isinstance(per_tensor, Unavailable):
        return check if isinstance(check, Unavailable) else per_tensor
    try:
        check((per_tensor(), per_tensor()))
        return True
    except AssertionError:
        return False


def torch_kernel_preference():
    """torchao's KernelPreference.TORCH (the torch._scaled_mm path), or an Unavailable where torchao has no choice
    of kernel (it then has only that path) or keeps the enum elsewhere."""
    kp = _get("torchao.quantization.quantize_.common", "KernelPreference")
    return kp if isinstance(kp, Unavailable) else kp.TORCH


def float8_primitives() -> SimpleNamespace | Unavailable:
    """The functions torchao's Float8Tensor linear calls on its torch-kernel path, in its order: block size, activation
    scale, activation quantization, data/scale layout for the GEMM, the scaled GEMM."""
    names = {
        "get_block_size": ("torchao.quantization.utils", "get_block_size"),
        "choose_scale": ("torchao.quantization.quant_primitives", "_choose_scale_float8"),
        "quantize": ("torchao.quantization.quant_primitives", "_quantize_affine_float8"),
        "preprocess_data": ("torchao.float8.inference", "preprocess_data"),
        "preprocess_scale": ("torchao.float8.inference", "preprocess_scale"),
        "addmm": ("torchao.float8.inference", "addmm_float8_unwrapped_inference"),
    }
    found = {}
    for key, (module, name) in names.items():
        value = _get(module, name)
        if isinstance(value, Unavailable):
            return value
        found[key] = value
    return SimpleNamespace(**found)
