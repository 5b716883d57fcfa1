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
FP8 = {"granularity": "per_row", "scope": "blocks"}
COMPILE = {"resolution_policy": "recompile"}


def fluxaccel(fp8: dict | None = None, **compile_inputs) -> list:
    """Quantize FP8 → Compile, the defaults with these inputs changed."""
    return [("5", "FluxAccelQuantizeFP8", {**FP8, **(fp8 or {})}), ("6", "FluxAccelCompile", {**COMPILE, **compile_inputs})]


CONFIGS = {
    # name: the nodes between UNETLoader ("1") and the KSampler, as (id, class, inputs with "MODEL" for the model)
    "fluxaccel": fluxaccel(),
    "fp8attn": fluxaccel(attention="fp8"),
    "tuned": fluxaccel(mode="tuned-kernels"),
    "modulation": fluxaccel({"scope": "blocks+modulation"}),
    # Quantize FP8 -> Parallel (each model call's tokens over N GPUs), for machines with several
    "parallel2": [("5", "FluxAccelQuantizeFP8", FP8), ("6", "FluxAccelParallel", {"gpus": 2})],
    "parallel4": [("5", "FluxAccelQuantizeFP8", FP8), ("6", "FluxAccelParallel", {"gpus": 4})],
    "eager": [],
    "torchcompile": [("5", "TorchCompileModel", {"backend": "inductor"})],
    # core's fp8_e4m3fn_fast + TorchCompileModel: the loader with weight_dtype fp8_e4m3fn_fast (its own node, "1f")
    "fp8fast-torchcompile": [("5", "TorchCompileModel", {"backend": "inductor"})],
}
FP8_FAST = {"fp8fast-torchcompile"}


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
    Compile node's says what runs here (e.g. whether calls are captured into CUDA graphs, and why not)."""
    text = ((hist.get("outputs") or {}).get(node) or {}).get("text")
    return "\n".join(map(str, text)) if text else None


def machine_and_case(case_name: str | None) -> tuple:
    """(the GPU's name or None, the case's name, the case, ComfyUI's folder): the case dev-1024-28 on a GPU and
    tiny-cpu without, unless one is named."""
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    case_name = case_name or ("dev-1024-28" if gpu else "tiny-cpu")
    return gpu, case_name, CASES[case_name], host.import_comfy(host.ensure_host())


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
    ap.add_argument("--in-memory", action="store_true", help="build the random weights in the server's memory "
                    "(tools/memory_model_node) instead of a file UNETLoader reads: for shapes whose file does not fit "
                    "the disk (FLUX.2 [dev])")
    ap.add_argument("--dynamic-tokens", action="store_true", help="the server compiles each block kind once for every "
                    "token count ($FLUXACCEL_DYNAMIC_TOKENS=1): the A/B against per-shape compiles")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[fluxaccel] %(message)s")
    import torch

    gpu, case_name, case, comfy_dir = machine_and_case(a.case)
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
            "settings": {**case, "server_args": server_args,
                         "server_env": {"FLUXACCEL_DYNAMIC_TOKENS": "1"} if a.dynamic_tokens else {}},
            "order": "configurations in this order in one server; later ones reuse ComfyUI's cached UNETLoader output"}
    start, start_detail = server_start()
    for n in range(2 if a.restart else 1):
        if n:  # the same machine, ComfyUI started again: caches on disk, nothing in the process
            start, start_detail = "restart", f"ComfyUI restarted on the machine of the run before ({server_start()[1]})"
        configs = ("" if a.configs == ["fluxaccel", "eager", "torchcompile"] else "-" + "-".join(a.configs)) + \
            ("-dynamic-tokens" if a.dynamic_tokens else "")
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
        server = ComfyServer(comfy_dir, Path(work), Path(a.models_dir), tuple(server_args), cpu_fp8=meta["gpu"] == "cpu",
                             memory_model=a.in_memory, timestamps=True,
                             env={"FLUXACCEL_DYNAMIC_TOKENS": "1"} if a.dynamic_tokens else None)
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
                steady = []
                for seed in range(11, 11 + a.steady):
                    log.info("%s: steady prompt (seed %d)", config, seed)
                    hist = server.run(prompt_for(config, case, unet_name, seed, flux2, a.in_memory), timeout=1800)
                    steady.append(execution_seconds(hist))
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
                             # the kernel's high-water mark so far: what this configuration's prompts added to the peak
                             "server_peak_rss_gib_so_far": memory.get("server_peak_rss_gib"),
                             "server_anon_now_gib": memory.get("server_anon_now_gib"),
                             "server_file_now_gib": memory.get("server_file_now_gib"),
                             # the second prompt's latent (same seed in every configuration) against the first
                             # configuration's: how far this configuration's image is from it
                             "second_latent_rel_err_vs_first_config": latent_rel_err(latents, config, a.configs[0])})
                write(complete=False)
        except BaseException:
            write(complete=False)  # a run cut short keeps what it measured, and the server's log says why
            raise
        finally:
            server.stop()
        write(complete=True)
    for r in rows:
        print(f"{r['config']:>14}: first prompt {r['first_prompt_s']:.2f} s, second {r['second_prompt_s']:.2f} s")
    print(f"({meta['start']}: {meta['start_detail']}; peak host RSS {memory.get('server_peak_rss_gib')} GiB) wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
