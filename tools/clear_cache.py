"""Delete FluxAccel's persistent caches (compile-cache files, warm-start packages and FP8 weights; only files that carry
FluxAccel's headers), of the ComfyUI this plugin is installed in.

    python custom_nodes/comfyui-fluxaccel/tools/clear_cache.py   # <ComfyUI>/user/fluxaccel/compile-cache
    python tools/clear_cache.py --dir PATH                        # another folder (a fleet's shared cache, ...)

The folder: --dir, else $FLUXACCEL_CACHE_DIR (what the plugin itself uses when set), else the user folder of the
ComfyUI whose custom_nodes/ holds this plugin, else of $COMFYUI_DIR. A ComfyUI started with --user-directory keeps
its cache under that folder instead: pass it with --dir. Outside a ComfyUI, without either, it refuses.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tools.plugin import register  # noqa: E402  (the plugin as the package fluxaccel)
register()

from fluxaccel.core.cache.clear import clear
from fluxaccel.core.cache.folder import ENV_DIR  # noqa: E402

PLUGIN = Path(os.path.abspath(__file__)).parents[1]  # as installed (not resolved: a linked plugin counts where linked)


def installed_comfyui(plugin: Path = PLUGIN) -> Path | None:
    """The ComfyUI folder whose custom_nodes/ holds the plugin, or None."""
    comfy = plugin.parent.parent
    if plugin.parent.name == "custom_nodes" and (comfy / "folder_paths.py").is_file():
        return comfy
    return None


def cache_dir(arg: str | None) -> tuple[Path | None, str]:
    """(folder, where it came from), or (None, why not)."""
    if arg:
        return Path(arg), "--dir"
    if os.environ.get(ENV_DIR):
        return Path(os.environ[ENV_DIR]), f"${ENV_DIR}"
    comfy = installed_comfyui() or (Path(os.environ["COMFYUI_DIR"]) if os.environ.get("COMFYUI_DIR") else None)
    if comfy is None:
        return None, (f"this plugin is not inside a ComfyUI's custom_nodes/ ({PLUGIN}) and neither --dir, "
                      f"${ENV_DIR} nor $COMFYUI_DIR is set: pass the cache folder with --dir")
    return comfy / "user" / "fluxaccel" / "compile-cache", f"the ComfyUI at {comfy}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", help="cache folder; default: <ComfyUI>/user/fluxaccel/compile-cache")
    a = ap.parse_args(argv)
    d, where = cache_dir(a.dir)
    if d is None:
        print(f"clear_cache: {where}", file=sys.stderr)
        return 2
    print(f"removed {clear(d)} cache file(s) from {d} ({where})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
