"""What this process can do: torchao presence/version and GPU capability.

Nothing here runs at import time of the plugin: each check is called when a node is used,
so a missing torchao or an old GPU gives a clear error on use and never breaks ComfyUI startup.
"""
from __future__ import annotations

import importlib
import importlib.metadata as md
import subprocess
import sys

import torch
from torch.torch_version import TorchVersion

from .errors import FluxAccelError
from .upstream import say, torchao_internals
from .upstream.comfy_internals import comfyui_version

# torch.compiler.save_cache_artifacts (persistent compile cache) and the Float8Tensor dispatch torchao 0.17+
# relies on need torch 2.8.
TORCH_MIN = (2, 8)
TORCHAO_MIN = (0, 17)
TORCHAO_MAX_EXCLUSIVE = (0, 19)
FP8_MIN_CAPABILITY = (8, 9)  # Ada (sm_89), Hopper (sm_90), Blackwell: hardware FP8 GEMMs


def _version(v: str):
    """A version string that compares with tuples by PEP 440 (torch's own TorchVersion: '2.11.0+cu128' >= (2, 8))."""

    return TorchVersion(v)


def require_torch(node: str) -> None:
    """Refuse a PyTorch older than TORCH_MIN with what to install (checked on use, never at import)."""
    if _version(str(torch.__version__)) < TORCH_MIN:
        want = ".".join(map(str, TORCH_MIN))
        raise FluxAccelError(
            f"{node} needs PyTorch {want} or newer; this ComfyUI runs torch {torch.__version__}. Update the PyTorch "
            f"of ComfyUI's Python (python -m pip install -U 'torch>={want}' with the index URL of your CUDA "
            f"version), then restart ComfyUI.")


def require_torchao():
    """Import torchao, or raise an error that says which version to install."""
    want = f">={'.'.join(map(str, TORCHAO_MIN))},<{'.'.join(map(str, TORCHAO_MAX_EXCLUSIVE))}"
    try:
        torchao = importlib.import_module("torchao")
    except ImportError as e:
        raise FluxAccelError(
            f"FluxAccel FP8 needs torchao{want}, which is not installed ({e}). "
            f"Install it into ComfyUI's Python: python -m pip install 'torchao{want}', then restart ComfyUI."
        ) from e
    try:
        version = md.version("torchao")
    except md.PackageNotFoundError:
        version = getattr(torchao, "__version__", "0")
    vt = _version(version)
    if not (vt >= TORCHAO_MIN and vt < TORCHAO_MAX_EXCLUSIVE):
        raise FluxAccelError(
            f"FluxAccel FP8 needs torchao{want}; this ComfyUI has torchao {version}. "
            f"Run: python -m pip install 'torchao{want}' and restart ComfyUI."
        )
    return torchao


def torchao_fp8_here() -> bool:
    """Whether torchao's own hardware gate (asked by its quantize_) accepts dynamic FP8 in this process. False on a
    CPU-only machine; tests and tools lift the gate for CPU runs (tools/cpu_fp8.py), the plugin never does."""

    gate = torchao_internals.fp8_gate_open()
    if gate is True or gate is False:
        return gate
    say(gate, "cannot ask torchao whether this device runs dynamic FP8: FP8 is refused off the GPU")
    return False


def require_fp8_device(device: torch.device) -> None:
    """Refuse devices without hardware FP8 GEMMs, with the reason and the way out."""
    device = torch.device(device)
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if tuple(cap) < FP8_MIN_CAPABILITY:
            name = torch.cuda.get_device_name(device)
            raise FluxAccelError(
                f"FP8 quantization needs an NVIDIA GPU of compute capability 8.9 or newer "
                f"(RTX 40xx/Ada, H100/H200, Blackwell); {name} is sm_{cap[0]}{cap[1]}. "
                f"Remove the Quantize FP8 node on this GPU (Compile + CUDA Graph still works in bf16)."
            )
        return
    if device.type == "cpu" and torchao_fp8_here():
        return
    raise FluxAccelError(
        f"FP8 quantization runs on NVIDIA GPUs of compute capability 8.9+, but this model loads on "
        f"'{device}'. Run ComfyUI on such a GPU, or remove the Quantize FP8 node."
    )


def describe() -> dict:
    """Versions that a benchmark result depends on (recorded in every results JSON)."""
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0]}
    for pkg in ("torchao", "triton"):
        try:
            info[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            info[pkg] = None

    info["comfyui"] = comfyui_version()
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        try:
            info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                            capture_output=True, text=True, timeout=10).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            info["driver"] = None
    else:
        info["gpu"] = None
        info["driver"] = None
    return info
