"""Warmup and Benchmark nodes in a real ComfyUI server: progress over the websocket, a chart the editor can
preview, a table and a results JSON; the benchmark after Warmup compiles nothing new."""
import json
import math

import pytest

from fluxaccel.core.compile.warmup import TICKS

from .conftest import E2E_UNET

pytestmark = pytest.mark.e2e


def test_warmup_then_benchmark(server):
    prompt = {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": E2E_UNET, "weight_dtype": "default"}},
        "2": {"class_type": "FluxAccelCompile", "inputs": {"model": ["1", 0], "resolution_policy": "strict"}},
        "3": {"class_type": "FluxAccelWarmup", "inputs": {"model": ["2", 0], "resolutions": "64x64", "batch_size": 1,
                                                          "text_length": 16, "cfg": 1.0, "steps": 2}},
        "4": {"class_type": "FluxAccelBenchmark", "inputs": {"model": ["3", 0], "text_length": 16, "width": 64,
                                                             "height": 64, "steps": 2, "runs": 2, "seed": 0, "cfg": 1.0,
                                                             "sampler_name": "euler", "scheduler": "simple", "label": ""}},
    }
    events = []
    hist = server.run_following(prompt, lambda kind, data: events.append((kind, data)))
    progress = [d for k, d in events if k == "progress"]
    assert any(d["node"] == "3" and d["max"] == 2 * TICKS for d in progress), "Warmup must report progress"
    assert any(d["node"] == "4" for d in progress)
    warm_text = hist["outputs"]["3"]["text"][0]  # CPU: bf16 weights, fp32 compute
    assert "64x64 px), 16 text tokens, float32: compiled in " in warm_text and "warm-up sampling done after" in warm_text
    out = hist["outputs"]["4"]
    assert out["images"][0]["filename"].endswith(".png") and out["images"][0]["type"] == "temp"
    assert "| fp32+compile |" in out["text"][0]  # rows say the dtype computed: float32 on the CPU
    res = json.loads((server.output_dir / out["fluxaccel_json"][0]).read_text(), parse_constant=_no_constants)
    base, accel = res["results"]
    assert base["config"] == "eager-fp32" and accel["config"] == "fp32+compile"
    for r in (base, accel):
        assert len(r["runs"]) == 2 and all(math.isfinite(x) and x > 0 for x in r["runs"])
        assert len(r["step_times"]) == 2 and len(r["denoiser_rel_err_per_sigma"]) == 3
    assert accel["speedup_vs_baseline"] == pytest.approx(base["s_per_image_median"] / accel["s_per_image_median"])
    assert accel["denoiser_rel_err"] < 2e-2
    comp = accel["extra"]["compile"]
    # warmup compiled the one shape; the benchmark's runs (first, warm steps, timed, fidelity) reused it
    assert len(comp["shapes"]) == 1 and comp["eager_calls"] == 0
    # every model call went through the compiled model, the fidelity forwards included:
    # warmup 2 + first run 2 + 2 x (1 warm step + 2 timed steps) + 3 denoiser forwards
    assert comp["calls"] == 2 + 2 + 2 * 3 + 3
    # the results are kept together (json, md, png and a latest pointer) and parse under a strict JSON parser
    folder = (server.output_dir / out["fluxaccel_json"][0]).parent
    latest = json.loads((folder / "latest.json").read_text(), parse_constant=_no_constants)
    assert latest["files"]["json"] == res["files"]["json"] and (folder / latest["files"]["png"]).stat().st_size > 1000
    assert (folder / latest["files"]["md"]).read_text().startswith(out["text"][0].split("\n", 1)[0])
    json.loads((folder / latest["files"]["json"]).read_text(), parse_constant=_no_constants)
    assert out["fluxaccel_speedup"][0] == f"{accel['speedup_vs_baseline']:.2f}x"
    assert out["fluxaccel_compiled"][0]["short"] == ["64x64 b1 t16"]

    # queued again unchanged: the Benchmark measures again (only the nodes above it come from ComfyUI's cache)
    again = server.run(prompt)
    assert "4" not in server.cached_nodes(again) and {"1", "2", "3"} <= set(server.cached_nodes(again))
    assert again["outputs"]["4"]["fluxaccel_json"] != out["fluxaccel_json"]


def test_a_workflow_saved_with_removed_inputs_loads_and_runs_with_one_log_line_per_node(server):
    """An API workflow saved when the nodes had more inputs (Quantize FP8's layout and fusions, Compile's lab switches,
    Warmup's static scales) runs as today's nodes would: one log line per node names what it set, and Compile's text
    says what FluxAccel decided."""
    prompt = {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": E2E_UNET, "weight_dtype": "default"}},
        "5": {"class_type": "FluxAccelQuantizeFP8", "inputs": {"model": ["1", 0], "granularity": "per_row",
                                                               "scope": "blocks", "layout": "subclass",
                                                               "fuse_gelu": False}},
        "6": {"class_type": "FluxAccelCompile", "inputs": {"model": ["1", 0], "cuda_graphs": False, "mode": "default",
                                                           "resolution_policy": "strict", "max_shapes": 4,
                                                           "block_regions": False, "graph_capture": "inductor",
                                                           "stage_inputs": False, "modulation_table": "off"}},
        "7": {"class_type": "FluxAccelWarmup", "inputs": {"model": ["6", 0], "resolutions": "64x64", "batch_size": 1,
                                                          "text_length": 16, "cfg": 1.0, "steps": 1,
                                                          "activation_scales": "static"}},
        "9": {"class_type": "PreviewAny", "inputs": {"source": ["5", 0]}},
    }
    at = server.log_path.stat().st_size
    hist = server.run(prompt)
    log = server.log_path.read_bytes()[at:].decode(errors="replace")
    said = [line for line in log.splitlines() if "inputs the node no longer has" in line]
    assert len(said) == 3 and all("FluxAccel decides them itself now" in line for line in said), said
    assert any("layout='subclass', fuse_gelu=False" in line for line in said), said
    assert any("cuda_graphs=False" in line and "modulation_table='off'" in line for line in said), said
    assert any("activation_scales='static'" in line for line in said), said
    assert "each kind of FLUX block compiled once" in hist["outputs"]["6"]["text"][0]
    assert "compiled in " in hist["outputs"]["7"]["text"][0]


def _no_constants(name):
    raise ValueError(f"{name} in a results JSON")
