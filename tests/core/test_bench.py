"""core/bench.py: the side-by-side measurement on the tiny model (CPU), without a server."""
import math

import pytest
import torch

from core.bench import BenchCase, benchmark
from core.compile import CompileConfig
from core.compile_patch import apply_compile
from core.test_models import synthetic_conditioning


def test_accelerated_first_run_precedes_the_baseline(tiny_flux):
    """A fresh process's first image: the accelerated model's first run (compile and all) comes before the
    baseline has been loaded, so it does not include a switch away from the baseline. Timed runs then alternate."""
    torch._dynamo.reset()
    accel, _ = apply_compile(tiny_flux, CompileConfig(cuda_graphs=False))
    pos = synthetic_conditioning("tiny", text_len=16)
    said = []
    case = BenchCase(width=128, height=128, steps=1, runs=2)
    rows = benchmark([("eager", tiny_flux), ("compiled", accel)], case, pos, pos, on_progress=said.append)
    firsts = [m.split(":")[0] for m in said if "first run" in m]
    assert firsts == ["compiled", "eager"]
    timed = [m for m in said if "timed run" in m]
    assert timed == ["eager: timed run 1/2", "compiled: timed run 1/2", "eager: timed run 2/2", "compiled: timed run 2/2"]
    # rows stay in the caller's order: the baseline first, speedup against it
    assert [r.config for r in rows] == ["eager", "compiled"]
    assert all(math.isfinite(r.first_run_s) and r.first_run_s > 0 for r in rows)
    assert rows[1].speedup_vs_eager == pytest.approx(rows[0].s_per_image_median / rows[1].s_per_image_median)
    assert rows[1].denoiser_rel_err < 2e-2 and rows[0].denoiser_rel_err == 0


def test_equal_labels_get_their_own_rows(tiny_flux, cpu_fp8):
    """Two different models under one label (e.g. two Benchmark inputs both called 'fp8') must be two rows, each
    measured against the baseline; keyed by label, the second used to overwrite the first (speedup 1.00, error 0)."""
    from core.fp8 import Fp8Config
    from core.fp8_patch import apply_fp8

    fp8, _ = apply_fp8(tiny_flux, Fp8Config("per_tensor"))
    pos = synthetic_conditioning("tiny", text_len=16)
    rows = benchmark([("x", tiny_flux), ("x", fp8)], BenchCase(width=128, height=128, steps=1, runs=1), pos, pos)
    assert [r.config for r in rows] == ["x", "x #2"]
    assert rows[0].denoiser_rel_err == 0 and rows[1].denoiser_rel_err > 1e-3


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_denoiser_outputs_go_through_comfyuis_sampling_path(tiny_flux, compiled):
    """The fidelity forwards are ComfyUI's own: the model's x0 prediction at each sigma (checked against BaseModel's
    apply_model with the same conditioning), one model call per sigma at the sampler's batch (cond + uncond in one
    batch when cfg > 1), through the model's wrappers (a compiled model runs compiled)."""
    import comfy.model_management as mm

    from core.bench import FIDELITY_SIGMAS, denoiser_outputs
    from core.compile_patch import compiled_of

    model = apply_compile(tiny_flux, CompileConfig(cuda_graphs=False))[0] if compiled else tiny_flux
    pos = synthetic_conditioning("tiny", text_len=16)
    neg = synthetic_conditioning("tiny", text_len=16, seed=5)
    case = BenchCase(width=128, height=128, seed=7)
    outs = denoiser_outputs(model, case, pos, neg)
    assert len(outs) == len(FIDELITY_SIGMAS) and outs[0].shape == (1, 16, 16, 16)
    # the reference: BaseModel.apply_model on the same inputs, as the sampler prepares them
    mm.load_models_gpu([tiny_flux])
    bm = tiny_flux.model
    g = torch.Generator().manual_seed(case.seed + 1)
    x0, noise = torch.randn(outs[0].shape, generator=g), torch.randn(outs[0].shape, generator=g)
    ctx, extra = pos[0]
    for s, out in zip(FIDELITY_SIGMAS, outs):
        sigma = torch.tensor([s])
        x = bm.model_sampling.noise_scaling(sigma, noise, bm.process_latent_in(x0))
        ref = bm.process_latent_out(bm.apply_model(x, sigma, c_crossattn=ctx, y=extra["pooled_output"],
                                                   guidance=torch.tensor([extra["guidance"]])))
        err = (out - ref.float()).norm() / ref.float().norm()
        assert err < (2e-2 if compiled else 1e-6), (s, float(err))
    if compiled:
        c = compiled_of(model)
        assert c.stats.calls == len(FIDELITY_SIGMAS) and c.stats.eager_calls == 0
        # cfg 3.5: the sampler batches cond and uncond into one call of batch 2, which this strict model refuses
        from core.errors import FluxAccelError

        with pytest.raises(FluxAccelError, match="compiled for batch 1.*but received batch 2"):
            denoiser_outputs(model, BenchCase(width=128, height=128, cfg=3.5), pos, neg)
