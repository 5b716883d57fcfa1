"""FluxAccel with ComfyUI 0.38.1's Comfy model compiler (comfy/model_prefetch.py from 0.38.1, unchanged, with its pin
comfy-aimdo 0.5.5) in the 0.33.0 tree: no full 0.38 tree exists here (tools/comfy038.py).

The whole journey -- Quantize FP8 -> Compile -> Warmup -> Benchmark on the tiny model -- runs in a new process whose
comfy.model_prefetch is 0.38.1's module. A recording of the compiler's memory plan is active on the sampling thread
while it runs (comfy-aimdo's native recording needs CUDA, so a recording object with aimdo's pause/resume methods
stands in for it): every compiled call must run with it paused and resumed after, eager calls must not touch it.
"""
import json
import subprocess
import sys

import pytest

from conftest import ROOT
from tools import comfy038

pytestmark = pytest.mark.skipif(bool(comfy038.available()), reason=comfy038.available() or "")

SCRIPT = r"""
import json, logging, sys, threading, torch
sys.path.insert(0, "tests")
from tools.plugin import register; register()
logging.basicConfig(level=logging.INFO)
from tools import host; host.import_comfy()
from tools.comfy038 import use_prefetch_038
from tools.cpu_fp8 import lift_torchao_gate
import comfy_aimdo.malloc_graph, importlib.metadata as md
prefetch = use_prefetch_038()
from fluxaccel.core.models import loaded as comfy_compat
from fluxaccel.core.bench.benchmark import BenchCase, benchmark
from fluxaccel.core.compile.config import CompileConfig
from fluxaccel.core.compile.patch import apply_compile, compiled_of
from fluxaccel.core.errors import FluxAccelError
from fluxaccel.core.quant.fp8 import Fp8Config
from fluxaccel.core.quant.patch import apply_fp8
from support.models import build_flux, synthetic_conditioning
from fluxaccel.core.compile.warmup import WarmupPlan, warmup
from fluxaccel.core.upstream import comfy_internals

lift_torchao_gate()
out = {"aimdo": md.version("comfy-aimdo"), "graph_modules_attr": hasattr(prefetch, "GRAPH_MODULES"),
       "compiler_present": comfy_internals.model_compiler_present()}

class Recording:  # comfy_aimdo.malloc_graph.MallocGraph's pause/resume, as malloc_graph_begin leaves it
    _comfy_active = True
    def __init__(self): self.events = []
    def pause(self, sync=False): self.events.append("pause")
    def resume(self, sync=False): self.events.append("resume")

m = build_flux("tiny", seed=0)
with torch.inference_mode():
    fp8, _ = apply_fp8(m, Fp8Config())
    model, compiled = apply_compile(fp8, CompileConfig(separate_process=False))
    rec = Recording()
    prefetch.MALLOC_GRAPHS[threading.get_ident()] = rec
    out["recording_seen"] = comfy_internals.model_compiler_recording()
    warmed, secs = warmup(model, WarmupPlan([(128, 128)], text_length=16, cfg=1.0, steps=1))
    pos = synthetic_conditioning("tiny", text_len=16)
    rows = benchmark([("eager", m), ("fp8+compile", warmed)], BenchCase(width=128, height=128, steps=1, runs=1),
                     pos, pos)
    del prefetch.MALLOC_GRAPHS[threading.get_ident()]
    st = compiled_of(warmed).stats
    from fluxaccel.core.patches import describe
    out["described"] = describe(warmed)["compile"]["model_compiler_paused_calls"]
    out.update(warmed=len(secs), rows=[(r.config, r.denoiser_rel_err) for r in rows], calls=st.calls,
               paused=st.model_compiler_paused, unknown=st.model_compiler_unknown, events=rec.events)
    # a block that core captured a per-block CUDA graph for (0.38's marker) is refused for our compile
    m.model.diffusion_model.single_blocks[0]._comfy_graph = {"graph": None, "signature": None}
    try:
        apply_compile(m, CompileConfig(separate_process=False))
        out["refused"] = ""
    except FluxAccelError as e:
        out["refused"] = str(e)
print("RESULT " + json.dumps(out))
"""


def test_quantize_compile_warmup_benchmark_under_the_comfy_model_compiler_of_0_38_1(tmp_path):
    env = comfy038.env()
    env["FLUXACCEL_CACHE_DIR"] = str(tmp_path / "cache")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert out["aimdo"] == "0.5.5" and out["graph_modules_attr"] is False and out["compiler_present"] is True
    assert out["recording_seen"] is True
    assert out["warmed"] == 1
    (base, e0), (accel, e1) = out["rows"]
    assert (base, accel) == ("eager", "fp8+compile") and e0 == 0 and 0 < e1 < 0.1  # FP8 bound of tests/core/test_fp8
    # every compiled call ran with the recording paused, and only those
    assert out["calls"] >= 3 and out["paused"] == out["calls"] and out["unknown"] == 0
    assert out["events"] == ["pause", "resume"] * out["calls"]
    assert out["described"] == out["paused"]  # in the Benchmark JSON's description of the model
    assert "per-block CUDA graph on diffusion_model.single_blocks.0" in out["refused"]
