"""Pre-build FluxAccel's warm-start packages for a fleet: run a workflow once, headless, in a real ComfyUI, with the
compile cache in a shared folder; workers pointed at that folder then start warm (no compile, no trace).

    python tools/prebuild.py my_workflow_api.json --comfyui /path/to/ComfyUI --cache-dir /shared/fluxaccel-cache \
        [--server-arg=--disable-cuda-malloc ...]

The workflow is your own, in API format (the editor's "Export (API)"), with the FluxAccel nodes and settings your
workers use: every shape it compiles -- each Warmup resolution and each sampler call -- gets a package. Its files
are keyed by torch, triton, torchao and ComfyUI's FLUX code, the GPU model, the FP8 and compile settings, the model's
layout and the call's shapes; a worker that differs in any of them compiles for itself (and says why in its log).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tools.plugin import register  # noqa: E402  (the plugin as the package fluxaccel)
register()

from fluxaccel.core.cache.packages import SUFFIX  # noqa: E402
from tools.comfy_server import ComfyServer  # noqa: E402

log = logging.getLogger("fluxaccel.prebuild")


@dataclass
class Prebuilt:
    written: list[Path]  # warm-start packages the run wrote (new, or rewritten after a stale/foreign one)
    loaded: int  # packages the run loaded instead of compiling (already in the folder)
    said: list[str]  # the server's log lines about warm-start packages (saved, loaded, ignored and why)


def prebuild(workflow: dict, comfy_dir: Path, cache_dir: Path, server_args: list[str], models_dir: Path | None = None,
             timeout: float = 3600, cpu_fp8: bool = False) -> Prebuilt:
    """Run the workflow once in a new ComfyUI server with FLUXACCEL_CACHE_DIR=cache_dir."""
    ours = {n["class_type"] for n in workflow.values()} & {"FluxAccelCompile"}
    if not ours:
        raise SystemExit("the workflow has no Compile + CUDA Graph (FluxAccel) node: there is nothing to pre-build")
    cache_dir.mkdir(parents=True, exist_ok=True)
    before = {p: p.stat().st_mtime_ns for p in cache_dir.glob(f"*{SUFFIX}")}
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="fluxaccel-prebuild-") as work:
        srv = ComfyServer(comfy_dir, Path(work), models_dir or comfy_dir / "models", tuple(server_args),
                          env={"FLUXACCEL_CACHE_DIR": str(cache_dir)}, cpu_fp8=cpu_fp8)
        with srv:
            srv.run(workflow, timeout=timeout)
            srv.separate_compiles(timeout=timeout)  # shapes compiling in a separate process: their packages too
        text = srv.log_path.read_text(errors="replace")
        loaded = text.count("FluxAccel: loaded warm-start package")
        said = [line.strip() for line in text.splitlines() if "warm-start package" in line]
    written = sorted(p for p in cache_dir.glob(f"*{SUFFIX}") if before.get(p) != p.stat().st_mtime_ns)
    log.info("%d warm-start package(s) written to %s, %d loaded from it, in %.0f s", len(written), cache_dir, loaded,
             time.time() - t0)
    return Prebuilt(written, loaded, said)


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("workflow", type=Path, help="a workflow in API format (POST /prompt) using the FluxAccel nodes")
    ap.add_argument("--comfyui", type=Path, required=True, help="the ComfyUI folder (FluxAccel in its custom_nodes)")
    ap.add_argument("--cache-dir", type=Path, required=True, help="the shared folder workers get as FLUXACCEL_CACHE_DIR")
    ap.add_argument("--models-dir", type=Path, help="extra model folder (default: the ComfyUI folder's models)")
    ap.add_argument("--server-arg", action="append", default=[], help="a ComfyUI launch flag, as your workers use it")
    a = ap.parse_args()
    workflow = json.loads(a.workflow.read_text())
    done = prebuild(workflow, a.comfyui, a.cache_dir, a.server_arg, a.models_dir)
    for p in done.written:
        print(p)
    if not done.written and not done.loaded:
        log.error("the workflow ran but no warm-start package was written or loaded: see the warnings above (e.g. "
                  "a shape that cannot be packaged)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
