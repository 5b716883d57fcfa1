"""Delete FluxAccel's persistent compile cache.

    python tools/clear_cache.py                      # ComfyUI's user folder of the host in .cache/ComfyUI (or COMFYUI_DIR)
    python tools/clear_cache.py --dir PATH           # another cache folder (e.g. ComfyUI/user/fluxaccel/compile-cache)
"""
import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from core.compile_cache import clear  # noqa: E402
from tools.host import comfy_dir  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", help="cache folder; default: <ComfyUI>/user/fluxaccel/compile-cache")
    a = ap.parse_args()
    d = Path(a.dir) if a.dir else comfy_dir() / "user" / "fluxaccel" / "compile-cache"
    print(f"removed {clear(d)} cache file(s) from {d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
