"""Persistent compile cache: inductor's artifacts (FX graphs, Triton kernels, autotune results) saved after a
compile and loaded before the next one in a fresh process, so a restarted ComfyUI skips most compile work.

Files live in ComfyUI's user directory (fluxaccel/compile-cache/), one per key: torch, triton and torchao
versions, the device, the compile config and the model's parameter layout (shapes, dtypes, FP8 or not).
A stale, foreign or corrupt file is ignored with a warning and the model simply compiles again.

Each file holds its own model's artifacts only: torch records the artifacts of every compile of the process in one
list (`torch.compiler.save_cache_artifacts()` would write all models compiled so far into every file), so a compile
runs inside `recording()` (torch's CacheArtifactManager.with_fresh_cache) and the file is written from what this
model loaded and recorded.
"""
from __future__ import annotations

import hashlib
import importlib.metadata as md
import json
import logging
import os
import re
from contextlib import contextmanager
from pathlib import Path

import torch

from ..upstream import say, torch_internals
from . import reductions, single_block
from .warm_start import UNUSABLE_FILE, UNWRITABLE

log = logging.getLogger("fluxaccel.cache")

MAGIC = b"FLUXACCEL-COMPILE-CACHE 1\n"
LOG_NAME = re.compile(r"[0-9a-f]{32}-[0-9a-f]{16}\.compile\d+\.log")  # <key>-<signature>.compile<pid>.log
ENV_DIR = "FLUXACCEL_CACHE_DIR"


def default_dir() -> Path:
    if os.environ.get(ENV_DIR):
        return Path(os.environ[ENV_DIR])
    try:
        import folder_paths

        return Path(folder_paths.get_user_directory()) / "fluxaccel" / "compile-cache"
    except ImportError:
        return Path.home() / ".cache" / "fluxaccel" / "compile-cache"


def package_version(pkg: str) -> str | None:
    try:
        return md.version(pkg)
    except md.PackageNotFoundError:
        return None


def cache_key(dm: torch.nn.Module, cfg, device: torch.device, options: dict, variant: str = "",
              layout: str | None = None) -> str:
    """options: the inductor options of the compile (config.inductor_options). variant: what the patched model differs by at load time (FP8 config, swapped modules); the module here is
    the unpatched one, so without it bf16, FP8 per-tensor and FP8 per-row compiles would share one file.
    layout: the model's architecture and storage as loaded (compile_patch.model_layout). Without it the live module
    tree is hashed, which holds whatever clone's patches are applied at that moment."""
    device = torch.device(device)
    dev = "cpu"
    if device.type == "cuda":
        dev = f"{torch.cuda.get_device_name(device)} sm{''.join(map(str, torch.cuda.get_device_capability(device)))}"
    h = hashlib.sha256()
    if layout is not None:
        h.update(layout.encode())
    else:
        for name, p in dm.named_parameters():
            h.update(f"{name}:{tuple(p.shape)}:{p.dtype}:{type(p.data).__name__}".encode())
    # only what changes the compiled artifacts: the inductor options (mode, C++ wrapper), not resolution_policy etc.
    options = (repr(sorted(options.items())) + f" {reductions.KEY} {single_block.cache_tag(dm)}"
               + (f" attention={cfg.attention}" if cfg.attention != "cudnn" else ""))
    ident = {"format": 1, "torch": torch.__version__, "triton": package_version("triton"),
             "torchao": package_version("torchao"),
             "device": dev, "config": options, "model": type(dm).__name__, "layout": h.hexdigest(),
             "variant": variant}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:32]


class KernelCache:
    def __init__(self, key: str, directory: Path | None = None):
        self.dir = Path(directory) if directory else default_dir()
        self.key = key
        self.path = self.dir / f"{key}.bin"
        self.artifacts: dict[str, list] = {}  # kind -> torch CacheArtifacts: loaded from this file, recorded for it
        self._on_disk: set = set()  # (kind, key) of the artifacts the file already holds

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
            artifacts, info = torch_internals.load_artifacts(payload)
            self._merge(artifacts)
            self._on_disk |= self._held()
            log.info("FluxAccel: loaded compile cache %s (%s)", self.path, info)
            return True
        except UNUSABLE_FILE as e:  # a cache must never break a run: warn and compile from scratch
            log.warning("FluxAccel: ignoring unusable compile cache %s (%s: %s); compiling from scratch",
                        self.path, type(e).__name__, e)
            return False

    @contextmanager
    def recording(self):
        """Around a compile: what it records goes to this file (and not into the process-wide list)."""
        with torch_internals.recording_artifacts(self._merge):
            yield

    def _merge(self, artifacts: dict) -> None:
        for kind, items in artifacts.items():
            have = self.artifacts.setdefault(kind, [])
            keys = {a.key for a in have}
            have.extend(a for a in items if a.key not in keys)

    def _held(self) -> set:
        return {(kind, a.key) for kind, items in self.artifacts.items() for a in items}

    def save(self) -> bool:
        """Write this model's artifacts (write to a temporary name, then rename: workers may share the folder); not
        when the file already holds all of them (a warm start that compiled nothing new)."""
        try:
            per_compile = torch_internals.per_compile_artifacts()
            if per_compile is not True:
                say(per_compile, "a compile-cache file holds every artifact this process compiled (torch's public "
                                 "save_cache_artifacts), not only this model's")
            elif not any(self.artifacts.values()) or self._held() <= self._on_disk:
                return False
            payload = torch_internals.save_artifacts(self.artifacts)
            if not payload:
                return False
            self.dir.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_bytes(MAGIC + json.dumps({"key": self.key}).encode() + b"\n" + payload)
            os.replace(tmp, self.path)
            self._on_disk = self._held()
            log.info("FluxAccel: saved compile cache %s (%d bytes)", self.path, len(payload))
            return True
        except UNWRITABLE as e:
            log.warning("FluxAccel: could not save the compile cache to %s (%s: %s)", self.path, type(e).__name__, e)
            return False


def _is_block_index(f: Path) -> bool:
    """Whether f is a block index FluxAccel wrote (WarmStart.save_blocks)."""
    try:
        index = json.loads(f.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(index, dict) and {"key", "signature", "blocks"} <= index.keys()


def clear(directory: Path | None = None) -> int:
    """Delete FluxAccel's compile-cache files, warm-start packages and their block indexes, the separate compiles' logs
    and FP8 weights files (only files that carry our headers or names)."""
    from .warm_start import MAGIC as WARM_MAGIC, SUFFIX as WARM_SUFFIX

    d = Path(directory) if directory else default_dir()
    n = 0
    for pattern, magic in (("*.bin", MAGIC), (f"*{WARM_SUFFIX}", WARM_MAGIC)):
        for f in d.glob(pattern) if d.is_dir() else []:
            with open(f, "rb") as fh:
                if fh.read(len(magic)) == magic:
                    f.unlink()
                    n += 1
    for f in d.glob("*.blocks") if d.is_dir() else []:  # a call's index of its block packages
        if _is_block_index(f):
            f.unlink()
            n += 1
    for f in d.glob("*.compile*.log") if d.is_dir() else []:  # the separate compile processes' logs (separate.py)
        if LOG_NAME.fullmatch(f.name):
            f.unlink()
            n += 1
    from ..quant.weights_cache import is_ours

    weights = d / "fp8-weights"
    for f in weights.glob("*.safetensors") if weights.is_dir() else []:
        if is_ours(f):
            f.unlink()
            n += 1
    return n
