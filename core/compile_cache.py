"""Persistent compile cache: inductor's artifacts (FX graphs, Triton kernels, autotune results) saved after a
compile and loaded before the next one in a fresh process, so a restarted ComfyUI skips most compile work.

Files live in ComfyUI's user directory (fluxaccel/compile-cache/), one per key: torch, triton and torchao
versions, the device, the compile config and the model's parameter layout (shapes, dtypes, FP8 or not).
A stale, foreign or corrupt file is ignored with a warning and the model simply compiles again.
"""
from __future__ import annotations

import hashlib
import importlib.metadata as md
import json
import logging
import os
from pathlib import Path

import torch

log = logging.getLogger("fluxaccel.cache")

MAGIC = b"FLUXACCEL-COMPILE-CACHE 1\n"
ENV_DIR = "FLUXACCEL_CACHE_DIR"


def default_dir() -> Path:
    if os.environ.get(ENV_DIR):
        return Path(os.environ[ENV_DIR])
    try:
        import folder_paths

        return Path(folder_paths.get_user_directory()) / "fluxaccel" / "compile-cache"
    except ImportError:
        return Path.home() / ".cache" / "fluxaccel" / "compile-cache"


def _version(pkg: str) -> str | None:
    try:
        return md.version(pkg)
    except md.PackageNotFoundError:
        return None


def cache_key(dm: torch.nn.Module, cfg, device: torch.device, variant: str = "") -> str:
    """variant: what the patched model differs by at load time (FP8 config, swapped modules); the module here is
    the unpatched one, so without it bf16, FP8 per-tensor and FP8 per-row compiles would share one file."""
    device = torch.device(device)
    dev = "cpu"
    if device.type == "cuda":
        dev = f"{torch.cuda.get_device_name(device)} sm{''.join(map(str, torch.cuda.get_device_capability(device)))}"
    layout = hashlib.sha256()
    for name, p in dm.named_parameters():
        layout.update(f"{name}:{tuple(p.shape)}:{p.dtype}:{type(p.data).__name__}".encode())
    # only what changes the compiled artifacts: the inductor options (graphs, mode), not resolution_policy etc.
    options = repr(sorted(cfg.inductor_options(device).items())) + f" block_regions={cfg.block_regions}"
    ident = {"format": 1, "torch": torch.__version__, "triton": _version("triton"), "torchao": _version("torchao"),
             "device": dev, "config": options, "model": type(dm).__name__, "layout": layout.hexdigest(),
             "variant": variant}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:32]


class CompileCache:
    def __init__(self, key: str, directory: Path | None = None):
        self.dir = Path(directory) if directory else default_dir()
        self.key = key
        self.path = self.dir / f"{key}.bin"

    def load(self) -> bool:
        """Hot-load saved artifacts into inductor's caches; False (with a warning) if absent or unusable."""
        if not self.path.is_file():
            return False
        try:
            blob = self.path.read_bytes()
            if not blob.startswith(MAGIC):
                raise ValueError("not a FluxAccel compile-cache file")
            header, _, payload = blob[len(MAGIC):].partition(b"\n")
            if json.loads(header).get("key") != self.key:
                raise ValueError("written for another model/version/config")
            info = torch.compiler.load_cache_artifacts(payload)
            log.info("FluxAccel: loaded compile cache %s (%s)", self.path, info)
            return True
        except Exception as e:  # a cache must never break a run: warn and compile from scratch
            log.warning("FluxAccel: ignoring unusable compile cache %s (%s: %s); compiling from scratch",
                        self.path, type(e).__name__, e)
            return False

    def save(self) -> bool:
        try:
            res = torch.compiler.save_cache_artifacts()
            if not res:
                return False
            payload, info = res
            self.dir.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_bytes(MAGIC + json.dumps({"key": self.key}).encode() + b"\n" + payload)
            os.replace(tmp, self.path)
            log.info("FluxAccel: saved compile cache %s (%d bytes)", self.path, len(payload))
            return True
        except Exception as e:
            log.warning("FluxAccel: could not save the compile cache to %s (%s: %s)", self.path, type(e).__name__, e)
            return False


def clear(directory: Path | None = None) -> int:
    """Delete FluxAccel's compile-cache files (only *.bin files that carry our header). Returns how many."""
    d = Path(directory) if directory else default_dir()
    n = 0
    for f in d.glob("*.bin") if d.is_dir() else []:
        with open(f, "rb") as fh:
            if fh.read(len(MAGIC)) == MAGIC:
                f.unlink()
                n += 1
    return n
