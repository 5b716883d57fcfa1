"""Rewrite results JSON files as strict JSON (core/bench/results.py): Infinity/NaN become null, listed in `nonfinite`.

    python tools/strict_json.py bench/results/*.json

Only the encoding of non-finite numbers changes; every finite figure is written back as it was read.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tools.plugin import register  # noqa: E402  (the plugin as the package fluxaccel)
register()

from fluxaccel.core.bench.results import dumps  # noqa: E402


def main(paths: list[str]) -> int:
    changed = 0
    for p in map(Path, paths):
        text = p.read_text()
        data = json.loads(text)  # Python's parser reads Infinity/NaN
        try:
            json.loads(text, parse_constant=lambda name: (_ for _ in ()).throw(ValueError(name)))
            continue  # already strict
        except ValueError:
            pass
        p.write_text(dumps(data))
        changed += 1
        print(f"rewrote {p}")
    print(f"{changed} file(s) rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
