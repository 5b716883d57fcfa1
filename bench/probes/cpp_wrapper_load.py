"""What loading a warm-start package of inductor's C++ wrapper (graph_capture "call") costs in a new process, with
and without inductor's cache on disk. A small module is AOT-compiled with cpp_wrapper through FluxAccel's warm_start
and saved; two new processes load it: one beside the inductor cache the compile filled, one with an emptied cache.
Each prints its load time and the C++ builds it ran. CPU by default (PROBE_DEVICE=cuda on a GPU).

    OMP_NUM_THREADS=1 FLUXACCEL_COMFYUI=0.33.0 .cache/venv-0.33.0/bin/python bench/probes/cpp_wrapper_load.py
"""
from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def child(step: str, work: Path) -> None:
    import torch

    sys.path.insert(0, str(ROOT))
    from tools.plugin import register

    register()
    from fluxaccel.core.compile import warm_start
    from fluxaccel.core.upstream import torch_internals
    from warm_start import count_builds  # bench/probes/warm_start.py, beside this file

    builds = count_builds()
    device = os.environ.get("PROBE_DEVICE", "cpu")
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64)).to(device)
    x = torch.randn(8, 64, device=device)
    t = time.perf_counter()
    if step == "save":
        fn = warm_start.aot_compile(m, {"cpp_wrapper": True}, (x,), {})
        fn(m, x)
        (work / "package").write_bytes(torch_internals.serialize_aot(fn))
    else:
        fn = torch.compiler.load_compiled_function(io.BytesIO((work / "package").read_bytes()))
        fn(m, x)
    for target, seconds in builds:
        print(f"PROBE   build {seconds:.2f} s: {target}")
    print(f"PROBE {step}: {time.perf_counter() - t:.2f} s, {len(builds)} C++ build(s) taking "
          f"{sum(s for _, s in builds):.2f} s")


def main() -> None:
    if len(sys.argv) > 2:
        return child(sys.argv[1], Path(sys.argv[2]))
    with tempfile.TemporaryDirectory(prefix="fluxaccel-cppw-") as work:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(Path(work) / "inductor")}
        for step in ("save", "load (inductor's cache on disk)", "load (inductor's cache emptied)"):
            if "emptied" in step:
                shutil.rmtree(Path(work) / "inductor", ignore_errors=True)
            out = subprocess.run([sys.executable, __file__, step.split()[0] if step == "save" else step, work], env=env,
                                 capture_output=True, text=True)
            print("\n".join(line for line in out.stdout.splitlines() if line.startswith("PROBE")) or out.stderr[-2000:])


if __name__ == "__main__":
    main()
