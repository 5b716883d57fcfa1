"""FluxAccel's cache folder: where every cache keeps its files, the versions their keys hold, and what reading or
writing a file there may raise."""
from __future__ import annotations

import hashlib
import importlib.metadata as md
import os
import pickle
import struct
from pathlib import Path

ENV_DIR = "FLUXACCEL_CACHE_DIR"

# what reading a damaged, truncated, foreign or stale file raises (ours: ValueError), and what torch's deserializer
# raises for one it cannot rebuild; writing: what a full disk, a read-only folder or an unpicklable graph raise
UNUSABLE_FILE = (OSError, ValueError, EOFError, RuntimeError, KeyError, AttributeError, ImportError, TypeError,
                 pickle.UnpicklingError)
UNWRITABLE = (OSError, RuntimeError, TypeError, ValueError, AttributeError, pickle.PicklingError)


def default_dir() -> Path:
    if os.environ.get(ENV_DIR):
        return Path(os.environ[ENV_DIR])
    try:
        import folder_paths

        return Path(folder_paths.get_user_directory()) / "fluxaccel" / "compile-cache"
    except ImportError:
        return Path.home() / ".cache" / "fluxaccel" / "compile-cache"


def temp_dir() -> str | None:
    """ComfyUI's temp folder (emptied at each ComfyUI start), for FluxAccel's short-lived files; None: the system's."""
    try:
        import folder_paths

        path = Path(folder_paths.get_temp_directory())
        path.mkdir(parents=True, exist_ok=True)
        return str(path)
    except (ImportError, AttributeError, OSError):
        return None


def package_version(pkg: str) -> str | None:
    try:
        return md.version(pkg)
    except md.PackageNotFoundError:
        return None


def file_identity(path: Path) -> dict:
    """What identifies a weights file without reading it all: path, size, mtime and a hash of its first bytes (a
    safetensors file's whole header)."""
    st = path.stat()
    with open(path, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if path.suffix in (".safetensors", ".sft") and len(head) == 8 else 0
        head += f.read(min(n, 100 << 20) if n else (1 << 20) - 8)
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "head_sha256": hashlib.sha256(head).hexdigest()}
