"""A sequence-parallel worker process (workers.py starts one per GPU): `python worker.py JOB_FILE`.

Run as a script, like the separate compile process: it takes the parent's import path, ComfyUI's launch flags and
FluxAccel's package name from the job, registers the package without running its __init__, follows its ComfyUI
(the worker exits when ComfyUI is gone) and hands over to serve.run.
"""
import importlib
import importlib.util
import logging
import pickle
import sys
from pathlib import Path


def main(job_file: str) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(asctime)s %(name)s %(message)s")
    path = Path(job_file)
    job = pickle.loads(path.read_bytes())
    path.unlink(missing_ok=True)
    sys.path[:] = job["sys_path"]
    spec = importlib.util.spec_from_file_location(job["package"], str(Path(job["package_dir"]) / "__init__.py"),
                                                  submodule_search_locations=[job["package_dir"]])
    sys.modules[job["package"]] = importlib.util.module_from_spec(spec)
    importlib.import_module(f"{job['package']}.core.compile.compile_worker").follow_parent(job["parent"], None)
    internals = importlib.import_module(f"{job['package']}.core.upstream.comfy_internals")
    flags = internals.set_launch_args(pickle.loads(job["flags"]))
    if not flags:
        raise RuntimeError(str(flags))
    return importlib.import_module(f"{job['package']}.core.parallel.serve").run(job)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
