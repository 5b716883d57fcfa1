"""Which ComfyUI launch flags make the CPU quickstart fastest, and what each computes in.

    python bench/probes/cpu_quickstart_flags.py --out .cache/bench-results

For each flag set: a new ComfyUI server (empty FluxAccel and inductor caches, as a new user's), the shipped CPU quickstart API
workflow, its prompt time from ComfyUI's own timestamps (execution_start -> execution_success), the Benchmark's rows
(labels say the dtype computed) and its speedup. Writes cpu-quickstart-flags.json.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tools.plugin import register  # noqa: E402  (the plugin as the package fluxaccel)
register()

from tools import host  # noqa: E402
from tools.comfy_server import ComfyServer  # noqa: E402

FLAG_SETS = (("--cpu",), ("--cpu", "--use-pytorch-cross-attention"),
             ("--cpu", "--bf16-unet", "--use-pytorch-cross-attention"))


def prompt_seconds(hist: dict) -> float:
    ts = {m[0]: m[1]["timestamp"] for m in hist["status"]["messages"] if "timestamp" in m[1]}
    return (ts["execution_success"] - ts["execution_start"]) / 1000


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / ".cache" / "bench-results"))
    a = ap.parse_args(argv)
    from fluxaccel.core.models.synthetic import write_flux_file

    comfy = host.import_comfy(host.ensure_host())
    models = ROOT / ".cache" / "models"
    write_flux_file(models / "diffusion_models" / "fluxaccel-random-e2e.safetensors", "e2e")
    prompt = json.loads((ROOT / "example_workflows" / "api" / "fluxaccel_quickstart_cpu.json").read_text())
    rows = []
    for flags in FLAG_SETS:
        with tempfile.TemporaryDirectory() as work:
            env = {"FLUXACCEL_CACHE_DIR": str(Path(work) / "cache"), "TORCHINDUCTOR_CACHE_DIR": str(Path(work) / "inductor")}
            with ComfyServer(comfy, Path(work), models, flags, env=env) as srv:
                hist = srv.run(prompt)
                bench = json.loads((srv.output_dir / hist["outputs"]["5"]["fluxaccel_json"][0]).read_text())
        res = bench["results"]
        rows.append({"flags": " ".join(flags), "prompt_s": round(prompt_seconds(hist), 2),
                     "configs": [r["config"] for r in res], "speedup": round(res[-1]["speedup_vs_baseline"], 3),
                     "s_per_image": [round(r["s_per_image_median"], 4) for r in res]})
        print(rows[-1], flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"command": "python bench/probes/cpu_quickstart_flags.py " + " ".join(argv or sys.argv[1:]),
              "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "comfyui": host.comfy_version(comfy), "start": "a new server per flag set, empty FluxAccel and inductor caches (a new user)",
              "rows": rows}
    from fluxaccel.core.bench.results import dumps

    (out / "cpu-quickstart-flags.json").write_text(dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
