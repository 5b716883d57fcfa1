"""The plugin imported one way: as the package `fluxaccel`, its folder registered under that name the way ComfyUI
registers a custom node's folder under the folder's name. Tests and tools call register() before importing
`fluxaccel.core...`; nothing imports `core` as a top-level package, so one process never holds two copies of it."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
NAME = "fluxaccel"


def register() -> ModuleType:
    """The plugin package as `fluxaccel` (registered on first call; the package's own __init__ imports nothing heavy)."""
    mod = sys.modules.get(NAME)
    if mod is not None:
        return mod
    spec = importlib.util.spec_from_file_location(NAME, ROOT / "__init__.py", submodule_search_locations=[str(ROOT)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[NAME] = mod
    spec.loader.exec_module(mod)
    return mod
