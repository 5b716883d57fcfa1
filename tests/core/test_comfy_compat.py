"""core/comfy_compat.py: what newer ComfyUI releases leave on a model, recreated with 0.3.75's real classes."""
import pytest
import torch

from core.compile import CompileConfig
from core.compile_patch import apply_compile
from core.errors import FluxAccelError
from core.fp8 import Fp8Config
from core.fp8_patch import apply_fp8


def test_dynamic_vram_patcher_is_refused_with_the_flag(cpu_fp8, tiny_flux):
    import comfy.model_patcher

    class ModelPatcherDynamic(comfy.model_patcher.ModelPatcher):  # the class name newer ComfyUI uses
        pass

    dyn = ModelPatcherDynamic(tiny_flux.model, tiny_flux.load_device, tiny_flux.offload_device)
    for apply in (lambda m: apply_fp8(m, Fp8Config()), lambda m: apply_compile(m, CompileConfig())):
        with pytest.raises(FluxAccelError, match="dynamic VRAM.*--disable-dynamic-vram"):
            apply(dyn)


def test_foreign_cuda_graph_compiler_is_refused(tiny_flux):
    m = tiny_flux.clone()
    m.add_wrapper_with_key("diffusion_model", "comfy.cuda_graphs", lambda executor, *a, **k: executor(*a, **k))
    with pytest.raises(FluxAccelError, match="per-block \\(regional\\) compile.*comfy.cuda_graphs"):
        apply_compile(m, CompileConfig(cuda_graphs=True))


def test_already_quantized_tensor_subclass_is_refused(cpu_fp8, tiny_flux):
    class QuantizedTensor(torch.Tensor):  # stands for ComfyUI's mixed-precision weight class
        pass

    lin = tiny_flux.model.diffusion_model.double_blocks[0].img_attn.qkv
    lin.weight = torch.nn.Parameter(lin.weight.data.as_subclass(QuantizedTensor), requires_grad=False)
    with pytest.raises(FluxAccelError, match="already quantized by ComfyUI's mixed-precision ops.*QuantizedTensor"):
        apply_fp8(tiny_flux, Fp8Config())
