"""Obtain and prepare the ComfyUI host that FluxAccel's tests and main job run in.

Usage: python tools/host.py [--print-dir]

The host is ComfyUI 0.33.0 (dynamic VRAM, comfy-kitchen ops, cudaMallocAsync), found in this order:
  1. COMFYUI_DIR: the user's own ComfyUI folder, used as it is (whatever its version);
  2. its release archive (tag v0.33.0) at FLUXACCEL_COMFYUI_ARCHIVE, else ../shared/hosts/comfyui-0.33.0.tar.gz;
  3. the tagged release downloaded from GitHub, where the network allows.
An archive is unpacked to .cache/ComfyUI-0.33.0 (git-ignored) and checked to be 0.33.0 (its comfyui_version.py).

ComfyUI's requirements (plus `requests`, which it omits, and its "non essential" packages, so that it starts
without IMPORT FAILED lines) are installed into the running Python environment, except the torch family, which
the project pins itself; the plugin is linked into ComfyUI/custom_nodes/comfyui-fluxaccel. A second run only
checks. With FLUXACCEL_HOST_NO_INSTALL=1 (machines without a package index) missing requirements are reported.
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

log = logging.getLogger("fluxaccel.host")

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache"
VERSION = "0.33.0"
ARCHIVE_ENV = "FLUXACCEL_COMFYUI_ARCHIVE"
SHARED_ARCHIVE = ROOT.parent / "shared" / "hosts" / f"comfyui-{VERSION}.tar.gz"
RELEASE_URL = f"https://github.com/Comfy-Org/ComfyUI/archive/refs/tags/v{VERSION}.tar.gz"
PLUGIN_LINK_NAME = "comfyui-fluxaccel"
# bytecode is written on first import, for the modules a run imports (not ahead for every file of every package)
PIP_INSTALL = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-compile"]
# The torch family is pinned by the project (CPU build in CI, the image's build on a GPU). torchaudio is published
# only up to torch 2.11, but ComfyUI 0.33 imports it in comfy/sd.py: it is installed without its torch pin and
# checked to import (_ensure_torchaudio).
SKIP_REQS = {"torch", "torchvision", "torchaudio"}
EXTRA_REQS = ["requests"]


def comfy_dir() -> Path:
    env = os.environ.get("COMFYUI_DIR")
    if env:
        return Path(env).resolve()
    return CACHE / f"ComfyUI-{VERSION}"


def _archive() -> Path:
    """The release archive: FLUXACCEL_COMFYUI_ARCHIVE, the shared one, or GitHub's (downloaded into .cache/)."""
    env = os.environ.get(ARCHIVE_ENV)
    if env:
        if not Path(env).is_file():
            raise SystemExit(f"{ARCHIVE_ENV}={env} is not a file")
        return Path(env)
    if SHARED_ARCHIVE.is_file():
        return SHARED_ARCHIVE
    dest = CACHE / f"comfyui-v{VERSION}.tar.gz"
    if dest.is_file():
        return dest
    log.info("downloading ComfyUI %s from %s", VERSION, RELEASE_URL)
    try:
        with urllib.request.urlopen(RELEASE_URL, timeout=120) as r, open(dest.with_suffix(".part"), "wb") as f:
            shutil.copyfileobj(r, f)
        dest.with_suffix(".part").replace(dest)
    except OSError as e:
        raise SystemExit(
            f"ComfyUI {VERSION} was not found. Point COMFYUI_DIR at your ComfyUI folder, or put its release archive "
            f"(tag v{VERSION}) at {ARCHIVE_ENV} or {SHARED_ARCHIVE}; downloading {RELEASE_URL} failed ({e}).") from e
    return dest


def _unpack(archive: Path, dest: Path) -> None:
    """Unpack a ComfyUI release archive (one top folder) to dest, checking its version."""
    log.info("unpacking ComfyUI from %s", archive)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        with tarfile.open(archive) as tf:
            tf.extractall(tmp, filter="data")
        (top,) = [p for p in Path(tmp).iterdir() if p.is_dir()]
        found = comfy_version(top) if (top / "comfyui_version.py").is_file() else "no comfyui_version.py"
        if found != VERSION:
            raise SystemExit(f"{archive} holds ComfyUI {found}, not {VERSION}: use the v{VERSION} release archive.")
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(top), str(dest))


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


def ensure_source() -> Path:
    """The ComfyUI tree, unpacked from its archive where it is not there yet (downloaded where needed), or a
    SystemExit that says where to put it: what setup checks before it installs anything."""
    cdir = comfy_dir()
    if not (cdir / "comfy").is_dir():
        if os.environ.get("COMFYUI_DIR"):
            raise SystemExit(f"COMFYUI_DIR={cdir} is not a ComfyUI checkout (no comfy/ folder)")
        CACHE.mkdir(exist_ok=True)
        _unpack(_archive(), cdir)
    else:
        log.info("ComfyUI present at %s", cdir)
    return cdir


def ensure_host() -> Path:
    cdir = ensure_source()
    missing = _missing(_requirements(cdir))
    if missing and os.environ.get("FLUXACCEL_HOST_NO_INSTALL"):
        # offline machines (the lent GPU): ComfyUI starts without its optional packages; say what is missing
        log.warning("not installing (FLUXACCEL_HOST_NO_INSTALL set); missing: %s", " ".join(missing))
    elif missing:
        log.info("installing ComfyUI's requirements (a few minutes on a fresh machine): %s", " ".join(missing))
        subprocess.run([*PIP_INSTALL, *missing], check=True)
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
    subprocess.run([*PIP_INSTALL, "--no-deps", "torchaudio"], check=True)
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
    ap.add_argument("--print-dir", action="store_true", help="only print the ComfyUI folder that would be used")
    ap.add_argument("--source-only", action="store_true",
                    help="only find and unpack ComfyUI, installing nothing (any Python 3.10+, before the set-up)")
    a = ap.parse_args()
    if a.print_dir:
        print(comfy_dir())
        return
    logging.basicConfig(level=logging.INFO, format="[host] %(message)s")
    print(ensure_source() if a.source_only else ensure_host())


if __name__ == "__main__":
    main()
