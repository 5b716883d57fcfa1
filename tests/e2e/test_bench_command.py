"""The README's main-job command end to end on the CPU: real ComfyUI server, example workflow, results kept."""
import json
import math
import subprocess
import sys

import pytest

from conftest import COMFY_VERSION, ROOT

pytestmark = pytest.mark.e2e


def _strict(name):
    raise ValueError(f"{name} in a results JSON")


def _run(tmp_path, *args):
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "bench.py"), "--case", "tiny-cpu", "--runs", "1",
                        "--out", str(tmp_path), *args], capture_output=True, text=True, timeout=1800, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p


def _check_rows(rows):
    for r in rows.values():
        for key in ("first_run_s", "s_per_image_median", "s_per_step_median"):
            assert math.isfinite(r[key]) and r[key] > 0
        assert len(r["runs"]) == 1 and r["peak_vram_gib"] is None  # CPU: no VRAM to report
        assert r["speedup_vs_baseline"] == pytest.approx(r["baseline_s_per_image_median"] / r["s_per_image_median"])


def test_headless_benchmark_on_the_cpu_runs_the_compile_quickstart_and_keeps_its_files(tmp_path, e2e_model_file):
    p = _run(tmp_path)
    assert "RANDOM weights" in p.stdout and "+compile |" in p.stdout
    res = json.loads((tmp_path / "cpu-tiny-cpu-quickstart-cpu.json").read_text(), parse_constant=_strict)
    assert res["case"] == "tiny-cpu" and res["gpu"] == "cpu" and res["command"].startswith("python tools/bench.py")
    assert res["env"]["comfyui"] == COMFY_VERSION and res["env"]["torchao"] and "driver" in res["env"] and res["date"]
    rows = {r["config"]: r for r in res["results"]}
    (base, base_row), (accel, accel_row) = rows.items()
    assert base.startswith("eager-") and "+compile" in accel and "fp8" not in accel
    _check_rows(rows)
    assert 0 < accel_row["denoiser_rel_err"] < 2e-2 and base_row["denoiser_rel_err"] == 0
    # this run's own files beside the latest JSON: the same JSON, the server log, the node's table and chart
    kept = sorted(f.name for f in tmp_path.iterdir())
    stem = next(n[: -len(".log")] for n in kept if n.endswith(".log"))
    assert {f"{stem}.json", f"{stem}.log", f"{stem}-node5.md", f"{stem}-node5.png"} <= set(kept), kept
    assert json.loads((tmp_path / f"{stem}.json").read_text()) == res
    log = (tmp_path / f"{stem}.log").read_text()
    assert "Prompt executed" in log
    # a first run says nothing alarming: no error line (ComfyUI's database among them)
    assert not [line for line in log.splitlines() if "[ERROR]" in line or "Failed to initialize" in line], log[-3000:]


def test_headless_fp8_suite_on_the_cpu(tmp_path, e2e_model_file):
    p = _run(tmp_path, "--suite", "fp8")
    assert "| fp8-per_row |" in p.stdout
    res = json.loads((tmp_path / "cpu-tiny-cpu.json").read_text(), parse_constant=_strict)
    rows = {r["config"]: r for r in res["results"]}
    assert list(rows)[1:] == ["fp8-per_tensor", "fp8-per_row", "fp8-per_row-all_linear"]
    _check_rows(rows)
    for name in list(rows)[1:]:
        assert 0 < rows[name]["denoiser_rel_err"] < 0.1


def test_the_benchmark_workflows_set_only_inputs_the_nodes_have():
    """Every workflow the main job builds (the core suite's and each example's) gives FluxAccel's nodes only inputs
    they have today, so its runs say nothing about removed inputs; --only keeps the Benchmark nodes asked for."""
    from fluxaccel.nodes import NODES
    from tools.bench import CASES, WORKFLOWS, build_prompt, only_benchmarks

    names = {n.define_schema().node_id: {i.id for i in n.define_schema().inputs} for n in NODES}
    for suite in WORKFLOWS:
        prompt = build_prompt(CASES["schnell-512-4"], "model.safetensors", 1, suite)
        for node in prompt.values():
            if node["class_type"] in names:
                assert set(node["inputs"]) <= names[node["class_type"]], (suite, node)
    core = build_prompt(CASES["schnell-512-4"], "model.safetensors", 1, "core")
    kept = only_benchmarks(core, ["FluxAccel default"])
    assert [v["_meta"]["title"] for v in kept.values() if v["class_type"] == "FluxAccelBenchmark"] == [
        "Benchmark FluxAccel default"]
