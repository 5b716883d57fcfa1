"""Benchmark results on disk: strict JSON (what any JSON parser reads) and one set of files per run.

A run's files sit together under the output folder: `<timestamp>-<label>.json` (every figure, the case and the
versions), `.md` (the table as the node shows it) and `.png` (the chart), plus `latest.json`, which names the newest
set. JSON has no Infinity or NaN: such a value is written as null and `nonfinite` lists where and what it was (e.g. a
baseline's SQNR against itself is infinite).
"""
from __future__ import annotations

import json
import math
import os
import re
import time
from pathlib import Path


def strict(obj, where: str = "", found: list | None = None):
    """obj with every non-finite float replaced by None; `found` collects {"path", "was"} for each."""
    found = [] if found is None else found
    if isinstance(obj, float) and not math.isfinite(obj):
        found.append({"path": where or "$", "was": repr(obj)})
        return None
    if isinstance(obj, dict):
        return {k: strict(v, f"{where}.{k}" if where else str(k), found) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict(v, f"{where}[{i}]", found) for i, v in enumerate(obj)]
    return obj


def dumps(payload: dict) -> str:
    """payload as strict JSON; where it held non-finite numbers, a top-level `nonfinite` list says where."""
    found: list = []
    clean = strict(payload, found=found)
    if found:
        clean["nonfinite"] = [{**f, "written_as": None, "why": "JSON has no Infinity or NaN"} for f in found]
    return json.dumps(clean, indent=2, allow_nan=False) + "\n"


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def stem_for(label: str, when: float | None = None) -> str:
    """`<YYYYmmdd-HHMMSS>-<label>`: sortable by time, the label made safe for a file name."""
    safe = re.sub(r"[^A-Za-z0-9._+-]+", "_", label).strip("_")[:60] or "benchmark"
    return f"{time.strftime('%Y%m%d-%H%M%S', time.localtime(when))}-{safe}"


def save_run(folder: str | os.PathLike, label: str, payload: dict, table_md: str, png: bytes | None) -> dict:
    """Write one run's .json, .md and (if any) .png under folder, and latest.json naming them. Returns the file names
    (relative to folder). A second run within the same second gets a numbered stem, never overwriting the first."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    base = stem_for(label)
    stem, n = base, 1
    while (folder / f"{stem}.json").exists():
        n += 1
        stem = f"{base}-{n}"
    files = {"json": f"{stem}.json", "md": f"{stem}.md"}
    if png is not None:
        files["png"] = f"{stem}.png"
        _atomic_write(folder / files["png"], png)
    _atomic_write(folder / files["md"], table_md.encode() + b"\n")
    _atomic_write(folder / files["json"], dumps({**payload, "files": files}).encode())
    _atomic_write(folder / "latest.json", dumps({"stem": stem, "files": files}).encode())
    return files
