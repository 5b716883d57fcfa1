"""The README's main-job command end to end on the CPU: real ComfyUI server, example workflow, results JSON."""
import json
import math
import subprocess
import sys

import pytest

from conftest import COMFY_VERSION, ROOT

pytestmark = pytest.mark.e2e


def test_headless_benchmark_tiny_cpu(tmp_path, e2e_model_file):
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "bench.py"), "--case", "tiny-cpu", "--runs", "1",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=1800, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "RANDOM weights" in p.stdout and "| fp8-per_row |" in p.stdout
    res = json.loads((tmp_path / "cpu-tiny-cpu.json").read_text())
    assert res["case"] == "tiny-cpu" and res["gpu"] == "cpu" and res["command"].startswith("python tools/bench.py")
    assert res["env"]["comfyui"] == COMFY_VERSION and res["env"]["torchao"] and "driver" in res["env"] and res["date"]
    rows = {r["config"]: r for r in res["results"]}
    assert list(rows) == ["eager-bf16", "fp8-per_tensor", "fp8-per_row", "fp8-per_row-naive-all_linear"]
    for r in rows.values():
        for key in ("first_run_s", "s_per_image_median", "s_per_step_median"):
            assert math.isfinite(r[key]) and r[key] > 0
        assert len(r["runs"]) == 1 and r["peak_vram_gib"] is None  # CPU: no VRAM to report
        assert r["speedup_vs_eager"] == pytest.approx(r["baseline_s_per_image_median"] / r["s_per_image_median"])
        assert r["s_per_step_median"] == pytest.approx(r["s_per_image_median"] / 2)  # tiny-cpu: 2 steps
    assert rows["eager-bf16"]["denoiser_rel_err"] == 0
    for name in ("fp8-per_tensor", "fp8-per_row", "fp8-per_row-naive-all_linear"):
        assert 0 < rows[name]["denoiser_rel_err"] < 0.1
