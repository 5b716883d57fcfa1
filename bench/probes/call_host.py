"""The host's time per model call with graph_capture "call", outside the replay itself: ComfyUI's apply_model, the
sampler's model wrappers, FluxAccel's shape policy, runner and CallGraphs (the inputs' structure, the weights'
addresses, the copies into the graph's inputs). CPU only: a FLUX of FLUX.1's depth (19 double, 38 single blocks) at a
narrow width, the blocks compiled on their own as on a GPU, and a stand-in graph whose replay does nothing, so that
what is timed is the host's part alone. cProfile over steady sampling runs; the table gives milliseconds per model
call (cumulative, the function and what it calls).

    OMP_NUM_THREADS=1 FLUXACCEL_COMFYUI=0.33.0 .cache/venv-0.33.0/bin/python bench/probes/call_host.py
"""
from __future__ import annotations

import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
from tools import host  # noqa: E402
from tools.plugin import register  # noqa: E402

register()
host.import_comfy(host.ensure_host())

STEPS, RUNS = 4, 5
FUNCS = ("apply_model", "forward", "__call__", "structure", "weight_addresses", "call_kwargs", "warm_call",
         "count_call", "decide", "shape_key", "refuse_unsupported", "copy_", "clone", "replay")


class NoReplay:
    """A stand-in CUDA graph: captured by running the call once; a replay does nothing (its output stays)."""

    def __init__(self, run):
        self.out = run()

    def replay(self):
        pass


def main() -> None:
    import comfy.model_management as mm

    from fluxaccel.core.compile.call_graphs import CallGraphs
    from fluxaccel.core.compile.compiled import CompiledFlux
    from fluxaccel.core.compile.config import CompileConfig
    from fluxaccel.core.compile.patch import _install
    from support.models import build_flux
    from support.runs import sample
    from support.shapes import TINY

    model = build_flux({**TINY, "depth": 19, "depth_single_blocks": 38}, dtype=torch.float32)
    mm.load_models_gpu([model])
    dm = model.model.diffusion_model
    cfg = CompileConfig(graph_capture="call", persistent_cache=False)
    CompileConfig.inductor_options = lambda self, device: {"cpp_wrapper": True}  # the GPU's C++ wrapper, on the CPU
    compiled = CompiledFlux(dm, cfg, torch.device("cpu"))
    compiled.runner.call_graphs = CallGraphs(capture=lambda run: (lambda g: (g, g.out))(NoReplay(run)))
    clone = _install(model.clone(), compiled)[0]
    t0 = time.perf_counter()
    sample(clone, steps=STEPS)  # compiles the two block kinds, captures
    print(f"PROBE first run (compiles) {time.perf_counter() - t0:.1f} s; "
          f"parameters and buffers: {sum(1 for _ in dm.parameters()) + sum(1 for _ in dm.buffers())}")
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(RUNS):
        sample(clone, steps=STEPS)
    prof.disable()
    wall = time.perf_counter() - t0
    calls = RUNS * STEPS
    cg = compiled.runner.call_graphs
    print(f"PROBE {RUNS} runs x {STEPS} steps: {1000 * wall / RUNS:.1f} ms per run under cProfile, replays {cg.replays}")
    stats = pstats.Stats(prof)
    rows = []
    for (file, line, name), (cc, nc, tt, ct, _) in stats.stats.items():
        if ct / calls > 0.05e-3 and (file.startswith(str(ROOT)) or "comfy" in file or name in FUNCS):
            rows.append((ct / calls * 1000, nc / calls, f"{Path(file).name}:{line} {name}"))
    for ms, n, where in sorted(rows, reverse=True)[:45]:
        print(f"PROBE {ms:8.3f} ms/call  {n:6.1f} calls/call  {where}")


if __name__ == "__main__":
    main()
