"""ComfyUI 0.33's host work per prompt that grows with FluxAccel's object patches (CPU only). At every prompt
ComfyUI's load_models_gpu calls the model's partially_load, which undoes and redoes every object patch
(comfy.utils.set_attr for each, twice). A FLUX of FLUX.1's depth (19 double, 38 single blocks) at a narrow width, as
it comes from UNETLoader, from Quantize FP8 (default settings: FP8 Linears and the fused GELU's Identities) and from
Compile after it (modulation_table on: the table's modulations too); load_models_gpu timed on the loaded model, as a
prompt after the first finds it, with the set_attr calls counted.

    OMP_NUM_THREADS=1 FLUXACCEL_COMFYUI=0.33.0 .cache/venv-0.33.0/bin/python bench/probes/repatch_host.py
"""
from __future__ import annotations

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

CALLS = 20


def main() -> None:
    import comfy.model_management as mm
    import comfy.utils

    from fluxaccel.core.compile.config import CompileConfig
    from fluxaccel.core.compile.patch import apply_compile
    from fluxaccel.core.quant.fp8 import Fp8Config
    from fluxaccel.core.quant.patch import apply_fp8
    from support.models import build_flux
    from support.shapes import TINY
    from tools.cpu_fp8 import lift_torchao_gate

    lift_torchao_gate()  # torchao's FP8 on the CPU, for this probe only
    base = build_flux({**TINY, "depth": 19, "depth_single_blocks": 38}, dtype=torch.bfloat16)
    quantized = apply_fp8(base, Fp8Config())[0]
    compiled = apply_compile(quantized, CompileConfig(modulation_table="on"))[0]
    count, set_attr = [0], comfy.utils.set_attr

    def counted(*args, **kwargs):
        count[0] += 1
        return set_attr(*args, **kwargs)

    comfy.utils.set_attr = counted
    try:
        for name, model in (("UNETLoader's model", base), ("Quantize FP8", quantized), ("Compile", compiled)):
            mm.load_models_gpu([model])  # loaded once, as by the first prompt
            count[0], t0 = 0, time.perf_counter()
            for _ in range(CALLS):
                mm.load_models_gpu([model])
            ms = 1e3 * (time.perf_counter() - t0) / CALLS
            print(f"{name:20s} object patches {len(model.object_patches):4d}  load_models_gpu {ms:6.2f} ms per "
                  f"prompt  set_attr calls {count[0] // CALLS}")
    finally:
        comfy.utils.set_attr = set_attr


if __name__ == "__main__":
    main()
