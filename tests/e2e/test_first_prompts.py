"""tools/first_prompts.py end to end on the CPU: a real ComfyUI server, then the same machine's ComfyUI restarted. The
restarted server's FluxAccel prompt reads the FP8 weights the first server saved and loads the warm-start package
instead of quantizing and compiling again (ComfyUI's own log says so)."""
import json
import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = pytest.mark.e2e


def test_first_prompts_of_a_fresh_and_a_restarted_comfyui(tmp_path, e2e_model_file):
    # a new machine: FluxAccel's cache and inductor's both empty (the JSON's start says "fresh" only then)
    env = {**__import__("os").environ, "FLUXACCEL_CACHE_DIR": str(tmp_path / "cache"),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "first_prompts.py"), "--case", "tiny-cpu", "--configs",
                        "fluxaccel", "eager", "--restart", "--steady", "2", "--out", str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=1800, cwd=ROOT, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    runs = {s: json.loads((tmp_path / "out" / f"cpu-tiny-cpu-first-prompts-fluxaccel-eager-{s}.json").read_text())
            for s in ("fresh", "restart")}
    for start, res in runs.items():
        assert res["start"] == start and res["complete"] and res["command"].startswith("python tools/first_prompts.py")
        assert [r["config"] for r in res["results"]] == ["fluxaccel", "eager"]
        # the Compile node's own text: what it compiles, and why no call is captured on a CPU
        text = res["results"][0]["compile_text"]
        assert text.startswith("each kind of FLUX block compiled once") and "no CUDA graphs: this model runs on the CPU" in text
        assert "compile_text" not in res["results"][1]
        assert all(r["first_prompt_s"] > 0 and r["second_prompt_s"] > 0 for r in res["results"])
        for r in res["results"]:  # --steady 2: two more prompts each, and their median
            assert len(r["steady_prompts_s"]) == 2 and r["steady_median_s"] == pytest.approx(
                sum(r["steady_prompts_s"]) / 2, abs=0.002)
        assert res["host_memory"]["server_peak_rss_gib"] > 0
    logs = {s: (tmp_path / "out" / f"cpu-tiny-cpu-first-prompts-fluxaccel-eager-{s}.comfyui.log").read_bytes()
            .decode(errors="replace") for s in runs}  # bytes: tqdm's carriage returns stay inside their lines
    # fresh: the first prompt ran uncompiled while a separate process compiled the shape; the second loaded its
    # package, the third is the steady state
    fresh = runs["fresh"]["results"][0]
    assert fresh["separate_compile"] == "ready" and fresh["separate_compile_s"] > 0 and fresh["third_prompt_s"] > 0
    assert "FP8 weights cache: saving to" in logs["fresh"] and "in a separate process (pid" in logs["fresh"]
    assert "compiled batch 1" not in logs["fresh"] and "from its warm-start package" in logs["fresh"]
    assert "FP8 weights cache: loaded" in logs["restart"] and "from its warm-start package" in logs["restart"]
    assert "compiled batch 1" not in logs["restart"] and "in a separate process (pid" not in logs["restart"]
    assert "third_prompt_s" not in runs["restart"]["results"][0]
    # the images of the same seed: FP8 compiled against bf16 eager, a few steps of the tiny model
    for res in runs.values():
        assert res["results"][0]["second_latent_rel_err_vs_first_config"] == 0.0
        assert 0 < res["results"][1]["second_latent_rel_err_vs_first_config"] < 0.1
    # every line stamped with the seconds since its server started, in order (where a first prompt's time goes)
    stamps = [float(line.split()[0]) for line in logs["restart"].strip().split("\n") if line.strip()]
    assert stamps == sorted(stamps) and stamps[-1] > stamps[0]
