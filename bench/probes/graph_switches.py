"""GPU check (issue 14, item 3): CUDA-graph re-recording when ComfyUI switches or reloads a compiled FLUX model.

Inductor's cudagraph trees re-record a graph whose weights moved; past triton.cudagraph_unexpected_rerecord_limit
(128) a function runs without graphs. This runs, in-process on the GPU with PyTorch's native allocator (graphs on),
the FLUX-width e2e model (1 double + 1 single block), latent 32x32, 64 text tokens, through ComfyUI's
load_models_gpu and apply_model with the model's wrappers (as the sampler and the Benchmark's denoiser forwards do):

  switch:  an FP8 (per-row, plain) compiled clone and a bf16 compiled clone of one loaded model, alternating
           (ComfyUI swaps the clones' patches on the same module tree)
  reload:  one compiled model, mm.unload_all_models() before every call (what /free does)
  reload_moved: the same, with 64 MB more GPU memory held before each reload (other models, the VAE): the weights
           come back at addresses no earlier recording used

Per scenario: torch's own counts (graphs recorded, re-recordings counted toward the limit, cudagraph_skips) next to
FluxAccel's stats (re-recordings, graphs lost, label, graphs_running), and every output against the first one.

    source .gpu033/setup-on-device.sh; python3 bench/probes/graph_switches.py --calls 140 --out $OUT
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(calls: int, device: str = "cuda", shape: str = "e2e", scenarios=("switch", "reload")) -> dict:
    import torch

    sys.path.insert(0, str(ROOT))
    from tools.plugin import register  # noqa: E402  (the plugin as the package fluxaccel)
    register()
    from tools import host

    host.import_comfy(Path(os.environ["COMFYUI_DIR"]))
    import comfy.model_management as mm

    from fluxaccel.core.bench.benchmark import BenchCase, denoiser_outputs
    from fluxaccel.core.compile.config import CompileConfig
    from fluxaccel.core.compile.telemetry import cudagraph_skips, graph_recordings
    from fluxaccel.core.compile.patch import apply_compile
    from fluxaccel.core.quant.fp8 import Fp8Config
    from fluxaccel.core.quant.patch import apply_fp8
    from fluxaccel.core.patches import describe, label
    sys.path.insert(0, str(ROOT / "tests"))
    from support.models import build_flux, synthetic_conditioning_for

    dev = torch.device(device)
    gpu = dev.type == "cuda"
    out = {"torch": torch.__version__, "allocator": torch.cuda.get_allocator_backend() if gpu else None,
           "rerecord_limit": torch._inductor.config.triton.cudagraph_unexpected_rerecord_limit,
           "gpu": torch.cuda.get_device_name() if gpu else "cpu", "shape": shape, "calls_per_scenario": calls,
           "scenarios": {}}
    case = BenchCase(width=256, height=256)
    with torch.inference_mode():
        base = build_flux(shape, device=device)
        positive = synthetic_conditioning_for(base.model.diffusion_model, 64)
        q, _ = apply_fp8(base, Fp8Config(granularity="per_row", layout="plain"))
        cfg = CompileConfig(persistent_cache=False)
        fp8c, c_fp8 = apply_compile(q, cfg)
        bf16c, c_bf16 = apply_compile(base, cfg)

        def scenario(name, models, before_call=None):
            t0 = time.perf_counter()
            rec0, skips0 = graph_recordings(dev) or (0, 0), cudagraph_skips()
            first, worst, per_call = {}, {}, []
            for i in range(calls):
                m = models[i % len(models)]
                if before_call:
                    before_call()
                r_before = graph_recordings(dev) or (0, 0)
                o = denoiser_outputs(m, case, positive, sigmas=(0.5,))[0]
                r_after = graph_recordings(dev) or (0, 0)
                k = label(m)
                if k not in first:
                    first[k] = o
                worst[k] = max(worst.get(k, 0.0), float((o - first[k]).norm() / first[k].norm()))
                per_call.append([r_after[0] - r_before[0], r_after[1] - r_before[1]])
            rec1 = graph_recordings(dev) or (0, 0)
            res = {
                "seconds": round(time.perf_counter() - t0, 1),
                "torch_graphs_recorded": rec1[0] - rec0[0],
                "torch_rerecords_counted_toward_limit": rec1[1] - rec0[1],
                "torch_cudagraph_skips": cudagraph_skips() - skips0,
                "calls_that_recorded": sum(1 for a, _ in per_call if a),
                "first_recording_calls": [i for i, (a, _) in enumerate(per_call) if a][:8],
                "max_rel_diff_vs_first_output": worst,
                "models": {},
            }
            for m in models:
                d = describe(m)["compile"]
                res["models"][label(m)] = {k: d[k] for k in ("calls", "graph_rerecords", "graphs_lost", "graph_skips",
                                                              "eager_calls")}
                c = c_fp8 if m is fp8c else c_bf16
                res["models"][label(m)]["graphs_running"] = c.graphs_running
            # what FluxAccel reports must match what inductor did: graphs lost exactly where it skipped
            res["report_matches_torch"] = (res["torch_cudagraph_skips"] > 0) == any(
                r["graphs_lost"] for r in res["models"].values())
            print("PROBE", name, json.dumps(res), flush=True)
            return res

        def unload():
            was_loaded = bool(mm.current_loaded_models)
            mm.unload_all_models()
            if was_loaded and gpu and base.model.diffusion_model.img_in.weight.device.type != "cpu":
                raise RuntimeError("unload_all_models left the weights on the GPU: the reload scenario would not move them")

        spacers = []

        def unload_elsewhere():
            # as in a server where the VAE, text encoders or other models took memory meanwhile: 64 MB more held
            # each time, so the reloaded weights land at addresses no earlier recording used
            unload()
            spacers.append(torch.empty(64 << 20, dtype=torch.uint8, device=dev))

        if "switch" in scenarios:
            out["scenarios"]["switch"] = scenario("switch", [fp8c, bf16c])
        if "reload" in scenarios:
            out["scenarios"]["reload"] = scenario("reload", [bf16c], before_call=unload)
        if "reload_moved" in scenarios:
            out["scenarios"]["reload_moved"] = scenario("reload_moved", [bf16c], before_call=unload_elsewhere)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=140)
    ap.add_argument("--out", default=".")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script itself (no graphs there)")
    ap.add_argument("--shape", default="e2e")
    ap.add_argument("--scenario", action="append", choices=("switch", "reload", "reload_moved"), help="default: both")
    a = ap.parse_args()
    if a.device == "cpu":
        sys.path.insert(0, str(ROOT))
        from tools.plugin import register  # noqa: E402  (the plugin as the package fluxaccel)
        register()
        from tools.cpu_fp8 import lift_torchao_gate

        lift_torchao_gate()  # a tool run: torchao's GPU gate lifted for the CPU
    res = run(a.calls, a.device, a.shape, tuple(a.scenario or ("switch", "reload")))
    res["command"] = "python3 bench/probes/graph_switches.py " + " ".join(sys.argv[1:])
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "nvidia-h200-graph-switches.json").write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
