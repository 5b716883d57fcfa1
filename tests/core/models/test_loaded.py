"""core/comfy_compat.py against ComfyUI 0.33's real classes: dynamic VRAM's non-dynamic delegate, core's per-block
CUDA-graph registry. ComfyUI 0.3.75 has neither: there the tests check that nothing is done.

ModelPatcherDynamic cannot be constructed on a CPU machine (ModelPatcherDynamic.__new__ returns a plain ModelPatcher
for CPU load devices, and its __init__ needs comfy-aimdo's native library): `dynamic_patcher` builds an instance of
the real class with ModelPatcher's own __init__, so is_dynamic(), clone(disable_dynamic=True) and
get_non_dynamic_delegate() are 0.33's code, reloading the file through the real comfy.sd.load_diffusion_model.
"""
import pytest
import torch

from conftest import COMFY_VERSION
from fluxaccel.core.models import loaded as comfy_compat
from fluxaccel.core.compile.config import CompileConfig
from fluxaccel.core.compile.patch import apply_compile, compiled_of
from fluxaccel.core.errors import FluxAccelError
from fluxaccel.core.quant.fp8 import Fp8Config
from fluxaccel.core.quant.patch import FP8_KEY, apply_fp8
from support.runs import denoise_once

ON_033 = COMFY_VERSION != "0.3.75"
needs_033 = pytest.mark.skipif(not ON_033, reason="ComfyUI 0.3.75 has no dynamic VRAM / core per-block CUDA graphs")


@pytest.fixture(scope="module")
def e2e_file():
    from conftest import ROOT
    from support.models import write_flux_file

    return write_flux_file(ROOT / ".cache" / "models" / "diffusion_models" / "fluxaccel-random-e2e-3072.safetensors", "e2e-3072")


def dynamic_patcher(path, with_init=True):
    import comfy.model_patcher as mp
    import comfy.sd

    plain = comfy.sd.load_diffusion_model(str(path), model_options={"dtype": torch.bfloat16})  # UNETLoader's loader: sets cached_patcher_init
    dyn = object.__new__(mp.ModelPatcherDynamic)
    mp.ModelPatcher.__init__(dyn, plain.model, plain.load_device, plain.offload_device)
    dyn.non_dynamic_delegate_model = None
    plain.model.dynamic_vbars, plain.model.dynamic_pins = {}, {}
    dyn.cached_patcher_init = plain.cached_patcher_init if with_init else None
    return dyn


def test_plain_models_are_used_as_they_are(tiny_flux):
    assert not comfy_compat.is_dynamic(tiny_flux)
    assert comfy_compat.resident(tiny_flux, "node") is tiny_flux


@needs_033
def test_dynamic_model_is_quantized_on_its_resident_delegate(cpu_fp8, e2e_file):
    dyn = dynamic_patcher(e2e_file)
    assert comfy_compat.is_dynamic(dyn)
    live = {n: m.weight for n, m in dyn.model.diffusion_model.named_modules() if isinstance(m, torch.nn.Linear)}
    fp8, report = apply_fp8(dyn, Fp8Config())
    assert not fp8.is_dynamic() and fp8.model is not dyn.model  # the delegate: the file loaded once more
    assert report.quantized and fp8.get_attachment(FP8_KEY) and dyn.get_attachment(FP8_KEY) is None
    assert not dyn.object_patches  # the dynamic model (other branches) is untouched
    assert all(m.weight is live[n] for n, m in dyn.model.diffusion_model.named_modules() if n in live)
    again, _ = apply_fp8(dyn, Fp8Config(granularity="per_tensor"))
    assert again.model is fp8.model  # the delegate is kept by the dynamic patcher: no third copy
    # the same numbers as quantizing the plain (non-dynamic) load of the same file
    import comfy.sd

    ref, _ = apply_fp8(comfy.sd.load_diffusion_model(str(e2e_file), model_options={"dtype": torch.bfloat16}), Fp8Config())
    assert torch.equal(denoise_once(fp8, hw=8), denoise_once(ref, hw=8))


@needs_033
def test_dynamic_model_is_compiled_on_its_resident_delegate(e2e_file):
    dyn = dynamic_patcher(e2e_file)
    clone, compiled = apply_compile(dyn, CompileConfig(block_regions=False))
    assert not clone.is_dynamic() and clone.model is not dyn.model and compiled_of(clone) is compiled
    assert compiled_of(dyn) is None and compiled._dm is clone.model.diffusion_model


@needs_033
def test_dynamic_model_without_a_loader_to_reload_from_is_refused(e2e_file):
    dyn = dynamic_patcher(e2e_file, with_init=False)
    for apply in (lambda m: apply_fp8(m, Fp8Config()), lambda m: apply_compile(m, CompileConfig())):
        with pytest.raises(FluxAccelError, match="dynamic VRAM.*UNETLoader.*--disable-dynamic-vram"):
            apply(dyn)


@needs_033
def test_blocks_captured_by_core_cuda_graphs_are_refused(tiny_flux):
    import comfy.model_prefetch

    block = tiny_flux.model.diffusion_model.double_blocks[1]
    comfy.model_prefetch.GRAPH_WARMED_MODULES.add(block)  # what prefetch_queue_pop records before it captures
    try:
        assert comfy_compat.core_block_graphs(tiny_flux.model.diffusion_model) == ["diffusion_model.double_blocks.1"]
        with pytest.raises(FluxAccelError, match="per-block CUDA graph on diffusion_model.double_blocks.1"):
            apply_compile(tiny_flux, CompileConfig(cuda_graphs=True))
    finally:
        comfy.model_prefetch.GRAPH_WARMED_MODULES.discard(block)
    assert comfy_compat.core_block_graphs(tiny_flux.model.diffusion_model) == []


def test_flux_forward_leaves_core_cuda_graph_registry_empty(tiny_flux):
    """FLUX's forward does not use core's per-block graphs: no capture inside ours (both hosts: nothing to find)."""
    clone, _ = apply_compile(tiny_flux, CompileConfig(cuda_graphs=True, block_regions=False))
    denoise_once(clone, hw=8)
    assert comfy_compat.core_block_graphs(clone.model.diffusion_model) == []
