"""core/models/profiles.py: every FLUX architecture ComfyUI builds, quantized, compiled, warmed and benchmarked.

Each profile's tiny model is built in-process from ComfyUI's own classes (comfy.supported_models → model_base →
comfy.ldm.flux / comfy.ldm.chroma), bf16 on the CPU; FLUX.1 Kontext is FLUX.1 called with reference latents."""
import pytest
import torch

from conftest import COMFY_VERSION
from fluxaccel.core.bench.metrics import rel_err
from fluxaccel.core.compile.config import CompileConfig
from fluxaccel.core.compile.patch import apply_compile, compiled_of
from fluxaccel.core.errors import FluxAccelError
from fluxaccel.core.models.profiles import CHROMA, FLUX1, FLUX2, profile_of, require_profile
from fluxaccel.core.quant.fp8 import Fp8Config
from fluxaccel.core.quant.patch import apply_fp8
from support.models import build_flux
from support.runs import denoise_once
from support.shapes import TINY, TINY_CHROMA, TINY_FILL, TINY_FLUX2

pytestmark = pytest.mark.skipif(COMFY_VERSION != "0.33.0", reason="FLUX.2's FluxParams flags are ComfyUI 0.33's")

# (shape, expected profile, variant, reference latents of the call)
CASES = {
    "flux1": (TINY, FLUX1, "FLUX.1", ()),
    "fill": (TINY_FILL, FLUX1, "FLUX.1 Fill", ()),
    "kontext": (TINY, FLUX1, "FLUX.1", ((16, 16),)),
    "flux2": (TINY_FLUX2, FLUX2, "FLUX.2", ()),
    "flux2-refs": (TINY_FLUX2, FLUX2, "FLUX.2", ((8, 8), (16, 8))),
    "chroma": (TINY_CHROMA, CHROMA, "Chroma", ()),
}
HW = {"flux2": 8, "flux2-refs": 8}  # FLUX.2 latents are 1/16 of the image: 8x8 cells = 128 px


@pytest.mark.parametrize("case", ["flux1", "fill", "flux2", "chroma"])
def test_profile_read_from_comfyui_objects(case):
    shape, profile, variant, _ = CASES[case]
    dm = build_flux(shape).model.diffusion_model
    assert profile_of(dm) is profile and profile.variant(dm) == variant


def test_other_models_are_refused_by_name():
    from comfy.ldm.chroma_radiance.model import ChromaRadiance

    radiance = ChromaRadiance.__new__(ChromaRadiance)  # the class is all that is read: no weights needed
    torch.nn.Module.__init__(radiance)
    radiance.double_blocks, radiance.single_blocks = torch.nn.ModuleList(), torch.nn.ModuleList()
    with pytest.raises(FluxAccelError, match=r"FLUX.2 \(\[dev\].*ChromaRadiance.*pixel space"):
        require_profile(radiance, "ChromaRadiance", "Compile + CUDA Graph (FluxAccel)")
    with pytest.raises(FluxAccelError, match="received a Linear model .*class Linear"):
        require_profile(torch.nn.Linear(2, 2), "Linear", "Quantize FP8 (FluxAccel)")


@pytest.mark.parametrize("case", ["flux1", "fill", "kontext", "flux2", "flux2-refs", "chroma"])
def test_fp8_error_within_the_naive_torchao_recipe(cpu_fp8, case):
    """Quantize FP8's default (per-row, the profile's 'blocks' scope) against bf16, on one denoiser forward, is no
    worse than torchao's naive recipe (per-row FP8 on every Linear) on the same model and inputs."""
    shape, profile, _, refs = CASES[case]
    model = build_flux(shape)
    hw = HW.get(case, 16)
    ref = denoise_once(model, hw=hw, refs=refs)
    ours, report = apply_fp8(model, Fp8Config("per_row"))
    naive, _ = apply_fp8(model, Fp8Config("per_row", scope="all_linear"))  # torchao's numbers (tests/core/quant)
    e_ours, e_naive = rel_err(denoise_once(ours, hw=hw, refs=refs), ref), rel_err(denoise_once(naive, hw=hw, refs=refs), ref)
    assert 0 < e_ours < 0.08, e_ours  # the project's FP8 bound on a tiny model's forward (tests/core/quant)
    assert e_ours <= e_naive or e_naive != e_naive, (e_ours, e_naive)  # naive may overflow to NaN: worse still
    names = [n for n, m in model.model.diffusion_model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert sorted(report.quantized) == sorted(n for n in names if profile.in_scope(n, "blocks"))
    assert not any(profile.in_scope(n, "blocks") for n in report.skipped if "modulation" in n or "_mod." in n)


@pytest.mark.parametrize("case", ["flux1", "fill", "kontext", "flux2", "flux2-refs", "chroma"])
def test_compiled_equals_eager_in_float32(case):
    shape, _, _, refs = CASES[case]
    model = build_flux(shape, dtype=torch.float32)
    hw = HW.get(case, 16)
    ref = denoise_once(model, hw=hw, refs=refs)
    compiled_model, compiled = apply_compile(model, CompileConfig(separate_process=False))
    out = denoise_once(compiled_model, hw=hw, refs=refs)
    assert rel_err(out, ref) < 1e-4
    assert len(compiled.stats.shapes) == 1 and compiled.stats.eager_calls == 0
    assert compiled.stats.shapes[0].refs == tuple(refs)
    assert torch.equal(denoise_once(model, hw=hw, refs=refs), ref), "the input model runs uncompiled"


@pytest.mark.parametrize("case", ["kontext", "fill", "flux2-refs", "chroma"])
def test_quantize_compile_warmup_benchmark_chain(cpu_fp8, case, monkeypatch):
    """Quantize FP8 → Compile → Warmup → Benchmark on each architecture: Warmup compiles the shape (with its
    reference sizes), the Benchmark's runs at that shape compile nothing more, and its accelerated row is the FP8
    model's (error vs bf16 within the FP8 bound). The blocks' record registry starts empty, as in a new process (a
    record class first met inside the trace would compile the blocks once more)."""
    from fluxaccel.core.bench.benchmark import BenchCase, benchmark
    from fluxaccel.core.compile import blocks
    from fluxaccel.core.compile.warmup import WarmupPlan, warmup
    from fluxaccel.core.models.flux import latent_scale
    from fluxaccel.core.models.synthetic import synthetic_conditioning_for
    from support.runs import clear_compile_counters, compiled_graphs

    shape, _, _, refs = CASES[case]
    model = build_flux(shape)
    scale, ch = latent_scale(model), model.model.latent_format.latent_channels
    px = 128
    clear_compile_counters()
    torch._dynamo.reset()
    monkeypatch.setattr(blocks, "_RECORDS", {})
    q, _ = apply_fp8(model, Fp8Config("per_row"))
    compiled_model, _ = apply_compile(q, CompileConfig(separate_process=False))
    pixel_refs = tuple((w * scale, h * scale) for h, w in refs)
    warmed, secs = warmup(compiled_model, WarmupPlan([(px, px, pixel_refs) if refs else (px, px)], text_length=16, steps=1))
    key = compiled_of(warmed).stats.shapes[0]
    assert key.refs == tuple(refs) and key.height == px // scale and len(secs) == 1
    graphs = compiled_graphs()
    assert graphs == 2  # one per block kind
    pos = synthetic_conditioning_for(model.model.diffusion_model, 16)
    if refs:
        pos = [[c, {**extra, "reference_latents": [torch.randn(1, ch, h, w) for h, w in refs]}] for c, extra in pos]
    rows = benchmark([("eager", model), ("accelerated", warmed)], BenchCase(width=px, height=px, steps=1, runs=1),
                     pos, pos)
    assert compiled_graphs() == graphs, "the warmed shape must not compile again"
    assert [r.config for r in rows] == ["eager", "accelerated"]
    assert 0 < rows[1].denoiser_rel_err < 0.08
    torch._dynamo.reset()


# files UNETLoader loads: ComfyUI's own detection (comfy/model_detection.py) must recognise each architecture
FILES = {
    "flux2": ("e2e-flux2", "FLUX.2", "Flux2"),
    "fill": ({**TINY_FILL, "context_in_dim": 4096, "vec_in_dim": 768}, "FLUX.1 Fill", "Flux"),
    "chroma": ("e2e-chroma", "Chroma", "Chroma"),  # Chroma's guidance network is 3072 wide in ComfyUI's detection
}


@pytest.mark.parametrize("case", sorted(FILES))
def test_files_are_detected_by_comfyui_and_quantized(cpu_fp8, case, tmp_path_factory):
    """A random-weight file per architecture, loaded by UNETLoader's loader (comfy.sd.load_diffusion_model):
    detected as that architecture, and quantized by Quantize FP8 with its profile's scope."""
    import comfy.sd

    from conftest import ROOT
    from support.models import write_flux_file

    shape, variant, model_class = FILES[case]
    name = shape if isinstance(shape, str) else "e2e-fill"
    path = write_flux_file(ROOT / ".cache" / "models" / "diffusion_models" / f"fluxaccel-random-{name}.safetensors",
                           shape)
    model = comfy.sd.load_diffusion_model(str(path), model_options={"dtype": torch.bfloat16})
    dm = model.model.diffusion_model
    assert type(model.model).__name__ == model_class and profile_of(dm).variant(dm) == variant
    q, report = apply_fp8(model, Fp8Config("per_row"))
    profile = profile_of(dm)
    names = [n for n, m in dm.named_modules() if isinstance(m, torch.nn.Linear)]
    assert sorted(report.quantized) == sorted(n for n in names if profile.in_scope(n, "blocks"))
    if case != "chroma":  # one forward of the 3072-wide Chroma's guidance network costs ~10 s here: flux2/fill only
        ref = denoise_once(model, hw=8 if case == "flux2" else 16)
        out = denoise_once(q, hw=8 if case == "flux2" else 16)
        assert 0 < rel_err(out, ref) < 0.08


def test_an_architecture_without_references_compiles_one_shape_whatever_references_arrive():
    """Chroma gets reference latents from ComfyUI like FLUX.1 (its model class inherits their conditioning) and its
    forward ignores them: the compiled call leaves them out, so another reference size is neither a new shape nor a
    refusal, and the output is eager's."""
    model = build_flux(TINY_CHROMA, dtype=torch.float32)
    ref = denoise_once(model, refs=((16, 16),))
    assert torch.equal(ref, denoise_once(model)), "ComfyUI's Chroma ignores reference latents"
    compiled_model, compiled = apply_compile(model, CompileConfig(separate_process=False))
    assert rel_err(denoise_once(compiled_model, refs=((16, 16),)), ref) < 1e-4
    assert rel_err(denoise_once(compiled_model, refs=((8, 24),)), ref) < 1e-4
    assert [k.refs for k in compiled.stats.shapes] == [()] and len(compiled.stats.compile_seconds) == 1
