"""Headless benchmark: a real ComfyUI server on 127.0.0.1 runs example_workflows/api/ through POST /prompt.

    python tools/bench.py                     # tiny-cpu without a GPU, dev-1024-28 with one
    python tools/bench.py --case schnell-512-4
    python tools/bench.py --checkpoint /path/to/flux1-dev.safetensors   # a real bf16 FLUX checkpoint

Without --checkpoint the model is FLUX's architecture with seeded random weights (said in the output): for the
dev/schnell shapes speed and memory are those of the real model, images are noise; tiny-cpu's model has FLUX's width
but 1 double + 1 single block. Prints a table and writes <gpu>-<case>[-<suite>].json to bench/results/ on a GPU
(the project's committed results) and to .cache/bench-results/ (untracked) on the CPU.
"""
from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import logging
import os
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tools.plugin import register  # noqa: E402  (the plugin as the package fluxaccel)
register()

from tools import host  # noqa: E402
from tools.comfy_server import ComfyServer  # noqa: E402

log = logging.getLogger("fluxaccel.bench")

CASES = {
    # name: model shape, width, height, steps, text tokens, timed runs
    "tiny-cpu": dict(shape="e2e", width=64, height=64, steps=2, text_length=16, runs=2),
    # the FLUX.2 architecture at width 256 (1 double + 1 single block): a functional check of FLUX.2 on the CPU
    "flux2-tiny-cpu": dict(shape="e2e-flux2", width=128, height=128, steps=2, text_length=16, runs=1),
    "dev-1024-28": dict(shape="dev", width=1024, height=1024, steps=28, text_length=512, runs=3),
    "schnell-512-4": dict(shape="schnell", width=512, height=512, steps=4, text_length=256, runs=5),
    # FLUX.2 [klein] 9B's shape: its own 4 steps, and 28 (per-step figures comparable with FLUX.1-dev's)
    "klein9b-1024-4": dict(shape="klein-9b", width=1024, height=1024, steps=4, text_length=512, runs=3),
    "klein9b-1024-28": dict(shape="klein-9b", width=1024, height=1024, steps=28, text_length=512, runs=2),
    # FLUX.2 [dev]'s shape (32B): its bf16 file (64 GB) does not fit the GPU machine's disk: first_prompts --in-memory
    "flux2dev-1024-28": dict(shape="flux2-dev", width=1024, height=1024, steps=28, text_length=512, runs=2),
}
WORKFLOWS = {
    # suite: (workflow, ComfyUI launch flags it needs on a GPU)
    "fp8": ("fluxaccel_fp8_benchmark.json", []),
    # what shows the plugin on a CPU: Compile -> Warmup -> Benchmark against eager (FP8 needs an NVIDIA GPU)
    "quickstart-cpu": ("fluxaccel_quickstart_cpu.json", []),
    "compile": ("fluxaccel_compile_benchmark.json", []),
    # FluxAccel against ComfyUI core's own acceleration, with ComfyUI's default launch flags (core_prompt below)
    "core": (None, []),
}
BENCH_DEFAULTS = {"seed": 0, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple"}


def _node(class_type: str, title: str, **inputs) -> dict:
    return {"class_type": class_type, "inputs": inputs, "_meta": {"title": title}}


def core_prompt(unet_name: str) -> dict:
    """Rows: core's TorchCompileModel (bf16, and on weight_dtype fp8_e4m3fn_fast), FluxAccel's defaults (Quantize
    FP8 -> Compile) and its attention fp8; each against core's eager default."""
    p = {
        "1": _node("UNETLoader", "Load FLUX (bf16)", unet_name=unet_name, weight_dtype="default"),
        "2": _node("FluxAccelSyntheticConditioning", "Synthetic conditioning", model=["1", 0], text_length=512,
                   guidance=3.5, seed=0),
        "3": _node("TorchCompileModel", "core TorchCompileModel", model=["1", 0], backend="inductor"),
        "4": _node("UNETLoader", "Load FLUX (fp8_e4m3fn_fast)", unet_name=unet_name, weight_dtype="fp8_e4m3fn_fast"),
        "5": _node("TorchCompileModel", "core fp8_e4m3fn_fast + TorchCompileModel", model=["4", 0], backend="inductor"),
        "6": _node("FluxAccelQuantizeFP8", "Quantize FP8 (defaults)", model=["1", 0], granularity="per_row",
                   scope="blocks"),
        "7": _node("FluxAccelCompile", "Compile (defaults)", model=["6", 0], resolution_policy="recompile"),
        # FP8 attention (FlashAttention-3's FP8 kernel; the fa3-fwd wheel, Hopper GPUs only)
        "8": _node("FluxAccelCompile", "Compile (attention fp8)", model=["6", 0], resolution_policy="recompile",
                   attention="fp8"),
    }
    rows = [("3", "core TorchCompileModel", "core-torchcompile"),
            ("5", "core fp8_e4m3fn_fast + TorchCompileModel", "core-fp8_e4m3fn_fast+torchcompile"),
            ("7", "FluxAccel default", ""), ("8", "FluxAccel attention fp8", "")]
    for i, (model, title, label) in enumerate(rows):
        p[str(20 + i)] = _node("FluxAccelBenchmark", f"Benchmark {title}", model=[model, 0], baseline=["1", 0],
                               positive=["2", 0], text_length=512, width=1024, height=1024, steps=28, runs=3,
                               label=label, **BENCH_DEFAULTS)
    return p


def _gpu() -> str | None:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def build_prompt(case: dict, unet_name: str, runs: int, suite: str = "fp8") -> dict:
    if suite == "core":
        prompt = core_prompt(unet_name)
    else:
        prompt = copy.deepcopy(json.loads((ROOT / "example_workflows" / "api" / WORKFLOWS[suite][0]).read_text()))
    prompt["1"]["inputs"]["unet_name"] = unet_name
    prompt["2"]["inputs"]["text_length"] = case["text_length"]
    for node in prompt.values():
        if node["class_type"] == "FluxAccelBenchmark":
            node["inputs"].update(width=case["width"], height=case["height"], steps=case["steps"], runs=runs,
                                  text_length=case["text_length"])
    return prompt


def only_benchmarks(prompt: dict, only: list[str]) -> dict:
    """The prompt with the Benchmark nodes whose title contains one of `only`, and without the Warmup nodes (output
    nodes: ComfyUI would run them all the same) that none of those needs."""
    kept = {k: v for k, v in prompt.items()
            if v["class_type"] != "FluxAccelBenchmark" or any(o in v.get("_meta", {}).get("title", "") for o in only)}
    needed, todo = set(), [k for k, v in kept.items() if v["class_type"] == "FluxAccelBenchmark"]
    while todo:
        k = todo.pop()
        if k not in needed:
            needed.add(k)
            todo += [v[0] for v in kept[k]["inputs"].values() if isinstance(v, list) and len(v) == 2 and v[0] in kept]
    return {k: v for k, v in kept.items() if v["class_type"] != "FluxAccelWarmup" or k in needed}


def _row_name(row: dict, case: dict) -> str:
    name = row["config"]
    if case["sampler"] != "euler":
        name += f"@{case['sampler']}"
    if case["cfg"] != 1.0:
        name += f"@cfg{case['cfg']:g}"
    return name


def merge_results(bench_files: list[dict]) -> list[dict]:
    """One row per config: the first Benchmark node's baseline row, then each node's accelerated row (and its
    baseline row too where that baseline differs from the first one, e.g. in the sampler sweep)."""
    first_base = bench_files[0]["results"][0]["config"]
    rows = []
    for i, f in enumerate(bench_files):
        base, accel = f["results"][0], f["results"][1]
        if i == 0 or base["config"] != first_base or f["case"]["sampler"] != "euler" or f["case"]["cfg"] != 1.0:
            rows.append(dict(base, config=_row_name(base, f["case"])))
        rows.append(dict(accel, config=_row_name(accel, f["case"])))
    return rows


def inductor_cache_dir() -> Path:
    """Where torch's inductor keeps its compiled kernels on this machine (TORCHINDUCTOR_CACHE_DIR, else its default
    folder in the temporary directory)."""
    import getpass

    folder = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    return Path(folder) if folder else Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}"


def server_start() -> tuple[str, str]:
    """How this run's ComfyUI starts: "fresh" (FluxAccel's compile cache and inductor's both empty or absent: a new
    machine), "new-cache" (FluxAccel's cache empty, but torch compiled on this machine before: inductor's cache holds
    kernels) or "restart" (FluxAccel's cache holds earlier compiles); and what was seen."""
    from fluxaccel.core.cache.folder import default_dir

    folder, inductor = default_dir(), inductor_cache_dir()
    entries = list(folder.iterdir()) if folder.is_dir() else []
    if entries:
        return "restart", f"compile cache {folder} holds {len(entries)} entries from earlier runs"
    kernels = list(inductor.iterdir()) if inductor.is_dir() else []
    if kernels:
        return "new-cache", (f"compile cache {folder} empty or absent; inductor's cache {inductor} holds "
                             f"{len(kernels)} entries (torch compiled on this machine before)")
    return "fresh", f"compile cache {folder} and inductor's cache {inductor} empty or absent"


def host_memory(server, weights_file: Path) -> dict:
    """The ComfyUI server's peak host RSS (the kernel's VmHWM: resident anonymous and file-backed pages, mmapped
    weights included) next to the size of the model's weights file."""
    out = {"weights_file_gib": round(weights_file.stat().st_size / 1024**3, 2) if weights_file.exists() else None}
    try:
        mem = server.memory_bytes()
    except (AttributeError, OSError) as e:
        return {**out, "server_peak_rss_gib": None, "why": f"cannot read the server's /proc status: {e}"}
    peak = mem.get("VmHWM", 0) / 1024**3
    out["server_peak_rss_gib"] = round(peak, 2) if peak else None
    out["server_rss_now_gib"] = round(mem["VmRSS"] / 1024**3, 2) if "VmRSS" in mem else None
    # now, by kind: anonymous (the process's own copies) and file-backed (mapped weights files: page cache)
    for kind in ("RssAnon", "RssFile"):
        if kind in mem:
            out[f"server_{kind[3:].lower()}_now_gib"] = round(mem[kind] / 1024**3, 2)
    if peak and out["weights_file_gib"]:
        out["peak_rss_over_weights"] = round(peak / out["weights_file_gib"], 2)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", choices=sorted(CASES), help="default: dev-1024-28 on a GPU, tiny-cpu without")
    ap.add_argument("--checkpoint", help="a real bf16 FLUX diffusion-model .safetensors to use instead of random weights")
    ap.add_argument("--runs", type=int, help="timed runs per config (default per case)")
    ap.add_argument("--suite", choices=sorted(WORKFLOWS), default=None,
                    help="fp8: eager vs FP8; compile: eager vs compiled bf16 and FP8 variants; core: core's "
                         "TorchCompileModel (bf16, fp8_e4m3fn_fast) vs FluxAccel's default and attention fp8, with "
                         "ComfyUI's default launch flags; quickstart-cpu: "
                         "Compile -> Warmup -> Benchmark, no FP8 (default: compile on a GPU, quickstart-cpu on the CPU; "
                         "fp8 on the CPU runs torchao's FP8 kernels there: a functional check, slower by design)")
    ap.add_argument("--out", help="folder for the results JSON (default: bench/results on a GPU, .cache/bench-results "
                                   "on the CPU, so that a CPU run leaves the tracked files alone)")
    ap.add_argument("--models-dir", default=str(ROOT / ".cache" / "models"), help="where random-weight models are cached")
    ap.add_argument("--server-arg", action="append", default=[], help="extra ComfyUI launch flag (repeatable)")
    ap.add_argument("--only", action="append",
                    help="run only the Benchmark nodes whose title contains this text (repeatable: any of them)")
    ap.add_argument("--log", help="copy the ComfyUI server log here when done (also on failure)")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[fluxaccel] %(message)s")

    gpu = _gpu()
    a.suite = a.suite or ("compile" if gpu else "quickstart-cpu")
    case_name = a.case or ("dev-1024-28" if gpu else "tiny-cpu")
    case = CASES[case_name]
    runs = a.runs or case["runs"]
    comfy_dir = host.import_comfy(host.ensure_host())
    models_dir = Path(a.models_dir)
    unet_dir = models_dir / "diffusion_models"
    unet_dir.mkdir(parents=True, exist_ok=True)
    if a.checkpoint:
        src = Path(a.checkpoint).resolve()
        unet_name = src.name
        link = unet_dir / unet_name
        if not link.exists():
            link.symlink_to(src)
        weights = f"checkpoint {src}"
    else:
        from fluxaccel.core.models.synthetic import write_flux_file

        unet_name = f"fluxaccel-random-{case['shape']}.safetensors"
        what = ("timings and memory match the real model, images do not"
                if case["shape"] in ("dev", "schnell", "klein-9b") else
                "FLUX's width with 1 double + 1 single block: a functional check, its timings are not a real model's")
        print(f"No --checkpoint given: building FLUX '{case['shape']}' architecture with seeded RANDOM weights "
              f"({unet_dir / unet_name}); {what}.", flush=True)
        write_flux_file(unet_dir / unet_name, case["shape"], device="cuda" if gpu else "cpu")
        if gpu:
            import torch

            torch.cuda.empty_cache()  # this client process keeps no GPU memory the server could use
        weights = f"random weights, FLUX shape '{case['shape']}'"

    server_args = list(a.server_arg)
    if gpu:
        server_args += [f for f in WORKFLOWS[a.suite][1] if f not in server_args]
    if not gpu:
        # No GPU: ComfyUI on the CPU in bf16; FP8 through torchao's real Float8Tensor path on the CPU (slow,
        # a functional demo, not a speedup; the server loads tools/cpu_fp8_node, which lifts torchao's GPU gate).
        server_args += list(host.CPU_SERVER_ARGS)
    prompt = build_prompt(case, unet_name, runs, a.suite)
    if a.only:
        prompt = only_benchmarks(prompt, a.only)
    out = Path(a.out) if a.out else ROOT / ("bench/results" if gpu else ".cache/bench-results")
    out.mkdir(parents=True, exist_ok=True)
    tag = "cpu" if not gpu else gpu.lower().replace(" ", "-")
    stem = f"{tag}-{case_name}" + ("" if a.suite == "fp8" else f"-{a.suite}")
    if a.only:
        stem += "-" + "".join(c if c.isalnum() else "-" for c in "-".join(a.only).lower()).strip("-")
    path = out / f"{stem}.json"  # the latest run; every run also keeps its own files under <stem>-<time>
    run_stem = out / f"{stem}-{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}"
    files: list[tuple[int, dict]] = []  # (node id, benchmark file), in completion order
    start, start_detail = server_start()
    memory: dict = {}  # the server's host memory, read while it runs (after each Benchmark node and before stop)
    kept: list[str] = []  # each Benchmark node's table and chart, copied next to the run's JSON

    def write(complete: bool) -> list[dict]:
        rows = merge_results([f for _, f in sorted(files, key=lambda x: x[0])])
        result = {
            "case": case_name,
            "suite": a.suite,
            "gpu": gpu or "cpu",
            "command": "python tools/bench.py " + " ".join(shlex.quote(x) for x in (argv if argv is not None else sys.argv[1:])),
            "env": files[0][1]["env"],
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "weights": weights,
            "settings": {**case, "runs": runs, "server_args": server_args},
            "complete": complete,
            "start": start,
            "start_detail": start_detail,
            "host_memory": memory,
            "results": rows,
        }
        from fluxaccel.core.bench.results import dumps

        for target in (path, run_stem.with_suffix(".json")):
            target.write_text(dumps(result))
        return rows
    from tqdm import tqdm

    with tempfile.TemporaryDirectory(prefix="fluxaccel-bench-") as work:
        server = ComfyServer(comfy_dir, Path(work), models_dir, tuple(server_args), cpu_fp8=not gpu)
        try:
            server.start()
            bars: dict[str, tqdm] = {}
            titles = {k: v.get("_meta", {}).get("title", v["class_type"]) for k, v in prompt.items()}

            def on_event(kind: str, data: dict) -> None:
                if kind == "executed":  # a Benchmark node finished: record its rows now (partial results survive)
                    for rel in (data.get("output") or {}).get("fluxaccel_json", []):
                        src = server.output_dir / rel
                        bench_file = json.loads(src.read_text())
                        files.append((int(data["node"]), bench_file))
                        memory.update(host_memory(server, unet_dir / unet_name))
                        for kind, name in (bench_file.get("files") or {}).items():
                            if kind in ("md", "png"):
                                dest = f"{run_stem.name}-node{data['node']}.{kind}"
                                (out / dest).write_bytes((src.parent / name).read_bytes())
                                kept.append(dest)
                        write(complete=False)
                if kind == "executing" and data.get("node"):
                    tqdm.write(f"running: {titles.get(data['node'], data['node'])}")
                elif kind == "progress":
                    node = data.get("node")
                    bar = bars.get(node)
                    if bar is None:
                        # no rate: a Benchmark's steps include its first runs (compile) and the eager ones, so
                        # tqdm's average would be no model's s/step; the table below has the measured ones
                        bar = bars[node] = tqdm(total=data["max"], desc=titles.get(node, node), unit="step",
                                                bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} "
                                                           "steps [{elapsed}]")
                    bar.n = data["value"]
                    bar.refresh()

            server.run_following(prompt, on_event)
            for bar in bars.values():
                bar.close()
        finally:
            if server.proc is not None and server.proc.poll() is None:
                memory.update(host_memory(server, unet_dir / unet_name))
            server.stop()
            if Path(server.log_path).is_file():  # kept with the run's results
                shutil.copy(server.log_path, run_stem.with_suffix(".log"))
            if a.log:
                shutil.copy(server.log_path, a.log)
    if not files:
        raise SystemExit("the workflow produced no benchmark results; see the ComfyUI log above")
    rows = write(complete=True)
    print()
    print(f"FluxAccel benchmark, case {case_name} on {gpu or 'CPU'} ({weights}):")
    from fluxaccel.core.bench.benchmark import markdown_rows

    print(markdown_rows(rows))
    print(f"\nwrote {path} and, for this run, {run_stem.name}.json, .log"
          + (f", {', '.join(kept)}" if kept else "") + f" in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
