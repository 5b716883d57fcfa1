"""The first image as a user waits for it: each configuration's first and second prompt in one real ComfyUI server,
timed by ComfyUI itself (its execution_start → execution_success timestamps), load and quantize included.

    python tools/first_prompts.py --case klein9b-1024-4                 # FluxAccel default first, then core eager
    python tools/first_prompts.py --case dev-1024-28 --configs fluxaccel eager torchcompile --restart

Each prompt is UNETLoader → [Quantize FP8 → Compile (→ Warmup) | TorchCompileModel] → KSampler → SaveLatent with synthetic
conditioning. The configurations run in the order given, in one server: the first one's first prompt is the server's
first (what a user meets after starting ComfyUI); later ones share ComfyUI's cached UNETLoader output, as a user's
second workflow on the same server would. The second prompt of each (another seed) is its steady state. The JSON says
how the server started ("fresh": no compile cache; "restart": one from earlier runs) and the server's peak host RSS.
With --restart ComfyUI is then started again on the same machine and the configurations run again (a second JSON).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import shlex
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tools.plugin import register  # noqa: E402  (the plugin as the package fluxaccel)
register()

from tools import host  # noqa: E402
from tools.bench import CASES, host_memory, server_start  # noqa: E402
from tools.comfy_server import ComfyServer  # noqa: E402

log = logging.getLogger("fluxaccel.first_prompts")

# FluxAccel's default nodes; each configuration below changes some of their inputs (None: the node left out)
FP8 = {"granularity": "per_row", "scope": "blocks", "layout": "plain"}
COMPILE = {"cuda_graphs": True, "mode": "default", "resolution_policy": "strict", "max_shapes": 4,
           "persistent_cache": True, "block_regions": True}
STATIC_WARMUP = ("9", "FluxAccelWarmup", {"batch_size": 1, "cfg": 1.0, "activation_scales": "static",
                                          "positive": ["2", 0]})


def fluxaccel(fp8: dict | None = None, warmup: tuple | None = None, **compile_inputs) -> list:
    """Quantize FP8 → Compile (→ Warmup), the defaults with these inputs changed."""
    return [("5", "FluxAccelQuantizeFP8", {**FP8, **(fp8 or {})}),
            ("6", "FluxAccelCompile", {**COMPILE, **compile_inputs}), *([warmup] if warmup else [])]


CONFIGS = {
    # name: the nodes between UNETLoader ("1") and the KSampler, as (id, class, inputs with "MODEL" for the model)
    "fluxaccel": fluxaccel(),
    "fastest": fluxaccel({"scope": "blocks+modulation"}, block_regions=False),
    # the default without CUDA graphs (what graph_capture "inductor" runs under cudaMallocAsync)
    "graphs-off": fluxaccel(cuda_graphs=False),
    # graph_capture "call" set explicitly (what the default, "auto", runs on a GPU with a C++ compiler): blocks
    # compiled on their own, each model call captured (any allocator)
    "graphs-call": fluxaccel(graph_capture="call"),
    # inductor's CUDA graph trees over the whole-model compile (graphs off under cudaMallocAsync, said)
    "graphs-inductor": fluxaccel(graph_capture="inductor"),
    # the default and graphs-call with ComfyUI's own (blocking) copy of the sampler's CPU inputs at every call
    "fluxaccel-unstaged": fluxaccel(stage_inputs=False),
    "graphs-call-unstaged": fluxaccel(graph_capture="call", stage_inputs=False),
    # the compile in the first prompt, without FluxAccel's compile cache
    "fluxaccel-inprompt": fluxaccel(persistent_cache=False, separate_process=False),
    # the default with the MLP's GELU kept apart from its FP8 quantization (inductor's fused reduction instead)
    "gelu-separate": fluxaccel({"fuse_gelu": False}),
    # FLUX.2: the default with the SiLU-gated MLPs' gate kept apart from its FP8 quantization (inductor's reduction)
    "silu-separate": fluxaccel({"fuse_silu_gate": False}),
    # the default with ComfyUI's single-block forward (linear2's concatenated input written before the fused kernel)
    "single-concat": fluxaccel(single_blocks="comfyui"),
    "tuned": fluxaccel(mode="tuned-kernels"),
    "fp8attn": fluxaccel(attention="fp8"),
    # every block modulation computed once per prompt for all of the sampler's sigmas (Compile's modulation_table,
    # "auto" by default: on for FLUX.1), and the default and attention fp8 without it
    "modtable": fluxaccel(modulation_table="on"),
    "fp8attn-modtable": fluxaccel(attention="fp8", modulation_table="on"),
    "fluxaccel-notable": fluxaccel(modulation_table="off"),
    # the default with its module swaps as one object patch per module instead of per block (needs --split: the node
    # is tools/prompt_split_node's)
    "fluxaccel-per-module": [*fluxaccel(), ("10", "FluxAccelPerModulePatches", {})],
    "fp8attn-notable": fluxaccel(attention="fp8", modulation_table="off"),
    # the per-step levers together: coordinate-descent tuning and FP8 attention, then FP8 modulation weights too
    "tuned-fp8attn": fluxaccel(mode="tuned-kernels", attention="fp8"),
    "mod-tuned-fp8attn": fluxaccel({"scope": "blocks+modulation"}, mode="tuned-kernels", attention="fp8"),
    "mod-tuned": fluxaccel({"scope": "blocks+modulation"}, mode="tuned-kernels"),
    # Warmup's static activation scales (calibrated over the case's steps on the prompt's conditioning, node "2")
    "static": fluxaccel(warmup=STATIC_WARMUP),
    "static-fp8attn": fluxaccel(warmup=STATIC_WARMUP, attention="fp8"),
    "eager": [],
    "torchcompile": [("5", "TorchCompileModel", {"backend": "inductor"})],
    # core's fp8_e4m3fn_fast + TorchCompileModel: the loader with weight_dtype fp8_e4m3fn_fast (its own node, "1f")
    "fp8fast-torchcompile": [("5", "TorchCompileModel", {"backend": "inductor"})],
}
FP8_FAST = {"fp8fast-torchcompile"}
PROFILE_KEYS = ("python", "torch", "kernels", "kernel_classes", "kernels_total_ms", "kernel_launches")


def prompt_for(config: str, case: dict, unet_name: str, seed: int, flux2: bool, in_memory: bool = False) -> dict:
    """One configuration's prompt; node ids are shared between configurations so ComfyUI's cache reuses the loader.
    in_memory: the tools-only FluxAccelRandomModelInMemory instead of UNETLoader (no file)."""
    def loader(dtype: str) -> dict:
        if in_memory:
            return {"class_type": "FluxAccelRandomModelInMemory",
                    "inputs": {"shape": case["shape"], "seed": 0, "weight_dtype": dtype}}
        return {"class_type": "UNETLoader", "inputs": {"unet_name": unet_name, "weight_dtype": dtype}}

    p = {
        "1": loader("default"),
        "2": {"class_type": "FluxAccelSyntheticConditioning",
              "inputs": {"model": ["1", 0], "text_length": case["text_length"], "guidance": 3.5, "seed": 0}},
        "3": {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["2", 0]}},
        "4": {"class_type": "EmptyFlux2LatentImage" if flux2 else "EmptySD3LatentImage",
              "inputs": {"width": case["width"], "height": case["height"], "batch_size": 1}},
    }
    model = ["1", 0]
    if config in FP8_FAST:
        p["1f"] = loader("fp8_e4m3fn_fast")
        model = ["1f", 0]
    for nid, cls, inputs in CONFIGS[config]:
        if cls == "FluxAccelWarmup":  # warmed (and calibrated) at the case's size, steps and text length
            inputs = {**inputs, "resolutions": f"{case['width']}x{case['height']}", "steps": case["steps"],
                      "text_length": case["text_length"]}
        p[f"{config}-{nid}"] = {"class_type": cls, "inputs": {"model": model, **inputs}}
        model = [f"{config}-{nid}", 0]
    p["7"] = {"class_type": "KSampler", "inputs": {
        "model": model, "seed": seed, "steps": case["steps"], "cfg": 1.0, "sampler_name": "euler",
        "scheduler": "simple", "positive": ["2", 0], "negative": ["3", 0], "latent_image": ["4", 0], "denoise": 1.0}}
    p["8"] = {"class_type": "SaveLatent", "inputs": {"samples": ["7", 0], "filename_prefix": f"first-{config}"}}
    return p


def latent_rel_err(latents: dict, config: str, reference: str) -> float | None:
    """‖a − b‖ / ‖b‖ of two configurations' saved latents (float32)."""
    from fluxaccel.core.bench.metrics import rel_err

    if config not in latents or reference not in latents:
        return None
    return round(float(rel_err(latents[config].float(), latents[reference].float())), 6)


def execution_seconds(hist: dict) -> float:
    """ComfyUI's own time for a prompt: its execution_start → execution_success timestamps (milliseconds)."""
    stamps = {m[0]: m[1].get("timestamp") for m in hist["status"]["messages"]}
    return (stamps["execution_success"] - stamps["execution_start"]) / 1000


def node_text(hist: dict, node: str) -> str | None:
    """The text a node showed in the editor for this prompt (its PreviewText), or None where it showed none: the
    Compile node's says what it compiled and whatever runs below what was asked (e.g. graph_capture auto's choice)."""
    text = ((hist.get("outputs") or {}).get(node) or {}).get("text")
    return "\n".join(map(str, text)) if text else None


def split_summary(lines: list[dict]) -> dict:
    """The median of the steady prompts' splits (tools/prompt_split_node), with where the GPU waited: before the
    first model call, between calls, and how long the prompt went on after the GPU had ended the last call."""
    med = lambda xs: round(statistics.median(xs), 5) if xs else None  # noqa: E731
    out = {k: med([x[k] for x in lines]) for k in ("prompt_s", "sample_s", "load_models_gpu_s", "calls_host_s")}
    out["model_calls"] = med([x["model_calls"] for x in lines])
    out["nodes_s"] = {c: med([x["nodes_s"].get(c, 0.0) for x in lines]) for c in lines[0]["nodes_s"]} if lines else {}
    gpu = [x for x in lines if x["gpu"] and x["gpu"]["first_call_start_s"] is not None]
    if gpu:
        out["gpu_calls_s"] = med([x["gpu"]["calls_s"] for x in gpu])
        out["gpu_idle_before_first_call_s"] = med([x["gpu"]["first_call_start_s"] for x in gpu])
        out["gpu_idle_between_calls_s"] = med([x["gpu"]["last_call_end_s"] - x["gpu"]["first_call_start_s"]
                                               - x["gpu"]["calls_s"] for x in gpu])
        out["after_last_call_s"] = med([x["prompt_s"] - x["gpu"]["last_call_end_s"] for x in gpu])
    else:
        out["gpu"] = "no CUDA device: the GPU's side cannot be told"
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", choices=sorted(CASES), default=None, help="default: dev-1024-28 on a GPU, tiny-cpu without")
    ap.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=["fluxaccel", "eager"])
    ap.add_argument("--out", help="folder for the JSON (default: bench/results on a GPU, .cache/bench-results on the CPU)")
    ap.add_argument("--models-dir", default=str(ROOT / ".cache" / "models"))
    ap.add_argument("--steady", type=int, default=0, metavar="N",
                    help="then N more prompts of each configuration (other seeds): their times and median, the steady "
                         "state measured more than once")
    ap.add_argument("--server-arg", action="append", default=[], help="extra ComfyUI launch flag (repeatable)")
    ap.add_argument("--restart", action="store_true", help="then stop ComfyUI, start it again on the same machine "
                    "(its caches on disk) and run the configurations again: a second JSON with start 'restart'")
    ap.add_argument("--split", action="store_true", help="the server also loads tools/prompt_split_node: each steady "
                    "prompt's time split into its nodes, the sampler, the model calls and the GPU's idle time")
    ap.add_argument("--profile", action="store_true", help="with --split: the steady prompts also run under cProfile "
                    "and torch.profiler (the last one's tables in the JSON); their times are then the profilers' too")
    ap.add_argument("--profile-extra", action="store_true", help="with --split: one more prompt of each configuration "
                    "after its steady ones, under cProfile and torch.profiler (the GPU's kernels too): its tables in "
                    "the JSON, the steady prompts' times unprofiled")
    ap.add_argument("--in-memory", action="store_true", help="build the random weights in the server's memory "
                    "(tools/memory_model_node) instead of a file UNETLoader reads: for shapes whose file does not fit "
                    "the disk (FLUX.2 [dev])")
    a = ap.parse_args(argv)
    if (a.profile or a.profile_extra) and not a.split:
        ap.error("--profile and --profile-extra need --split (the profiles are taken inside the server)")
    if "fluxaccel-per-module" in a.configs and not a.split:
        ap.error("fluxaccel-per-module needs --split (its node is tools/prompt_split_node's)")
    logging.basicConfig(level=logging.INFO, format="[fluxaccel] %(message)s")
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    case_name = a.case or ("dev-1024-28" if gpu else "tiny-cpu")
    case = CASES[case_name]
    comfy_dir = host.import_comfy(host.ensure_host())
    from fluxaccel.core.models.synthetic import SHAPES, write_flux_file

    unet_dir = Path(a.models_dir) / "diffusion_models"
    unet_name = f"fluxaccel-random-{case['shape']}.safetensors"
    if not a.in_memory:
        write_flux_file(unet_dir / unet_name, case["shape"], device="cuda" if gpu else "cpu")
    if gpu:
        torch.cuda.empty_cache()
    flux2 = SHAPES[case["shape"]]["image_model"] == "flux2"
    server_args = list(a.server_arg) + ([] if gpu else list(host.CPU_SERVER_ARGS))
    out = Path(a.out) if a.out else ROOT / ("bench/results" if gpu else ".cache/bench-results")
    out.mkdir(parents=True, exist_ok=True)
    tag = "cpu" if not gpu else gpu.lower().replace(" ", "-")
    command = "python tools/first_prompts.py " + " ".join(shlex.quote(x) for x in (argv if argv is not None else sys.argv[1:]))
    meta = {"case": case_name, "gpu": gpu or "cpu", "command": command, "comfyui": host.comfy_version(comfy_dir),
            "torch": torch.__version__, "weights": f"random weights, FLUX shape '{case['shape']}'",
            "settings": {**case, "server_args": server_args},
            "order": "configurations in this order in one server; later ones reuse ComfyUI's cached UNETLoader output"}
    start, start_detail = server_start()
    for n in range(2 if a.restart else 1):
        if n:  # the same machine, ComfyUI started again: caches on disk, nothing in the process
            start, start_detail = "restart", f"ComfyUI restarted on the machine of the run before ({server_start()[1]})"
        configs = "" if a.configs == ["fluxaccel", "eager", "torchcompile"] else "-" + "-".join(a.configs)
        path = out / f"{tag}-{case_name}-first-prompts{configs}-{start}.json"
        one_server(comfy_dir, a, case, unet_name, flux2, server_args, path,
                   {**meta, "start": start, "start_detail": start_detail})
    return 0


def one_server(comfy_dir, a, case, unet_name, flux2, server_args, path, meta) -> None:
    """Start ComfyUI, run each configuration's first and second prompt, write the JSON after each; stop it."""
    rows, memory, latents = [], {}, {}
    unet_file = Path(a.models_dir) / "diffusion_models" / unet_name

    def write(complete: bool) -> None:  # after every configuration: a run cut short keeps what it measured
        path.write_text(json.dumps({
            **meta, "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "complete": complete, "host_memory": memory, "results": rows}, indent=1) + "\n")
        if server.log_path.exists():  # ComfyUI's own log next to the JSON (what each node said), so far
            shutil.copy(server.log_path, path.with_suffix(".comfyui.log"))

    with tempfile.TemporaryDirectory(prefix="fluxaccel-first-") as work:
        profile_flag = Path(work) / "profile-now"  # --profile-extra: a prompt starting while it exists is profiled
        profile_env = ({"FLUXACCEL_PROMPT_PROFILE": "1"} if a.profile else
                       {"FLUXACCEL_PROMPT_PROFILE": str(profile_flag)} if a.profile_extra else None)
        server = ComfyServer(comfy_dir, Path(work), Path(a.models_dir), tuple(server_args), cpu_fp8=meta["gpu"] == "cpu",
                             memory_model=a.in_memory, timestamps=True,
                             prompt_split=Path(work) / "prompt-split.jsonl" if a.split else None,
                             env=profile_env)
        try:
            server.start()
            for config in a.configs:
                times, separate = [], {}
                for seed in (1, 2, 3):
                    if seed == 3 and not separate:
                        break
                    log.info("%s: prompt %d", config, seed)
                    prompt = prompt_for(config, case, unet_name, seed, flux2, a.in_memory)
                    log_at = server.log_path.stat().st_size if server.log_path.exists() else 0
                    hist = server.run(prompt, timeout=1800)
                    times.append(execution_seconds(hist))
                    if seed == 2:  # the same seed in every configuration: their images are compared
                        latents[config] = server.saved_latent(hist, "8")
                    if seed == 1:  # a separate-process compile started by this prompt: wait until it has ended
                        separate = next(iter(server.separate_compiles(since=log_at)), {})
                        compile_text = node_text(hist, f"{config}-6")  # the Compile node's text, where there is one
                steady, splits = [], []
                for seed in range(11, 11 + a.steady):
                    log.info("%s: steady prompt (seed %d)", config, seed)
                    hist = server.run(prompt_for(config, case, unet_name, seed, flux2, a.in_memory), timeout=1800)
                    steady.append(execution_seconds(hist))
                    if a.split:
                        splits.append(server.prompt_split_of(hist))
                profiled = None
                if a.profile_extra:  # (--split is required with it)
                    log.info("%s: one more prompt, profiled", config)
                    profile_flag.touch()
                    try:
                        hist = server.run(prompt_for(config, case, unet_name, 99, flux2, a.in_memory), timeout=1800)
                    finally:
                        profile_flag.unlink()
                    profiled = {"prompt_s_under_profilers": round(execution_seconds(hist), 3),
                                **(server.prompt_split_of(hist) or {})}
                memory.update(host_memory(server, unet_file))
                if a.in_memory and memory.get("server_peak_rss_gib"):  # no file: the weights' bf16 size instead
                    from fluxaccel.core.models.synthetic import param_count

                    memory["weights_in_memory_gib"] = round(param_count(case["shape"]) * 2 / 1024**3, 2)
                    memory["peak_rss_over_weights"] = round(memory["server_peak_rss_gib"] / memory["weights_in_memory_gib"], 2)
                rows.append({"config": config, **({"compile_text": compile_text} if compile_text else {}),
                             "first_prompt_s": round(times[0], 3), "second_prompt_s": round(times[1], 3),
                             # with a separate-process compile: the first prompt ran uncompiled; the second (queued
                             # once the compile was ready) loads its package, the third is the steady state
                             **({"third_prompt_s": round(times[2], 3), **separate} if separate else {}),
                             **({"steady_prompts_s": [round(t, 3) for t in steady],
                                 "steady_median_s": round(statistics.median(steady), 3)} if steady else {}),
                             **({"steady_split": split_summary([x for x in splits if x]),
                                 "steady_splits": [{k: v for k, v in x.items() if k not in PROFILE_KEYS}
                                                   for x in splits if x],
                                 "last_steady_profile": {k: splits[-1].get(k) for k in PROFILE_KEYS}
                                 if a.profile and splits[-1] else None} if splits else {}),
                             # --profile-extra: the profiled prompt after the steady ones (split and tables)
                             **({"profiled_prompt": profiled} if profiled else {}),
                             # the kernel's high-water mark so far: what this configuration's prompts added to the peak
                             "server_peak_rss_gib_so_far": memory.get("server_peak_rss_gib"),
                             "server_anon_now_gib": memory.get("server_anon_now_gib"),
                             "server_file_now_gib": memory.get("server_file_now_gib"),
                             # the second prompt's latent (same seed in every configuration) against the first
                             # configuration's: how far this configuration's image is from it
                             "second_latent_rel_err_vs_first_config": latent_rel_err(latents, config, a.configs[0])})
                write(complete=False)
        finally:
            server.stop()
        write(complete=True)
    for r in rows:
        print(f"{r['config']:>14}: first prompt {r['first_prompt_s']:.2f} s, second {r['second_prompt_s']:.2f} s")
    print(f"({meta['start']}: {meta['start_detail']}; peak host RSS {memory.get('server_peak_rss_gib')} GiB) wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
