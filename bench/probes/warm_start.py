"""GPU check (issue 15): warm-start packages on the device's torch, with CUDA graphs, in new processes.

Three new Python processes in turn, sharing one empty FluxAccel cache folder, each with its own empty
TORCHINDUCTOR_CACHE_DIR and Triton cache (nothing warm but FluxAccel's files):
  compile  FP8 per-row (plain) + Compile (graphs, block regions) of the FLUX-width e2e model: traces, compiles and
           writes the package
  warm     the same workflow in a new process: loads the package (no dynamo trace)
  traced   the same with warm_start off (today's path: dynamo traces, inductor artifacts from the compile cache)
  restart  (--roles) the same in a new process sharing the compile's inductor and Triton caches: a restarted ComfyUI
           on the same machine
Per process: first call seconds, warm-start state, compile phases, dynamo frames traced, CUDA graphs recorded,
median device ms per warm call, the C++ builds it ran (inductor's C++ wrapper), and with --profile-role a cProfile
table of its first call (packages then load in that call, not in the background); the warm process's outputs against
the compiling one's (bit for bit). --graph-capture call: the Compile node's graph_capture "call" (per-block packages).

    source .gpu033/setup-on-device.sh; python3 bench/probes/warm_start.py --out $OUT
    python3 bench/probes/warm_start.py --graph-capture call --roles compile,restart --profile-role restart --size 1024
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def count_builds() -> list[tuple[str, float]]:
    """(target, seconds) of every C++ build inductor runs in this process from now on."""
    import torch._inductor.cpp_builder as cpp_builder

    builds: list[tuple[str, float]] = []
    build = cpp_builder.CppBuilder.build

    def counted(self, *a, **k):
        t = time.perf_counter()
        try:
            return build(self, *a, **k)
        finally:
            builds.append((Path(self.get_target_file_path()).name, round(time.perf_counter() - t, 2)))

    cpp_builder.CppBuilder.build = counted
    return builds


def _profiled(profile: bool):
    """cProfile around the first call, packages loaded in it (no background load: cProfile sees one thread)."""
    import contextlib
    import cProfile

    if not profile:
        return contextlib.nullcontext(None)
    from fluxaccel.core.compile.warm_start import Packages

    Packages.prefetch = lambda self, limit, device: "probe: loaded in the first call"

    @contextlib.contextmanager
    def run():
        prof = cProfile.Profile()
        prof.enable()
        try:
            yield prof
        finally:
            prof.disable()

    return run()


def _table(prof, sort: str, n: int = 30) -> list[str]:
    import io
    import pstats

    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats(sort).print_stats(n)
    return [line for line in buf.getvalue().splitlines() if line.strip()][-n - 1:]


def child(role: str, calls: int, size: int, out_file: str, device: str, graph_capture: str = "inductor",
          profile: bool = False) -> dict:
    t_start = time.perf_counter()
    import torch

    builds = count_builds()

    sys.path.insert(0, str(ROOT))
    from tools.plugin import register  # noqa: E402  (the plugin as the package fluxaccel)
    register()
    from tools import host

    host.import_comfy(Path(os.environ["COMFYUI_DIR"]) if os.environ.get("COMFYUI_DIR") else None)
    from torch._dynamo.utils import counters

    from fluxaccel.core.bench.benchmark import BenchCase, denoiser_outputs
    from fluxaccel.core.compile.config import CompileConfig
    from fluxaccel.core.compile.telemetry import graph_recordings
    from fluxaccel.core.compile.patch import apply_compile
    from fluxaccel.core.quant.fp8 import Fp8Config
    from fluxaccel.core.quant.patch import apply_fp8
    from fluxaccel.core.patches import describe, label
    sys.path.insert(0, str(ROOT / "tests"))
    from support.models import build_flux, synthetic_conditioning_for

    dev = torch.device(device)
    case = BenchCase(width=size, height=size)
    with torch.inference_mode():
        base = build_flux("e2e", device=device)
        positive = synthetic_conditioning_for(base.model.diffusion_model, 64)
        q, _ = apply_fp8(base, Fp8Config(granularity="per_row", layout="plain"))
        model, c = apply_compile(q, CompileConfig(warm_start=role != "traced", graph_capture=graph_capture))
        t_ready = time.perf_counter()
        outs, prof = [], None
        for i in range(calls):
            with _profiled(profile and i == 0) as p:
                outs.append(denoiser_outputs(model, case, positive, sigmas=(0.9 - 0.8 * i / max(1, calls - 1),))[0])
            prof = p or prof
        torch.save(outs, out_file)
    d = describe(model)["compile"]
    rec = graph_recordings(dev) if dev.type == "cuda" else None
    return {"role": role, "process_start_to_model_ready_s": round(t_ready - t_start, 1),
            "first_call_s": list(d["compile_seconds"].values()), "warm_start": d["warm_start"],
            "compile_phases_s": d["compile_phases_s"], "dynamo_frames_traced": counters["stats"]["unique_graphs"],
            "graphs_recorded": rec[0] if rec else None, "label": label(model), "calls": d["calls"],
            "device_ms_median": d.get("model_call_device_ms_median"), "host_ms_median": d.get("model_call_host_ms_median"),
            "torch": torch.__version__, "cpp_builds": builds,
            **({"first_call_cumulative": _table(prof, "cumulative"), "first_call_own": _table(prof, "tottime")}
               if prof is not None else {})}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--size", type=int, default=512, help="image side in pixels")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--graph-capture", default="inductor", choices=("inductor", "call"))
    ap.add_argument("--roles", default="compile,warm,traced", help="compile first; warm, restart, traced")
    ap.add_argument("--profile-role", default="", help="the role whose first call runs under cProfile")
    ap.add_argument("--role", help=argparse.SUPPRESS)
    ap.add_argument("--out-file", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.role:
        if a.device == "cpu":
            sys.path.insert(0, str(ROOT))
            from tools.plugin import register  # noqa: E402  (the plugin as the package fluxaccel)
            register()
            from tools.cpu_fp8 import lift_torchao_gate

            lift_torchao_gate()  # a tool run: torchao's GPU gate lifted for the CPU
        print("PROBE", json.dumps(child(a.role, a.calls, a.size, a.out_file, a.device, a.graph_capture,
                                        a.role == a.profile_role)), flush=True)
        return 0
    work = Path(tempfile.mkdtemp(prefix="fluxaccel-warm-"))
    res = {"command": "python3 bench/probes/warm_start.py " + " ".join(sys.argv[1:]), "processes": []}
    roles = a.roles.split(",")
    for role in roles:
        caches = "compile" if role == "restart" else role  # a restart finds the compile's caches on disk
        env = {**os.environ, "FLUXACCEL_CACHE_DIR": str(work / "cache"),
               "TORCHINDUCTOR_CACHE_DIR": str(work / f"inductor-{caches}"),
               "TRITON_CACHE_DIR": str(work / f"triton-{caches}")}
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, __file__, "--role", role, "--calls", str(a.calls), "--size", str(a.size),
                            "--device", a.device, "--out-file", str(work / f"{role}.pt"),
                            "--graph-capture", a.graph_capture, "--profile-role", a.profile_role],
                           capture_output=True, text=True, env=env)
        lines = [l for l in p.stdout.splitlines() if l.startswith("PROBE ")]
        r = json.loads(lines[-1][6:]) if lines else {"role": role, "error": p.stderr[-4000:]}
        r["process_wall_s"] = round(time.perf_counter() - t0, 1)
        r["log_tail"] = [l for l in p.stderr.splitlines() if "FluxAccel" in l][-12:]
        res["processes"].append(r)
        print("PROBE", role, json.dumps(r), flush=True)
    import torch

    outs = {role: torch.load(work / f"{role}.pt") for role in roles if (work / f"{role}.pt").exists()}
    if "compile" in outs:
        for role in roles[1:]:
            if role in outs:
                res[f"{role}_equal_to_compile"] = [bool(torch.equal(x, y)) for x, y in zip(outs["compile"], outs[role])]
                res[f"{role}_max_rel_diff"] = max(float((x.float() - y.float()).norm() / y.float().norm())
                                                  for x, y in zip(outs["compile"], outs[role]))
    res["package_bytes"] = sum(f.stat().st_size for f in (work / "cache").glob("*.warm"))
    Path(a.out).mkdir(parents=True, exist_ok=True)
    dev = "cpu" if a.device == "cpu" else "nvidia-h200"
    name = "warm-start" + ("-call" if a.graph_capture == "call" else "")
    (Path(a.out) / f"{dev}-probe-{name}.json").write_text(json.dumps(res, indent=1))
    print("PROBE summary", json.dumps({k: v for k, v in res.items() if k != "processes"}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
