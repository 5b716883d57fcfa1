"""A real ComfyUI server whose Python cannot import torchao: it starts, lists FluxAccel's nodes, the FP8 node
explains what to install, and the nodes that do not need torchao keep working."""
import tempfile
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


@pytest.fixture(scope="module")
def server_without_torchao(e2e_model_file):
    work = Path(tempfile.mkdtemp(prefix="fluxaccel-notorchao-"))
    site = work / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER)  # imported by Python at start-up, before ComfyUI
    import os

    env = {"PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "FLUXACCEL_ALLOW_CPU_FP8": "1"}
    srv = ComfyServer(COMFY_DIR, work, MODELS_DIR, CPU_SERVER_ARGS, env=env).start()
    yield srv
    srv.stop()


def test_starts_lists_nodes_and_explains(server_without_torchao):
    srv = server_without_torchao
    info = srv.get("/object_info")
    ours = sorted(k for k in info if k.startswith("FluxAccel"))
    assert ours == ["FluxAccelBenchmark", "FluxAccelCompile", "FluxAccelQuantizeFP8",
                    "FluxAccelSyntheticConditioning", "FluxAccelWarmup"]
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
