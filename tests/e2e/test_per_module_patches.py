"""tools/prompt_split_node's FluxAccelPerModulePatches (the bench's A/B of the object-patch layout): the same modules
as FluxAccel's block patches, one object patch per module, and ComfyUI re-applies that many at every prompt."""
import sys

import torch

from conftest import ROOT
from fluxaccel.core.compile.config import CompileConfig
from fluxaccel.core.compile.patch import apply_compile
from fluxaccel.core.models import swaps
from fluxaccel.core.quant.fp8 import Fp8Config
from fluxaccel.core.quant.patch import apply_fp8
from support.runs import flux_inputs, forward, repatches_per_prompt


def test_the_per_module_layout_runs_the_same_modules_with_a_patch_each(cpu_fp8, tiny_flux, monkeypatch):
    sys.path.insert(0, str(ROOT / "tools" / "prompt_split_node"))
    from fluxaccel_prompt_split import NODE_CLASS_MAPPINGS

    inputs = flux_inputs(tiny_flux.model.diffusion_model)
    grouped = apply_compile(apply_fp8(tiny_flux, Fp8Config())[0], CompileConfig(separate_process=False))[0]
    (per_module,) = NODE_CLASS_MAPPINGS["FluxAccelPerModulePatches"]().run(grouped)
    assert dict(swaps.items(per_module)) == dict(swaps.items(grouped))
    assert set(per_module.object_patches) == {k for k, _ in swaps.items(grouped)}
    assert len(per_module.object_patches) > len(grouped.object_patches) == 4  # tiny FLUX: 2 double, 2 single blocks
    assert repatches_per_prompt(monkeypatch, per_module) == 2 * len(per_module.object_patches)
    assert torch.equal(forward(per_module, inputs), forward(grouped, inputs))
