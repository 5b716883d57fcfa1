"""core/bench/benchmark.py: the side-by-side measurement on the tiny model (CPU), without a server."""
import math

import pytest
import torch

from fluxaccel.core.bench.benchmark import BenchCase, Hooks, benchmark
from fluxaccel.core.compile.config import CompileConfig
from fluxaccel.core.compile.patch import apply_compile
from support.models import synthetic_conditioning
from fluxaccel.core.bench.metrics import rel_err


def test_accelerated_first_run_precedes_the_baseline(tiny_flux):
    """A fresh process's first image: the accelerated model's first run (compile and all) comes before the
    baseline has been loaded, so it does not include a switch away from the baseline. Timed runs then alternate."""
    torch._dynamo.reset()
    accel, _ = apply_compile(tiny_flux, CompileConfig(separate_process=False))
    pos = synthetic_conditioning("tiny", text_len=16)
    said = []
    case = BenchCase(width=128, height=128, steps=1, runs=2)
    rows = benchmark([("eager", tiny_flux), ("compiled", accel)], case, pos, pos, Hooks(on_progress=said.append))
    firsts = [m.split(":")[0] for m in said if "first run" in m]
    assert firsts == ["compiled", "eager"]
    timed = [m for m in said if "timed run" in m]
    assert timed == ["eager: timed run 1/2", "compiled: timed run 1/2", "eager: timed run 2/2", "compiled: timed run 2/2"]
    # rows stay in the caller's order: the baseline first, speedup against it
    assert [r.config for r in rows] == ["eager", "compiled"]
    assert all(math.isfinite(r.first_run_s) and r.first_run_s > 0 for r in rows)
    assert rows[1].speedup_vs_baseline == pytest.approx(rows[0].s_per_image_median / rows[1].s_per_image_median)
    assert rows[1].denoiser_rel_err < 2e-2 and rows[0].denoiser_rel_err == 0


def test_equal_labels_get_their_own_rows(tiny_flux, cpu_fp8):
    """Two different models under one label (e.g. two Benchmark inputs both called 'fp8') must be two rows, each
    measured against the baseline; keyed by label, the second used to overwrite the first (speedup 1.00, error 0)."""
    from fluxaccel.core.quant.fp8 import Fp8Config
    from fluxaccel.core.quant.patch import apply_fp8

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

    from fluxaccel.core.bench.benchmark import FIDELITY_SIGMAS, denoiser_outputs
    from fluxaccel.core.compile.patch import compiled_of

    model = apply_compile(tiny_flux, CompileConfig(resolution_policy="strict", separate_process=False))[0] if compiled else tiny_flux
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
        err = rel_err(out, ref)
        assert err < (2e-2 if compiled else 1e-6), (s, err)
    if compiled:
        c = compiled_of(model)
        assert c.stats.calls == len(FIDELITY_SIGMAS) and c.stats.eager_calls == 0
        # cfg 3.5: the sampler batches cond and uncond into one call of batch 2, which this strict model refuses
        from fluxaccel.core.errors import FluxAccelError

        with pytest.raises(FluxAccelError, match="compiled for batch 1.*but received batch 2"):
            denoiser_outputs(model, BenchCase(width=128, height=128, cfg=3.5), pos, neg)


def _row(config, s, base, err, vram=None, runs=None):
    return {"config": config, "s_per_image_median": s, "s_per_step_median": s / 28, "speedup_vs_baseline": base / s,
            "runs": runs if runs is not None else [s - 0.1, s, s + 0.1],
            "baseline_s_per_image_median": base, "first_run_s": 10 * s, "peak_vram_gib": vram,
            "denoiser_rel_err": err, "denoiser_sqnr_db": float("inf") if err == 0 else 20.0 + 1 / err}


def test_table_shows_each_rows_own_baseline_and_marks_the_best():
    """Rows of two Benchmark nodes (each with its own eager run): every speedup follows from the numbers printed on
    its own line; the best value of each column is bold; a baseline's own zero error is not a value."""
    from fluxaccel.core.bench.benchmark import markdown_rows

    rows = [_row("eager-bf16", 5.36, 5.36, 0.0, 14.5), _row("fp8+compile", 2.90, 5.36, 0.045, 9.0),
            _row("eager-bf16", 12.92, 12.92, 0.0, 14.6), _row("bf16+compile", 3.83, 12.92, 0.012, 14.4)]
    lines = markdown_rows(rows).splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    assert head[:6] == ["config", "s/image (median)", "speedup vs its baseline", "spread s (runs)", "baseline s/image",
                        "ms/step"]
    cells = [[c.strip().strip("*") for c in line.strip("|").split("|")] for line in lines[2:]]
    assert len(cells) == 4
    for c in cells:
        s, speedup, base = float(c[1]), float(c[2].rstrip("x")), float(c[4])
        assert speedup == pytest.approx(base / s, abs=0.01)
    assert [c[4] for c in cells] == ["5.360", "5.360", "12.920", "12.920"]
    bold = [[i for i, c in enumerate(line.strip("|").split("|")) if c.strip().startswith("**")] for line in lines[2:]]
    assert 1 in bold[1] and 2 in bold[3]  # fastest s/image: fp8+compile; largest speedup (3.37x): bf16+compile
    assert 8 in bold[3] and 8 not in bold[0]  # smallest error among the accelerated rows; baselines read '-'
    assert cells[0][8] == "-" and cells[0][9] == "-"


def test_the_nodes_rendered_table_has_the_markdown_tables_cells():
    """The editor draws table_cells as an HTML table; the copyable markdown is made from the same cells."""
    from fluxaccel.core.bench.benchmark import markdown_rows, table_cells

    rows = [_row("eager-bf16", 5.36, 5.36, 0.0, 14.5), _row("fp8+compile", 2.90, 5.36, 0.045, 9.0)]
    t = table_cells(rows)
    assert t["columns"][0] == "config" and len(t["columns"]) == 10
    assert [r["config"] for r in t["rows"]] == ["eager-bf16", "fp8+compile"]
    assert t["rows"][1]["cells"][:5] == ["2.900", "1.85x", "2.800-3.000 (3 runs)", "5.360", f"{1000 * 2.90 / 28:.1f}"]
    assert t["rows"][1]["best"][0] and not t["rows"][0]["best"][0] and t["rows"][0]["cells"][7] == "-"
    md = [[c.strip().strip("*") for c in line.strip("|").split("|")] for line in markdown_rows(rows).splitlines()[2:]]
    assert md == [[r["config"], *r["cells"]] for r in t["rows"]]


def test_spread_is_on_every_row_and_noise_over_ten_percent_is_called_out():
    from fluxaccel.core.bench.benchmark import LEGEND, notes, table_cells

    rows = [_row("eager-bf16", 3.4, 3.4, 0.0, runs=[2.8, 3.4, 3.9]), _row("bf16+compile", 2.0, 3.4, 0.01,
                                                                           runs=[1.98, 2.0, 2.02]),
            _row("once", 1.0, 3.4, 0.01, runs=[1.0])]
    t = table_cells(rows)
    spread = [r["cells"][t["columns"].index("spread s (runs)") - 1] for r in t["rows"]]
    assert spread == ["2.800-3.900 (3 runs)", "1.980-2.020 (3 runs)", "1 run"]
    said = notes(rows)
    assert len(said) == 1 and "eager-bf16 (32 %)" in said[0] and "bf16+compile" not in said[0]
    assert notes(rows[1:]) == []
    assert "bold" in LEGEND and "spread" in LEGEND and "denoiser" in LEGEND


def test_a_connected_positive_gets_its_zeroed_negative():
    from fluxaccel.nodes.benchmark import zeroed

    pos = [[torch.ones(1, 4, 8), {"pooled_output": torch.ones(1, 8), "guidance": 3.5}]]
    (ctx, extra), = zeroed(pos)
    assert ctx.shape == (1, 4, 8) and not ctx.any() and not extra["pooled_output"].any() and extra["guidance"] == 3.5
    assert pos[0][0].all(), "the positive itself is unchanged"
