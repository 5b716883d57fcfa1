"""Real ComfyUI servers in environments FluxAccel does not support: one whose Python cannot import torchao, one
whose torch reports a version below the minimum. Each starts, lists FluxAccel's nodes, the affected nodes explain
what to install, and the server keeps working.

What is lifted, and how: a sitecustomize.py on the server's PYTHONPATH runs at interpreter start-up, before ComfyUI.
It either blocks `import torchao` (a meta-path finder) or sets `torch.__version__` to an old version string; nothing
else in torch changes, so ComfyUI itself runs normally and FluxAccel's real checks read what a user's install shows."""
from pathlib import Path

import pytest

from conftest import COMFY_DIR
from tools.comfy_server import ComfyServer, PromptFailed
from tools.host import CPU_SERVER_ARGS

from .conftest import MODELS_DIR, flux_inputs, sample_and_save

pytestmark = pytest.mark.e2e

BLOCKER = '''
import importlib.abc, sys
class _NoTorchao(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torchao" or name.startswith("torchao."):
            raise ImportError(f"No module named {name!r} (blocked by the FluxAccel test)")
sys.meta_path.insert(0, _NoTorchao())
'''


OLD_TORCH = """
import torch
torch.__version__ = "2.5.1+cu124"  # what an old ComfyUI install reports (set by the FluxAccel test)
"""


def _server_with_startup_hook(work: Path, hook: str) -> ComfyServer:
    import os

    site = work / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(hook)  # imported by Python at start-up, before ComfyUI
    env = {"PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return ComfyServer(COMFY_DIR, work, MODELS_DIR, CPU_SERVER_ARGS, env=env, cpu_fp8=True).start()


@pytest.fixture(scope="module")
def server_without_torchao(e2e_model_file, tmp_path_factory):
    srv = _server_with_startup_hook(tmp_path_factory.mktemp("notorchao"), BLOCKER)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def server_with_old_torch(e2e_model_file, tmp_path_factory):
    srv = _server_with_startup_hook(tmp_path_factory.mktemp("oldtorch"), OLD_TORCH)
    yield srv
    srv.stop()


OURS = ["FluxAccelBenchmark", "FluxAccelCompile", "FluxAccelParallel", "FluxAccelQuantizeFP8",
        "FluxAccelSyntheticConditioning", "FluxAccelWarmup"]


def test_starts_lists_nodes_and_explains(server_without_torchao):
    srv = server_without_torchao
    info = srv.get("/object_info")
    assert sorted(k for k in info if k.startswith("FluxAccel")) == OURS
    fp8 = {**flux_inputs(),
           "4": {"class_type": "FluxAccelQuantizeFP8", "inputs": {"model": ["1", 0], "granularity": "per_row",
                                                                  "scope": "blocks"}},
           **sample_and_save("4", seed=1, steps=1, tag="x")}
    with pytest.raises(PromptFailed) as exc:
        srv.run(fp8)
    assert "needs torchao>=0.17,<0.19, which is not installed" in exc.value.exception_message
    assert "pip install" in exc.value.exception_message
    # the server keeps working, other nodes included
    hist = srv.run({**flux_inputs(), **sample_and_save("1", seed=1, steps=1, tag="x")})
    assert hist["outputs"]["6"]["latents"]


@pytest.mark.parametrize("node,inputs", [
    ("FluxAccelQuantizeFP8", {"granularity": "per_row", "scope": "blocks"}),
    ("FluxAccelCompile", {"cuda_graphs": False, "mode": "default", "resolution_policy": "strict", "max_shapes": 4}),
])
def test_old_torch_starts_lists_nodes_and_explains(server_with_old_torch, node, inputs):
    srv = server_with_old_torch
    assert sorted(k for k in srv.get("/object_info") if k.startswith("FluxAccel")) == OURS
    g = {**flux_inputs(), "4": {"class_type": node, "inputs": {"model": ["1", 0], **inputs}},
         **sample_and_save("4", seed=1, steps=1, tag="x")}
    with pytest.raises(PromptFailed) as exc:
        srv.run(g)
    msg = exc.value.exception_message
    assert "needs PyTorch 2.8 or newer; this ComfyUI runs torch 2.5.1+cu124" in msg and "pip install -U" in msg, msg
    hist = srv.run({**flux_inputs(), **sample_and_save("1", seed=1, steps=1, tag="y")})
    assert hist["outputs"]["6"]["latents"]
