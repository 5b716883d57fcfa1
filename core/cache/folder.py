"""FluxAccel's cache folder: where every cache keeps its files, the versions their keys hold, and what reading or
writing a file there may raise."""
from __future__ import annotations

import importlib.metadata as md
import os
import pickle
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


def package_version(pkg: str) -> str | None:
    try:
        return md.version(pkg)
    except md.PackageNotFoundError:
        return None


