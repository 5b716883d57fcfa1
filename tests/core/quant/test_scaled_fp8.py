"""Scaled-FP8 checkpoints (ComfyUI's mixed-precision format: float8_e4m3fn weights + weight_scale, QuantizedTensor
weights once loaded): Quantize FP8 re-quantizes them, says so, and the result compiles. The checkpoint is written
here in that format from the e2e bf16 file and loaded by ComfyUI's own loader (comfy.sd.load_diffusion_model)."""
import pytest
import torch

from conftest import ROOT
from fluxaccel.core.models import loaded as comfy_compat
from fluxaccel.core.compile.config import CompileConfig
from fluxaccel.core.compile.patch import apply_compile
from fluxaccel.core.errors import FluxAccelError
from fluxaccel.core.quant.fp8 import Fp8Config
from fluxaccel.core.quant.patch import apply_fp8
from support.runs import denoise_once
from fluxaccel.core.bench.metrics import rel_err

MODELS = ROOT / ".cache" / "models" / "diffusion_models"
BF16 = {"dtype": torch.bfloat16}  # the mixed-precision model computes in float32 on the CPU otherwise


rel = rel_err


@pytest.fixture(scope="module")
def files():
    from support.models import write_flux_file, write_scaled_fp8_file

    bf16 = write_flux_file(MODELS / "fluxaccel-random-e2e.safetensors", "e2e")
    return bf16, write_scaled_fp8_file(MODELS / "fluxaccel-random-e2e-scaled-fp8.safetensors", bf16)


def load(path):
    import comfy.sd

    return comfy.sd.load_diffusion_model(str(path), model_options=BF16)


def test_comfyui_loads_the_file_as_quantized_tensors(files):
    m = load(files[1])
    dm = m.model.diffusion_model
    qkv = dm.double_blocks[0].img_attn.qkv
    assert comfy_compat.is_checkpoint_quantized(qkv.weight) and comfy_compat.linear_like(qkv)
    assert not isinstance(qkv, torch.nn.Linear)  # MixedPrecisionOps' own Linear
    assert comfy_compat.checkpoint_format(qkv) == "float8_e4m3fn (TensorCoreFP8E4M3Layout)"
    assert not comfy_compat.is_checkpoint_quantized(dm.final_layer.linear.weight)


@pytest.mark.parametrize("granularity", ["per_row", "per_tensor"])
def test_quantize_requantizes_and_reports(cpu_fp8, files, granularity):
    bf16, scaled = load(files[0]), load(files[1])
    q, report = apply_fp8(scaled, Fp8Config(granularity=granularity))
    fmt = comfy_compat.checkpoint_format(scaled.model.diffusion_model.double_blocks[0].img_attn.qkv)
    assert report.requantized == {fmt: 10}
    assert sorted(report.dequantized) == sorted(["img_in", "txt_in", "double_blocks.0.img_mod.lin",
                                                 "double_blocks.0.txt_mod.lin", "single_blocks.0.modulation.lin"])
    text = report.summary()
    assert "checkpoint already quantized (float8_e4m3fn" in text and "re-quantized " + granularity in text
    assert "dequantized to bf16 (5" in text
    ref = denoise_once(bf16, hw=8)
    ours = denoise_once(q, hw=8)
    assert not comfy_compat.kitchen_quantized(q.model.diffusion_model)  # loaded: no QuantizedTensor runs
    from_bf16 = denoise_once(apply_fp8(bf16, Fp8Config(granularity=granularity))[0], hw=8)
    scaled_eager = denoise_once(scaled, hw=8)
    # fidelity against the bf16 model: FP8 of a scaled-FP8 file is within the FP8 error of quantizing from bf16
    # (the file's per-tensor rounding comes on top), and no worse than running the file as ComfyUI does
    e_ours, e_bf16, e_file = rel(ours, ref), rel(from_bf16, ref), rel(scaled_eager, ref)
    assert 0 < e_ours < 0.1 and e_ours < e_bf16 + e_file + 0.01, (e_ours, e_bf16, e_file)
    assert scaled.object_patches == {}  # the loaded model is untouched


def test_compile_runs_on_the_requantized_model(cpu_fp8, files):
    scaled = load(files[1])
    q, _ = apply_fp8(scaled, Fp8Config())
    # compiled straight after Quantize, before any load, as in a prompt: the live modules are still the
    # checkpoint's QuantizedTensor ones; the clone's object patches replace them at load
    clone, compiled = apply_compile(q, CompileConfig(separate_process=False))
    eager = denoise_once(q, hw=8)
    out = denoise_once(clone, hw=8)
    assert compiled.stats.calls == 1 and compiled.stats.eager_calls == 0
    assert rel(out, eager) < 0.02


def test_compile_without_quantize_names_the_fix(files):
    with pytest.raises(FluxAccelError, match="already quantized by ComfyUI's mixed-precision ops.*Put Quantize FP8"):
        apply_compile(load(files[1]), CompileConfig(separate_process=False))
