"""The separate compile process (separate.py): `python compile_worker.py JOB_FILE`.

It takes the parent's import path, ComfyUI's launch flags and FluxAccel's package name from the job, then hands the
job to separate.work and writes the result (JSON) where the parent looks for it. Run as a script, so it imports
nothing of the plugin before the paths are set; the plugin's package is registered without running its __init__
(which sets up ComfyUI nodes, not needed here).
"""
import importlib
import importlib.util
import json
import logging
import pickle
import sys
import traceback
from pathlib import Path


def _register(name: str, folder: str) -> None:
    spec = importlib.util.spec_from_file_location(name, str(Path(folder) / "__init__.py"),
                                                  submodule_search_locations=[folder])
    sys.modules[name] = importlib.util.module_from_spec(spec)


def main(job_file: str) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(asctime)s %(name)s %(message)s")
    path = Path(job_file)
    job = pickle.loads(path.read_bytes())
    path.unlink(missing_ok=True)
    h = job["header"]
    result = {"saved": False, "error": ""}
    try:
        sys.path[:] = h["sys_path"]
        _register(h["package"], h["package_dir"])
        flags = pickle.loads(job["flags"])
        internals = importlib.import_module(f"{h['package']}.core.upstream.comfy_internals")
        set_flags = internals.set_launch_args(flags)
        if not set_flags:
            raise RuntimeError(str(set_flags))
        separate = importlib.import_module(f"{h['package']}.core.compile.separate")
        result = separate.work(job)
    except Exception as e:  # noqa: BLE001 -- any failure goes to the parent, which compiles the shape itself
        traceback.print_exc()
        result = {"saved": False, "error": f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]}
    Path(h["result"]).write_text(json.dumps(result))
    return 0 if result.get("saved") else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
