"""The separate compile process (separate.py): `python compile_worker.py JOB_FILE`.

It takes the parent's import path, ComfyUI's launch flags and FluxAccel's package name from the job, then hands the
job to separate.work and writes the result (JSON) where the parent looks for it. Run as a script, so it imports
nothing of the plugin before the paths are set; the plugin's package is registered without running its __init__
(which sets up ComfyUI nodes, not needed here).

It lives as long as the ComfyUI that started it: when that process is gone (closed, killed, crashed), the compile
stops and its half-written files are removed. A restarted ComfyUI finds no package and compiles the shape again;
without this, the orphan would keep its copy of the weights in device memory beside the new server's and race it
to write the same package.
"""
import importlib
import importlib.util
import json
import logging
import os
import pickle
import sys
import threading
import time
import traceback
from pathlib import Path

try:  # a ComfyUI requirement; only read where the parent pid cannot tell (not POSIX)
    import psutil
except ImportError:
    psutil = None

log = logging.getLogger("fluxaccel.compile")


def _register(name: str, folder: str) -> None:
    spec = importlib.util.spec_from_file_location(name, str(Path(folder) / "__init__.py"),
                                                  submodule_search_locations=[folder])
    sys.modules[name] = importlib.util.module_from_spec(spec)


def parent_alive(pid: int):
    """A function telling whether the process `pid` (this one's parent) still runs, or None where that cannot be told.
    POSIX re-parents an orphan the moment its parent exits (a zombie parent included), so its parent pid changes;
    elsewhere psutil (a ComfyUI requirement) tells, knowing a pid that another process took since."""
    if os.name == "posix":
        return lambda: os.getppid() == pid
    if psutil is None:
        return None
    try:
        return psutil.Process(pid).is_running
    except psutil.Error:  # gone already
        return lambda: False


def follow_parent(pid: int, cache_dir: Path | None, interval: float = 1.0) -> bool:
    """Watch the parent from a daemon thread: once it is gone, say so, remove this process's temporary files in the
    cache folder and exit. False (said in the log) where whether it runs cannot be told."""
    alive = parent_alive(pid)
    if alive is None:
        log.warning("FluxAccel compile process: cannot tell whether ComfyUI (pid %d) still runs (no psutil): this "
                    "compile runs to its end even if ComfyUI exits", pid)
        return False

    def watch():
        while alive():
            time.sleep(interval)
        log.warning("FluxAccel compile process: ComfyUI (pid %d) exited; stopping this compile (a restarted ComfyUI "
                    "compiles the shape again)", pid)
        for tmp in (cache_dir.glob(f"*.tmp{os.getpid()}") if cache_dir is not None else ()):
            tmp.unlink(missing_ok=True)
        logging.shutdown()
        os._exit(3)

    threading.Thread(target=watch, name="fluxaccel-follow-parent", daemon=True).start()
    return True


def main(job_file: str) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(asctime)s %(name)s %(message)s")
    path = Path(job_file)
    job = pickle.loads(path.read_bytes())
    path.unlink(missing_ok=True)
    h = job["header"]
    follow_parent(h["parent"], Path(h["cache_dir"]))
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
