"""core/block_regions.py: FLUX's repeated blocks as nested compile regions inside the one whole-model graph.

What is checked: the replacement table leaves eager results bit-identical; compiled, dynamo's single graph calls
one region per block but holds one region body per block kind (that is the compile-time saving); the compiled
output stays within bf16 compile tolerance of eager, with the FP8 layouts too; through the Compile node the model
compiles once per shape (no recompile across calls/seeds) and the loaded model is untouched.
"""
import pytest
import torch
import torch._dynamo.utils as dynamo_utils
from torch._dynamo.testing import EagerAndRecordGraphs

from fluxaccel.core.compile.block_regions import BlockRegions
from fluxaccel.core.compile.config import CompileConfig
from fluxaccel.core.compile.patch import apply_compile
from fluxaccel.core.bench.metrics import rel_err
from support.models import build_flux
from support.runs import denoise_once as _denoise_once
from support.runs import flux_inputs
from support.runs import sample as _sample


def _run(fn, inp, options):
    x, t, ctx, y, guidance = inp
    return fn(x, t, context=ctx, y=y, guidance=guidance, transformer_options=options)


def _subgraph_calls(gm) -> list[str]:
    """The region body each invoke_subgraph call of a dynamo graph runs (the get_attr name of its body)."""
    calls = [n for n in gm.graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph]
    return [n.args[0].target for n in calls]


def _reuses_regions() -> bool:
    """torch 2.12+ stamps out a nested region's first trace for the next blocks instead of tracing them again."""
    import importlib

    try:
        return hasattr(importlib.import_module("torch._dynamo.variables.invoke_subgraph"), "InputFingerprint")
    except ImportError:
        return False


@pytest.mark.skipif(not _reuses_regions(), reason="this torch traces every nested compile region again")
def test_each_block_kind_is_traced_once_with_fluxaccels_attention(fresh_dynamo):
    """With the options a compiled call passes (FluxAccel's attention override among them), dynamo traces one block
    of each kind and stamps that trace out for the other 3 + 5: a function among a region's inputs would make it
    trace all 10 (torch's reuse takes tensors, constants and sourced objects only)."""
    from fluxaccel.core.compile.options import call_options
    from support.models import TINY

    dm = build_flux({**TINY, "depth": 4, "depth_single_blocks": 6}).model.diffusion_model
    inp = flux_inputs(dm)
    regions = BlockRegions(dm)
    stamps = dynamo_utils.compilation_time_metrics.setdefault("invoke_subgraph_reuse_stamp_out", [])
    before = len(stamps)
    rec = EagerAndRecordGraphs()
    out = _run(torch.compile(dm, backend=rec, fullgraph=True, dynamic=False), inp, call_options({}, regions))
    assert len(dynamo_utils.compilation_time_metrics["invoke_subgraph_reuse_stamp_out"]) - before == 3 + 5
    assert torch.equal(out, _run(dm, inp, call_options({}, regions)))  # eager through the same table


@pytest.mark.skipif(not _reuses_regions(), reason="this torch traces every nested compile region again")
@pytest.mark.parametrize("arch", ["flux2", "chroma"])
def test_modulation_records_do_not_stop_the_trace_reuse(arch, fresh_dynamo):
    """FLUX.2 and Chroma hand each block modulation records (dataclasses over slices of one tensor): they reach the
    region as tensors with a constant layout, so 2 + 3 of the 3 + 4 blocks are stamped out, and the compiled output
    equals eager (float32)."""
    from support.shapes import TINY_CHROMA, TINY_FLUX2

    shape = {"flux2": TINY_FLUX2, "chroma": TINY_CHROMA}[arch]
    model = build_flux({**shape, "depth": 3, "depth_single_blocks": 4}, dtype=torch.float32)
    hw = 8 if arch == "flux2" else 16
    ref = _denoise_once(model, hw=hw)
    stamps = dynamo_utils.compilation_time_metrics.setdefault("invoke_subgraph_reuse_stamp_out", [])
    before = len(stamps)
    compiled_model, _ = apply_compile(model, CompileConfig(persistent_cache=False, separate_process=False))
    out = _denoise_once(compiled_model, hw=hw)
    assert len(dynamo_utils.compilation_time_metrics["invoke_subgraph_reuse_stamp_out"]) - before == 2 + 3
    assert rel_err(out, ref) < 1e-4


def test_eager_with_the_table_is_bit_identical(tiny_flux):
    dm = tiny_flux.model.diffusion_model
    inp = flux_inputs(dm)
    regions = BlockRegions(dm)
    assert torch.equal(_run(dm, inp, regions.transformer_options()), _run(dm, inp, {}))
    assert len(regions.table()) == len(dm.double_blocks) + len(dm.single_blocks)


def test_one_region_body_per_block_kind(fresh_dynamo):
    """4 double + 6 single blocks: 10 region calls in one graph, but only 2 bodies (one per kind)."""
    from support.models import TINY

    dm = build_flux({**TINY, "depth": 4, "depth_single_blocks": 6}).model.diffusion_model
    inp = flux_inputs(dm)
    rec = EagerAndRecordGraphs()
    out = _run(torch.compile(dm, backend=rec, fullgraph=True, dynamic=False), inp, BlockRegions(dm).transformer_options())
    assert len(rec.graphs) == 1, "the whole model must stay one graph"
    bodies = _subgraph_calls(rec.graphs[0])
    assert len(bodies) == 10 and len(set(bodies)) == 2, bodies
    assert torch.equal(out, _run(dm, inp, {}))  # the recording backend runs the graph eagerly: exact


@pytest.mark.parametrize("layout", [None, "plain"])
def test_inductor_with_regions_matches_eager(tiny_flux, fresh_dynamo, cpu_fp8, layout):
    model = tiny_flux
    if layout is not None:
        from fluxaccel.core.quant.fp8 import Fp8Config
        from fluxaccel.core.quant.patch import apply_fp8

        model, _ = apply_fp8(tiny_flux, Fp8Config("per_row", layout=layout))
    ref = _denoise_once(model)
    plain_compiled, _ = apply_compile(model, CompileConfig(persistent_cache=False, separate_process=False))
    without = _denoise_once(plain_compiled)
    torch._dynamo.reset()
    with_regions, compiled = apply_compile(model, CompileConfig(persistent_cache=False, separate_process=False))
    out = _denoise_once(with_regions)
    assert compiled.stats.calls == 1 and compiled.regions is not None
    # bf16: as the compile test, within ~1 % of eager; and no further from eager than compile without regions
    assert rel_err(out, ref) < 2e-2, rel_err(out, ref)
    assert rel_err(out, ref) < 1.5 * rel_err(without, ref) + 1e-3, (rel_err(out, ref), rel_err(without, ref))


def test_regions_compile_once_per_shape_and_leave_the_model_alone(fresh_dynamo):
    base = build_flux("tiny", dtype=torch.float32)
    ref = _sample(base, seed=1)
    model, compiled = apply_compile(base, CompileConfig(resolution_policy="recompile", persistent_cache=False, separate_process=False))
    out = _sample(model, seed=1)
    assert rel_err(out, ref) < 1e-4, rel_err(out, ref)  # float32: only summation order differs
    graphs = fresh_dynamo["stats"]["unique_graphs"]
    assert graphs == 1
    _sample(model, seed=2, text_seed=5)
    assert fresh_dynamo["stats"]["unique_graphs"] == graphs, "another seed/prompt must not recompile"
    dm = base.model.diffusion_model
    assert all("forward" not in vars(b) for b in [*dm.double_blocks, *dm.single_blocks])
    assert torch.equal(_sample(base, seed=1), ref), "the input model must still run the original code"
    from fluxaccel.core.patches import describe, label

    assert label(model) == "fp32+compile+regions"  # the dtype it computes in (a float32 model here)
    info = describe(model)["compile"]
    assert info["block_regions"] is True
    (phases,) = info["compile_phases_s"].values()  # one shape compiled: where its compile time went
    assert phases["bytecode_tracing"] > 0


def test_config_refuses_regions_without_torch_support(monkeypatch):
    from fluxaccel.core.compile import block_regions
    from fluxaccel.core.errors import FluxAccelError

    monkeypatch.setattr(block_regions, "available", lambda: False)
    with pytest.raises(FluxAccelError, match="nested_compile_region.*Turn block_regions off"):
        CompileConfig(separate_process=False)


def test_subclass_fp8_layout_compiles_without_regions(tiny_flux, cpu_fp8, caplog):
    """torch has no rule for Float8Tensor weights inside a nested region: block_regions (the default) falls back
    to the plain whole-model compile for that layout, and says so."""
    from fluxaccel.core.quant.fp8 import Fp8Config
    from fluxaccel.core.quant.patch import apply_fp8
    from fluxaccel.core.patches import label

    q, _ = apply_fp8(tiny_flux, Fp8Config("per_row", layout="subclass"))
    with caplog.at_level("WARNING", logger="fluxaccel.compile"):
        model, compiled = apply_compile(q, CompileConfig(persistent_cache=False, separate_process=False))
    assert "cannot be used in torch's nested compile regions" in caplog.text and "layout 'plain'" in caplog.text
    assert compiled.regions is None and not compiled.cfg.block_regions
    assert label(model) == "fp8-per_row+compile"
    ref = _denoise_once(q)
    assert rel_err(_denoise_once(model), ref) < 2e-2  # it runs (the region path would raise inside torch)


def test_reference_latents_with_per_token_modulation_are_refused(tiny_flux):
    """ComfyUI 0.33's index_timestep_zero reference latents modulate tokens inside each block (modulation_dims):
    the regions' replacement would not pass that on, so the compiled call refuses instead of computing without it."""
    from fluxaccel.core.errors import FluxAccelError

    _, compiled = apply_compile(tiny_flux, CompileConfig(separate_process=False))
    x, t, ctx, y, guidance = flux_inputs(tiny_flux.model.diffusion_model)
    with pytest.raises(FluxAccelError, match="block_regions.*index_timestep_zero.*Turn block_regions off"):
        compiled(x, t, context=ctx, y=y, guidance=guidance, ref_latents=[x], ref_latents_method="index_timestep_zero")
    assert compiled.stats.calls == 0


def test_blocks_compiled_on_their_own_with_the_cpp_wrapper(fresh_dynamo):
    """compile_blocks: each block kind compiled once on its own (inductor's C++ wrapper, the path for CUDA graphs
    under cudaMallocAsync), the model around them eager: 2 dynamo graphs for 3 + 4 blocks, none more for another
    call, the output as eager's (float32: the C++ wrapper's CPU GEMM call refuses bf16)."""
    from support.models import TINY

    model = build_flux({**TINY, "depth": 3, "depth_single_blocks": 4}, dtype=torch.float32)
    import comfy.model_management as mm

    mm.load_models_gpu([model])
    dm = model.model.diffusion_model
    inp = flux_inputs(dm, dtype=torch.float32)
    ref = _run(dm, inp, {})
    regions = BlockRegions(dm, "fluxaccel", compile_blocks=lambda fn: torch.compile(
        fn, backend="inductor", fullgraph=True, dynamic=False, options={"cpp_wrapper": True}))
    out = _run(dm, inp, regions.transformer_options())
    assert dynamo_utils.counters["stats"]["unique_graphs"] == 2
    x, t, *rest = inp
    _run(dm, (x, t * 0.5, *rest), regions.transformer_options())
    assert dynamo_utils.counters["stats"]["unique_graphs"] == 2
    assert rel_err(out, ref) < 1e-5
