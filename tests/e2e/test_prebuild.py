"""tools/prebuild.py: one headless run of a workflow fills a shared folder with warm-start packages, and a new ComfyUI
server pointed at that folder (a fleet worker) loads them instead of compiling."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import COMFY_DIR, ROOT
from tools.host import CPU_SERVER_ARGS
from tools.prebuild import prebuild

from .conftest import E2E_UNET, MODELS_DIR

pytestmark = pytest.mark.e2e


def _workflow() -> dict:
    """The CPU quickstart workflow without its Benchmark: Compile -> Warmup (an output node: it runs on its own)."""
    api = json.loads((ROOT / "example_workflows" / "api" / "fluxaccel_quickstart_cpu.json").read_text())
    del api["5"]
    assert api["1"]["inputs"]["unet_name"] == E2E_UNET
    return api


def test_prebuilt_packages_start_a_new_server_warm(e2e_model_file, tmp_path):
    """Into an empty folder of its own (the fleet's: no other server or test writes there), the first run writes the
    workflow's package; the second run, a new server, must load every package and write none."""
    folder = tmp_path / "fleet"
    first = prebuild(_workflow(), COMFY_DIR, folder, list(CPU_SERVER_ARGS), MODELS_DIR)
    assert first.written and not first.loaded, first
    assert all(p.parent == folder and p.stat().st_size > 0 for p in first.written)
    second = prebuild(_workflow(), COMFY_DIR, folder, list(CPU_SERVER_ARGS), MODELS_DIR)
    assert second.written == [] and second.loaded >= max(1, len(first.written)), second


def test_a_workflow_without_compile_is_refused(tmp_path):
    wf = _workflow()
    for nid in ("3", "4"):
        del wf[nid]
    path = tmp_path / "wf.json"
    path.write_text(json.dumps(wf))
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "prebuild.py"), str(path), "--comfyui", str(COMFY_DIR),
                        "--cache-dir", str(tmp_path / "cache")], capture_output=True, text=True, timeout=300)
    assert p.returncode != 0 and "has no Compile + CUDA Graph (FluxAccel) node" in p.stderr, p.stderr[-2000:]
