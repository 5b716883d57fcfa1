"""Test set-up: a real ComfyUI (tools/host.py) importable in-process, on the CPU.

CPU FP8: torchao refuses FP8 off-GPU by one capability gate (_check_hardware_support). The `cpu_fp8` fixture
lifts exactly that gate for one test (tools/cpu_fp8.py; the plugin never does); everything else (Float8Tensor,
torch._scaled_mm's CPU kernel, the dispatch of F.linear) is torchao's and torch's real code, so numerics are those
of the GPU recipe up to the GEMM accumulation order. CPU servers get the same through ComfyServer(cpu_fp8=True).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # support: the tests' shared helpers
from tools.plugin import register  # noqa: E402  (the plugin as the package fluxaccel)
register()

from tools import host  # noqa: E402

COMFY_DIR = host.import_comfy(host.comfy_dir())
COMFY_VERSION = host.comfy_version(COMFY_DIR)  # the host under test
MODELS_DIR = ROOT / ".cache" / "models"
E2E_UNET = "fluxaccel-random-e2e.safetensors"  # the e2e FLUX file (256 wide) that UNETLoader loads in the tests


@pytest.fixture(autouse=True, scope="session")
def session_compile_cache(tmp_path_factory):
    """FluxAccel's persistent compile cache goes to one folder of this test run, shared by its pytest workers and
    their session servers (FluxAccel writes its files under a temporary name and renames them, for processes that
    share a folder). A test that damages or counts the files of a compile uses a folder of its own."""
    import os

    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "compile-cache"
    folder.mkdir(exist_ok=True)
    os.environ["FLUXACCEL_CACHE_DIR"] = str(folder)
    yield folder


@pytest.fixture(autouse=True, scope="session")
def _private_comfy_folders(tmp_path_factory):
    """ComfyUI's output, input, temp and user folders of this process in this test session's temporary folder (as
    the servers' are in theirs), not in the ComfyUI tree."""
    import folder_paths

    for name in ("output", "input", "temp", "user"):
        path = tmp_path_factory.mktemp(f"comfy-{name}")
        getattr(folder_paths, f"set_{name}_directory")(str(path))
    yield


@pytest.fixture(autouse=True)
def _fresh_warm_start(request, tmp_path, monkeypatch):
    """Tests share the run's compile-cache folder: a warm-start package that one test wrote (same tiny model
    layout, compile config and call signature), in either pytest worker, is loaded by the next one in ~1 s where
    compiling it again takes ~25 s on the CPU (aot_compile does not use inductor's FX-graph cache). Tests marked
    `fresh_compile` get a folder of their own: they check what a compile itself does (the trace, its phases, the
    files it writes)."""
    if request.node.get_closest_marker("fresh_compile") is not None:
        monkeypatch.setenv("FLUXACCEL_CACHE_DIR", str(tmp_path / "compile-cache"))


@pytest.fixture(scope="session")
def e2e_model_file():
    """The e2e FLUX file in the models folder the test servers read (written once, kept)."""
    from support.models import write_flux_file

    return write_flux_file(MODELS_DIR / "diffusion_models" / E2E_UNET, "e2e")


@pytest.fixture
def cpu_fp8(monkeypatch):
    """CPU FP8 for this test: torchao's GPU-capability gate lifted (see module docstring)."""
    from tools.cpu_fp8 import lift_torchao_gate

    lift_torchao_gate(monkeypatch)


@pytest.fixture
def tiny_flux():
    """A fresh tiny random-weight FLUX ModelPatcher (hidden 256, 2 double + 2 single blocks), bf16, CPU."""
    from support.models import build_flux

    return build_flux("tiny", seed=0)


@pytest.fixture(autouse=True)
def _inference_mode():
    # ComfyUI executes nodes under torch.inference_mode(); tests do the same.
    with torch.inference_mode():
        yield


@pytest.fixture(autouse=True)
def _unload_models():
    yield
    import comfy.model_management as mm

    mm.unload_all_models()


@pytest.fixture
def fresh_dynamo():
    """dynamo's caches and counters emptied before and after the test; yields the counters."""
    import torch._dynamo.utils as dynamo_utils

    dynamo_utils.counters.clear()
    torch._dynamo.reset()
    yield dynamo_utils.counters
    torch._dynamo.reset()
