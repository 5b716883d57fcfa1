"""ComfyUI 0.38.1's Comfy model compiler module in a ComfyUI 0.33.0 tree, for tests (no full 0.38 tree exists here).

`../shared/hosts/comfyui-0.38.1-files/comfy/model_prefetch.py` is upstream's file, unchanged. It imports
`comfy_aimdo.malloc_graph`, which comfy-aimdo 0.5.5 (0.38.1's pin) has and 0.33's pin does not: `ensure_aimdo()`
installs 0.5.5 into .cache/aimdo-0.5.5 (pip --target), and a process that puts that folder first on sys.path (see
`env()`) runs 0.38.1's pin of comfy-aimdo. `use_prefetch_038()` then loads the file as `comfy.model_prefetch`.

Usage: python tools/comfy038.py   (installs comfy-aimdo 0.5.5 if missing; prints its folder)
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FILES_038 = ROOT.parent / "shared" / "hosts" / "comfyui-0.38.1-files"
AIMDO_PIN = "comfy-aimdo==0.5.5"
AIMDO_DIR = ROOT / ".cache" / "aimdo-0.5.5"


def available() -> str:
    """'' when the 0.38.1 files are here, else why not."""
    if not (FILES_038 / "comfy" / "model_prefetch.py").is_file():
        return f"ComfyUI 0.38.1's files are not at {FILES_038}"
    return ""


def ensure_aimdo() -> Path:
    if not (AIMDO_DIR / "comfy_aimdo" / "malloc_graph.py").is_file():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-compile",
                        "--no-deps", "--target", str(AIMDO_DIR), AIMDO_PIN], check=True)
    return AIMDO_DIR


def env() -> dict:
    """The environment of a process that runs 0.38.1's comfy-aimdo pin."""
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(ensure_aimdo()), str(ROOT), e.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return e


def use_prefetch_038():
    """Load 0.38.1's comfy/model_prefetch.py as comfy.model_prefetch in this process (ComfyUI already imported)."""
    import comfy

    path = FILES_038 / "comfy" / "model_prefetch.py"
    spec = importlib.util.spec_from_file_location("comfy.model_prefetch", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sys.modules["comfy.model_prefetch"] = mod
    comfy.model_prefetch = mod
    return mod


if __name__ == "__main__":
    print(ensure_aimdo())
