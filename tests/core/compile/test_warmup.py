"""core/compile/warmup.py: shapes registered and compiled before the real run; the real run compiles nothing."""
import pytest
import torch

from fluxaccel.core.compile.config import CompileConfig

from fluxaccel.core.compile.shapes import ShapeKey
from fluxaccel.core.compile.patch import apply_compile, compiled_of
from fluxaccel.core.errors import FluxAccelError
from support.models import synthetic_conditioning
from fluxaccel.core.compile.warmup import WarmupPlan, parse_resolutions, warmup
from fluxaccel.core.models import swaps
from support.runs import clear_compile_counters, compiled_graphs


def test_parse_resolutions():
    assert parse_resolutions("1024x1024, 832x1216") == [(1024, 1024), (832, 1216)]
    assert parse_resolutions(" 128X128;128x128  64×64") == [(128, 128), (64, 64)]
    with pytest.raises(FluxAccelError, match="multiples of 16"):
        parse_resolutions("1000x1000")
    with pytest.raises(FluxAccelError, match="WIDTHxHEIGHT"):
        parse_resolutions("big")


def test_warmup_then_real_runs_compile_nothing(tiny_flux):
    import comfy.sample

    clear_compile_counters()
    torch._dynamo.reset()
    upstream, compiled = apply_compile(tiny_flux, CompileConfig(resolution_policy="strict", separate_process=False))
    ticks = []
    model, secs = warmup(upstream, WarmupPlan([(128, 128), (128, 192)], text_length=16, cfg=1.0, steps=2),
                         on_step=lambda: ticks.append(1))
    assert len(ticks) == 4 and len(secs) == 2 and all(s > 0 for s in secs.values())
    assert compiled_of(model).stats.shapes == [ShapeKey(1, 16, 16, 16, "bfloat16"), ShapeKey(1, 24, 16, 16, "bfloat16")]
    assert compiled.stats.shapes == [] and compiled_of(model) is not compiled, "the Compile node's output is unchanged"
    assert compiled.stats.compile_seconds.keys() == compiled_of(model).stats.compile_seconds.keys(), \
        "what the shared compiled callable compiled is known to both (no second 'compiled' for a shared shape)"
    graphs = compiled_graphs()
    assert graphs == 4  # one graph per block kind and warmed shape (traced, or loaded from an earlier test's package)
    pos = synthetic_conditioning("tiny", text_len=16, seed=42)
    for h, w in ((16, 16), (24, 16)):  # the user's prompts: other text, other seed, both warmed shapes
        latent = torch.zeros(1, 16, h, w)
        comfy.sample.sample(model, comfy.sample.prepare_noise(latent, 7), 3, 1.0, "euler", "simple", pos, pos, latent,
                            disable_pbar=True, seed=7)
    assert compiled_graphs() == graphs, "warmed shapes must not compile again"
    with pytest.raises(FluxAccelError, match="compiled for batch 1, latent 16x16 .*; batch 1, latent 24x16"):
        latent = torch.zeros(1, 16, 32, 32)
        comfy.sample.sample(model, latent, 1, 1.0, "euler", "simple", pos, pos, latent, disable_pbar=True, seed=0)
    torch._dynamo.reset()


def test_warmup_respects_max_shapes_and_a_failed_one_leaves_the_input_as_it_was(tiny_flux):
    model, compiled = apply_compile(tiny_flux, CompileConfig(max_shapes=1, separate_process=False))
    with pytest.raises(FluxAccelError, match="more shapes than the Compile node's max_shapes \\(1\\)"):
        warmup(model, WarmupPlan([(128, 128), (192, 128)], text_length=16, steps=1))
    assert compiled.stats.shapes == [] and compiled.stats.calls == 0


def test_a_sibling_branch_of_the_compile_output_keeps_its_strict_policy(tiny_flux):
    """Compile -> Warmup (two shapes) in one branch, the same Compile output straight into a KSampler in another:
    the sibling is strict (its first shape only), and reuses the warmed graph for it (no new compile)."""
    import comfy.sample

    clear_compile_counters()
    torch._dynamo.reset()
    upstream, compiled = apply_compile(tiny_flux, CompileConfig(resolution_policy="strict", separate_process=False))
    warmup(upstream, WarmupPlan([(128, 128), (128, 192)], text_length=16, steps=1))
    graphs = compiled_graphs()
    pos = synthetic_conditioning("tiny", text_len=16, seed=42)
    latent = torch.zeros(1, 16, 16, 16)
    comfy.sample.sample(upstream, latent, 1, 1.0, "euler", "simple", pos, pos, latent, disable_pbar=True, seed=0)
    assert compiled_graphs() == graphs
    with pytest.raises(FluxAccelError, match="compiled for batch 1, latent 16x16 .*, but received batch 1, latent 24x16"):
        latent = torch.zeros(1, 16, 24, 16)
        comfy.sample.sample(upstream, latent, 1, 1.0, "euler", "simple", pos, pos, latent, disable_pbar=True, seed=0)
    torch._dynamo.reset()


def test_parse_resolutions_with_reference_images():
    assert parse_resolutions("1024x1024+1024x1024, 832x1216") == [(1024, 1024, ((1024, 1024),)), (832, 1216)]
    assert parse_resolutions("512x512+256x256+128x256") == [(512, 512, ((256, 256), (128, 256)))]
    with pytest.raises(FluxAccelError, match="reference size 100x100 in resolutions is not a FLUX size"):
        parse_resolutions("128x128+100x100")


def test_reference_sizes_are_warmed_refused_under_strict_and_counted_under_recompile(tiny_flux):
    """FLUX.1 Kontext: reference latents lengthen the image tokens. Warmup compiles a (resolution, reference size)
    pair; strict then refuses another reference size naming it; recompile compiles it as a shape of its own."""
    import comfy.sample

    clear_compile_counters()
    torch._dynamo.reset()
    upstream, _ = apply_compile(tiny_flux, CompileConfig(resolution_policy="strict", separate_process=False))
    model, _ = warmup(upstream, WarmupPlan([(128, 128, ((128, 128),))], text_length=16, steps=1))
    key = compiled_of(model).stats.shapes[0]
    assert key.refs == ((16, 16),) and "reference latents 128x128 px" in key.describe()
    graphs = compiled_graphs()
    pos = synthetic_conditioning("tiny", text_len=16, seed=42)

    def kontext(ref_hw):
        ref = torch.randn(1, 16, *ref_hw)
        cond = [[c, {**extra, "reference_latents": [ref]}] for c, extra in pos]
        latent = torch.zeros(1, 16, 16, 16)
        comfy.sample.sample(model, latent, 1, 1.0, "euler", "simple", cond, cond, latent, disable_pbar=True, seed=0)

    kontext((16, 16))
    assert compiled_graphs() == graphs, "the warmed pair must not compile again"
    with pytest.raises(FluxAccelError, match=r"Only the reference image differs: reference latents 192x128 px where "
                                             r"the compiled shape has reference latents 128x128 px"):
        kontext((16, 24))
    assert compiled_graphs() == graphs
    again, compiled = apply_compile(tiny_flux, CompileConfig(resolution_policy="recompile", max_shapes=4, separate_process=False))
    model = again
    kontext((16, 16))
    kontext((16, 24))
    assert [k.refs for k in compiled.stats.shapes] == [((16, 16),), ((16, 24),)]
    assert len(compiled.stats.compile_seconds) == 2 and compiled.stats.eager_calls == 0
    torch._dynamo.reset()


def test_a_size_past_comfyuis_largest_or_past_free_memory_is_refused_naming_warmup_and_resolutions(tiny_flux):
    """99984x99984 (past ComfyUI's MAX_RESOLUTION) and 16384x16384 (within it, but a model call of a million tokens
    needs more memory than the machine has): each refused before anything is allocated, naming the node, the input
    and the limit; a size that fits is planned."""
    from fluxaccel.core.compile.warmup import WarmupPlan, _shapes
    from fluxaccel.core.models.synthetic import synthetic_conditioning_for
    from fluxaccel.core.upstream import comfy_internals

    with pytest.raises(FluxAccelError, match=rf"Warmup: resolution 99984x99984 in resolutions is larger than "
                                             rf"ComfyUI's largest image side \({comfy_internals.max_resolution()}\)"):
        parse_resolutions("1024x1024, 99984x99984")
    pos = synthetic_conditioning_for(tiny_flux.model.diffusion_model, 16)
    with pytest.raises(FluxAccelError, match=r"Warmup \(FluxAccel\): resolution 16384x16384 in resolutions \(batch_size 1\) "
                                             r"needs about [\d.]+ GiB on cpu, which has [\d.]+ GiB free"):
        list(_shapes(tiny_flux, WarmupPlan(parse_resolutions("16384x16384")), pos, pos))
    assert len(list(_shapes(tiny_flux, WarmupPlan(parse_resolutions("64x64")), pos, pos))) == 1
