"""Write a FLUX.1 diffusion-model file with seeded random weights, loadable by ComfyUI's UNETLoader: what the CPU
quickstart workflow (example_workflows/fluxaccel_quickstart_cpu.json) and the tests load.

    python tools/random_model.py --comfyui /path/to/ComfyUI            # the "e2e" shape, ~10 MB, a second
    python tools/random_model.py --comfyui /path/to/ComfyUI --shape dev  # FLUX.1-dev's shape, 24 GB

Shapes: 'e2e' (FLUX at width 256, 1 double + 1 single block: runs on a CPU in well under a second per step), 'dev' and
'schnell' (the real architectures: their speed and memory are the real models', their images are noise). The file
goes to <ComfyUI>/models/diffusion_models/fluxaccel-random-<shape>.safetensors; an existing file is kept.
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tools.plugin import register  # noqa: E402  (the plugin as the package fluxaccel)
register()

log = logging.getLogger("fluxaccel.random_model")


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--comfyui", type=Path, required=True, help="the ComfyUI folder (its FLUX code builds the file)")
    ap.add_argument("--shape", choices=("e2e", "dev", "schnell"), default="e2e")
    a = ap.parse_args()
    if not (a.comfyui / "comfy" / "ldm" / "flux").is_dir():
        log.error("%s is not a ComfyUI folder (no comfy/ldm/flux in it)", a.comfyui)
        return 2
    from tools import host

    host.import_comfy(a.comfyui.resolve())
    from fluxaccel.core.models.synthetic import write_flux_file

    path = a.comfyui / "models" / "diffusion_models" / f"fluxaccel-random-{a.shape}.safetensors"
    existed = path.exists()
    write_flux_file(path, a.shape)
    log.info("%s %s (random weights: a functional and speed check, not images)", "kept" if existed else "wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
