"""core/env.py: clear errors for missing/old torchao and unsupported devices."""
import re
import sys

import pytest
import torch

from conftest import COMFY_VERSION
from fluxaccel.core import env
from fluxaccel.core.errors import FluxAccelError


def test_torchao_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)  # makes `import torchao` raise ImportError
    with pytest.raises(FluxAccelError, match=r"needs torchao>=0\.17,<0\.19, which is not installed.*pip install"):
        env.require_torchao()


@pytest.mark.parametrize("version", ["0.16.0", "0.19.1", "1.0.0"])
def test_torchao_wrong_version(monkeypatch, version):
    monkeypatch.setattr(env.md, "version", lambda name: version)
    with pytest.raises(FluxAccelError, match=rf"this ComfyUI has torchao {version}\. Run: python -m pip install"):
        env.require_torchao()


def test_torchao_supported_version_passes(monkeypatch):
    monkeypatch.setattr(env.md, "version", lambda name: "0.18.0+cu130")
    assert env.require_torchao() is sys.modules["torchao"]


@pytest.mark.parametrize("version,ok", [("2.5.1+cu124", False), ("2.7.1", False), ("2.8.0", True),
                                        ("2.11.0+cu130", True), ("2.14.1+cpu", True), ("3.0.0a0", True)])
def test_torch_minimum(monkeypatch, version, ok):
    monkeypatch.setattr(env.torch, "__version__", version)
    if ok:
        env.require_torch("Compile (FluxAccel)")
    else:
        with pytest.raises(FluxAccelError, match=rf"Compile \(FluxAccel\) needs PyTorch 2\.8 or newer; this ComfyUI runs "
                                                 rf"torch {re.escape(version)}\. Update"):
            env.require_torch("Compile (FluxAccel)")


@pytest.mark.parametrize("cap,ok", [((8, 6), False), ((7, 5), False), ((8, 9), True), ((9, 0), True), ((10, 0), True)])
def test_gpu_capability_gate(monkeypatch, cap, ok):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Test GPU")
    if ok:
        env.require_fp8_device(torch.device("cuda", 0))
    else:
        with pytest.raises(FluxAccelError, match=rf"compute capability 8\.9 or newer.*Test GPU is sm_{cap[0]}{cap[1]}"):
            env.require_fp8_device(torch.device("cuda", 0))


def test_cpu_fp8_is_refused_unless_torchao_allows_it(monkeypatch):
    """The plugin asks torchao's own hardware gate: on a CPU-only machine it refuses, and no setting of the plugin
    turns that off (tests and tools lift torchao's gate themselves: tools/cpu_fp8.py)."""
    monkeypatch.setenv("FLUXACCEL_ALLOW_CPU_FP8", "1")  # the old opt-in variable does nothing any more
    assert not env.torchao_fp8_here()
    with pytest.raises(FluxAccelError, match="NVIDIA GPUs of compute capability 8.9\\+.*'cpu'"):
        env.require_fp8_device(torch.device("cpu"))
    from tools.cpu_fp8 import lift_torchao_gate

    lift_torchao_gate(monkeypatch)
    assert env.torchao_fp8_here()
    env.require_fp8_device(torch.device("cpu"))


def test_describe_has_versions():
    d = env.describe()
    assert d["torch"] == torch.__version__ and d["torchao"] and d["comfyui"] == COMFY_VERSION
