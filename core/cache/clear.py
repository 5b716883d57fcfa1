"""Emptying the cache folder: only files that carry FluxAccel's headers or names (tools/clear_cache.py)."""
from __future__ import annotations

import json
import re
from pathlib import Path

from .folder import default_dir
from .fp8_weights import is_ours
from .kernels import MAGIC
from .packages import MAGIC as WARM_MAGIC, SUFFIX as WARM_SUFFIX

LOG_NAME = re.compile(r"[0-9a-f]{32}-[0-9a-f]{16}\.compile\d+\.log")  # <key>-<signature>.compile<pid>.log


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
    weights = d / "fp8-weights"
    for f in weights.glob("*.safetensors") if weights.is_dir() else []:
        if is_ours(f):
            f.unlink()
            n += 1
    return n
