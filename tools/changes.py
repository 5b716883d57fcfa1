"""What a user waits for while changing things: in one real ComfyUI server, each configuration through a sequence of
changes, every prompt timed by ComfyUI itself (its execution_start -> execution_success timestamps).

    python tools/changes.py --sequence lora --case dev-1024-28 --configs fluxaccel eager torchcompile
    python tools/changes.py --sequence resolutions --case dev-1024-28 --configs fluxaccel eager torchcompile
    python tools/changes.py --sequence lora --repeat 20 --configs fluxaccel      # twenty changes in a row
    python tools/changes.py --sequence lora --lora-after-quantize --configs fluxaccel   # LoRA after Quantize FP8
    python tools/changes.py --sequence resolutions --configs fluxaccel --dynamic-tokens   # one compile, every size

lora: UNETLoader -> LoraLoaderModelOnly (a random rank-16 LoRA on every block Linear, written for the case's shape)
-> the configuration's nodes -> KSampler. The steps: strength 1.0 (the steady state), 0.5, 1.0, 0.75, a second LoRA
instead (swap), both chained (stack), none (removed); with --repeat N, N changes alternating 1.0 and 0.5.
resolutions: 1024x1024 (the steady state), 832x1216, 1216x832, 896x1152, 1344x768, at the case's steps.

At each step: the first prompt after the change, then (after any separate compile it started has ended) one more at
the same setting with another seed: that setting's steady prompt. After each step: ComfyUI's VRAM in use
(/system_stats) and the server's host RSS. The JSON says how the server started and the exact command; ComfyUI's
log lies next to it.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
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
from tools.bench import CASES, server_start  # noqa: E402
from tools.comfy_server import ComfyServer  # noqa: E402
from tools.first_prompts import CONFIGS, execution_seconds, machine_and_case, prompt_for  # noqa: E402

log = logging.getLogger("fluxaccel.changes")

LORAS = ("fluxaccel-random-lora-a.safetensors", "fluxaccel-random-lora-b.safetensors")
SIZES = ((1024, 1024), (832, 1216), (1216, 832), (896, 1152), (1344, 768))


def lora_steps(repeat: int) -> list[tuple[str, list]]:
    """(label, [(LoRA file, strength), ...] chained in this order) for each step."""
    a, b = LORAS
    if repeat:
        return [("steady", [(a, 1.0)])] + [(f"change {i + 1}", [(a, 0.5 if i % 2 == 0 else 1.0)]) for i in range(repeat)]
    return [("steady", [(a, 1.0)]), ("strength 1.0 -> 0.5", [(a, 0.5)]), ("strength 0.5 -> 1.0", [(a, 1.0)]),
            ("strength 1.0 -> 0.75", [(a, 0.75)]), ("swap", [(b, 1.0)]), ("stack", [(a, 1.0), (b, 0.8)]),
            ("remove", [])]


def size_steps(case: dict) -> list[tuple[str, tuple[int, int]]]:
    """(label, (width, height)) for each step: the sizes scaled to the case's first size (1024 for FLUX.1-dev)."""
    scale = case["width"] / 1024
    sizes = [(max(16, round(w * scale / 16) * 16), max(16, round(h * scale / 16) * 16)) for w, h in SIZES]
    return [("steady" if i == 0 else f"{w}x{h}", (w, h)) for i, (w, h) in enumerate(sizes)]


def with_loras(prompt: dict, loras: list, after_quantize: bool = False) -> dict:
    """The prompt with LoraLoaderModelOnly nodes chained after the loader (after_quantize: after Quantize FP8, where
    the configuration has it): the model every node took from there comes from the last of them (the conditioning
    node keeps the loader's, for its shapes)."""
    quantize = next((nid for nid, n in prompt.items() if n["class_type"] == "FluxAccelQuantizeFP8"), None)
    source = [quantize, 0] if after_quantize and quantize else ["1", 0]
    prev = source
    for i, (name, strength) in enumerate(loras):
        prompt[f"lora{i}"] = {"class_type": "LoraLoaderModelOnly",
                              "inputs": {"model": prev, "lora_name": name, "strength_model": strength}}
        prev = [f"lora{i}", 0]
    for nid, node in prompt.items():
        if not nid.startswith("lora") and node["class_type"] != "FluxAccelSyntheticConditioning" \
                and node["inputs"].get("model") == source:
            node["inputs"]["model"] = prev
    return prompt


def vram_used_gib(server) -> float | None:
    """ComfyUI's first device's memory in use (its /system_stats: total - free), or None where it reports none."""
    devices = server.get("/system_stats").get("devices") or []
    if not devices or not devices[0].get("vram_total"):
        return None
    d = devices[0]
    return round((d["vram_total"] - d["vram_free"]) / 1024**3, 3)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sequence", choices=("lora", "resolutions"), required=True)
    ap.add_argument("--case", choices=sorted(CASES), default=None, help="default: dev-1024-28 on a GPU, tiny-cpu without")
    ap.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=["fluxaccel", "eager", "torchcompile"])
    ap.add_argument("--repeat", type=int, default=0, metavar="N", help="lora: N strength changes in a row instead")
    ap.add_argument("--out", help="folder for the JSON (default: bench/results on a GPU, .cache/bench-results on the CPU)")
    ap.add_argument("--models-dir", default=str(ROOT / ".cache" / "models"))
    ap.add_argument("--lora-after-quantize", action="store_true",
                    help="lora: the LoRA nodes after Quantize FP8 instead of before it (configurations without it: "
                         "after the loader, as usual)")
    ap.add_argument("--dynamic-tokens", action="store_true", help="the server compiles each block kind once for every "
                    "token count ($FLUXACCEL_DYNAMIC_TOKENS=1): the A/B against per-shape compiles")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[fluxaccel] %(message)s")
    import torch

    gpu, case_name, case, comfy_dir = machine_and_case(a.case)
    from fluxaccel.core.models.synthetic import SHAPES, write_flux_file, write_lora_file

    models = Path(a.models_dir)
    unet_name = f"fluxaccel-random-{case['shape']}.safetensors"
    write_flux_file(models / "diffusion_models" / unet_name, case["shape"], device="cuda" if gpu else "cpu")
    for seed, name in enumerate(LORAS):
        write_lora_file(models / "loras" / f"{case['shape']}-{name}", case["shape"], seed=7 + seed)
    flux2 = SHAPES[case["shape"]]["image_model"] == "flux2"
    server_args = [] if gpu else list(host.CPU_SERVER_ARGS)
    out = Path(a.out) if a.out else ROOT / ("bench/results" if gpu else ".cache/bench-results")
    out.mkdir(parents=True, exist_ok=True)
    tag = "cpu" if not gpu else gpu.lower().replace(" ", "-")
    start, start_detail = server_start()
    seq = (f"{a.sequence}{a.repeat or ''}{'-after-quantize' if a.lora_after_quantize else ''}"
           f"{'-dynamic-tokens' if a.dynamic_tokens else ''}")
    path = out / f"{tag}-{case_name}-changes-{seq}-{'-'.join(a.configs)}-{start}.json"
    meta = {"case": case_name, "gpu": gpu or "cpu", "sequence": seq,
            "command": "python tools/changes.py " + " ".join(map(shlex.quote, argv if argv is not None else sys.argv[1:])),
            "comfyui": host.comfy_version(comfy_dir), "torch": torch.__version__, "start": start,
            "start_detail": start_detail, "weights": f"random weights, FLUX shape '{case['shape']}'",
            "settings": {**case, "server_args": server_args,
                         "server_env": {"FLUXACCEL_DYNAMIC_TOKENS": "1"} if a.dynamic_tokens else {}},
            "order": "configurations in this order in one server, each through every step"}
    rows = []

    def write(complete: bool) -> None:
        path.write_text(json.dumps({**meta, "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                                    "complete": complete, "results": rows}, indent=1) + "\n")
        if server.log_path.exists():  # ComfyUI's own log next to the JSON (what each node said)
            shutil.copy(server.log_path, path.with_suffix(".comfyui.log"))

    with tempfile.TemporaryDirectory(prefix="fluxaccel-changes-") as work:
        server = ComfyServer(comfy_dir, Path(work), models, tuple(server_args), cpu_fp8=not gpu, timestamps=True,
                             env={"FLUXACCEL_DYNAMIC_TOKENS": "1"} if a.dynamic_tokens else None)
        try:
            server.start()
            for config in a.configs:
                seed = 100
                steps = [(label, [(f"{case['shape']}-{n}", s) for n, s in loras]) for label, loras in
                         lora_steps(a.repeat)] if a.sequence == "lora" else size_steps(case)
                for label, setting in steps:
                    times = []
                    for again in (0, 1):  # the first prompt after the change, then that setting's steady prompt
                        seed += 1
                        prompt = prompt_for(config, case, unet_name, seed, flux2)
                        if a.sequence == "lora":
                            prompt = with_loras(prompt, setting, a.lora_after_quantize)
                        else:
                            prompt["4"]["inputs"].update(width=setting[0], height=setting[1])
                        log_at = server.log_path.stat().st_size if server.log_path.exists() else 0
                        times.append(execution_seconds(server.run(prompt, timeout=1800)))
                        if not again:  # a separate compile this prompt started: its steady prompt follows it
                            separate = next(iter(server.separate_compiles(since=log_at)), {})
                    rows.append({"config": config, "step": label, "setting": setting,
                                 "first_prompt_s": round(times[0], 3), "steady_prompt_s": round(times[1], 3),
                                 "over_steady_s": round(times[0] - times[1], 3), **separate,
                                 "vram_used_gib": vram_used_gib(server),
                                 "server_rss_gib": round(server.rss_bytes() / 1024**3, 3)})
                    log.info("%s %s: %.2f s, then %.2f s", config, label, times[0], times[1])
                    write(complete=False)
        except BaseException:
            write(complete=False)
            raise
        finally:
            server.stop()
        write(complete=True)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
