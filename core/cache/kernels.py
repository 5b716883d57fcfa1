"""Inductor's artifacts (FX graphs, Triton kernels, autotune results) saved after a compile and loaded before the
next one in a fresh process, so a restarted ComfyUI skips most compile work.

Files live in the cache folder (folder.py), one per key (compile/patch.py's cache_key: torch, triton and torchao
versions, the device, the compile options and the model's parameter layout).
A stale, foreign or corrupt file is ignored with a warning and the model simply compiles again.

Each file holds its own model's artifacts only: torch records the artifacts of every compile of the process in one
list (`torch.compiler.save_cache_artifacts()` would write all models compiled so far into every file), so a compile
runs inside `recording()` (torch's CacheArtifactManager.with_fresh_cache) and the file is written from what this
model loaded and recorded.
"""
from __future__ import annotations

import json
import logging
import os
from contextlib import contextmanager
from pathlib import Path

from ..upstream import say, torch_internals
from .folder import UNUSABLE_FILE, UNWRITABLE, default_dir

log = logging.getLogger("fluxaccel.cache")

MAGIC = b"FLUXACCEL-COMPILE-CACHE 1\n"


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
