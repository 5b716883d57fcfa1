"""tools/changes.py end to end on the CPU: a real ComfyUI server, FluxAccel's default nodes after
LoraLoaderModelOnly, through every LoRA change (strength, swap, stack, removal). Only the first prompt starts a
compile; each change is merged into the FP8 Linears in place and served by the compiled model of the first prompt
(ComfyUI's own log says so)."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = pytest.mark.e2e


def test_lora_changes_reuse_the_quantized_and_compiled_model(tmp_path, e2e_model_file):
    env = {**os.environ, "FLUXACCEL_CACHE_DIR": str(tmp_path / "cache")}
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "changes.py"), "--sequence", "lora", "--case", "tiny-cpu",
                        "--configs", "fluxaccel", "--out", str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=1800, cwd=ROOT, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (path,) = (tmp_path / "out").glob("cpu-tiny-cpu-changes-lora-fluxaccel-*.json")
    res = json.loads(path.read_text())
    assert res["complete"] and res["command"].startswith("python tools/changes.py --sequence lora")
    steps = [r["step"] for r in res["results"]]
    assert steps == ["steady", "strength 1.0 -> 0.5", "strength 0.5 -> 1.0", "strength 1.0 -> 0.75", "swap", "stack",
                     "remove"]
    assert res["results"][0]["separate_compile"] == "ready"  # the first prompt's shape, compiled beside it
    assert not any("separate_compile" in r for r in res["results"][1:])  # no change compiles again
    assert [len(r["setting"]) for r in res["results"]] == [1, 1, 1, 1, 1, 2, 0]
    log = path.with_suffix(".comfyui.log").read_bytes().decode(errors="replace")
    # each change re-merges the patched Linears (the stack and the removal too) and reuses the compiled model
    assert log.count("this prompt's weight patches merged into") >= 6 and "FP8 weights cache: not cached" not in \
        log.split("Prompt executed", 1)[1]
    assert log.count("its compiled blocks and CUDA graphs serve this one") >= 6
