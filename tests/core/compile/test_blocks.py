"""core/compile/blocks.py: each kind of FLUX block compiled once, on its own, and called for every block of its kind
through ComfyUI's patches_replace.

What is checked: one dynamo graph per block kind whatever the number of blocks (FLUX.1, FLUX.2 and Chroma, whose
modulation records reach the body as tensors), none more for another call; compiled equals eager (float32), also with
inductor's C++ wrapper (the path of captured calls) and within bf16 tolerance with FP8; through the Compile node the
model compiles once per shape and the loaded model is untouched.
"""
import pytest
import torch

from fluxaccel.core.bench.metrics import rel_err
from fluxaccel.core.compile.blocks import BlockTable
from fluxaccel.core.compile.config import CompileConfig
from fluxaccel.core.compile.patch import apply_compile
from support.models import TINY, build_flux
from support.runs import denoise_once as _denoise_once
from support.runs import flux_inputs
from support.runs import sample as _sample

PLAIN = CompileConfig().inductor_options(capture=False)


def _run(fn, inp, options):
    x, t, ctx, y, guidance = inp
    return fn(x, t, context=ctx, y=y, guidance=guidance, transformer_options=options)


@pytest.mark.parametrize("options", [PLAIN, {**PLAIN, "cpp_wrapper": True}], ids=["python", "cpp-wrapper"])
def test_one_graph_per_block_kind_equal_to_eager(fresh_dynamo, options):
    """3 double + 4 single blocks: 2 dynamo graphs (one per kind), none more for another call, the output as eager's
    (float32: the C++ wrapper's CPU GEMM call refuses bf16). The C++ wrapper is what captured calls compile with."""
    import comfy.model_management as mm

    model = build_flux({**TINY, "depth": 3, "depth_single_blocks": 4}, dtype=torch.float32)
    mm.load_models_gpu([model])
    dm = model.model.diffusion_model
    inp = flux_inputs(dm, dtype=torch.float32)
    ref = _run(dm, inp, {})
    table = BlockTable(dm, options)
    assert len(table.table()) == 3 + 4
    out = _run(dm, inp, table.transformer_options())
    assert fresh_dynamo["stats"]["unique_graphs"] == 2
    x, t, *rest = inp
    _run(dm, (x, t * 0.5, *rest), table.transformer_options())
    assert fresh_dynamo["stats"]["unique_graphs"] == 2
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("arch", ["flux2", "chroma"])
def test_modulation_records_reach_one_body_per_kind(arch, fresh_dynamo):
    """FLUX.2 and Chroma hand each block modulation records (dataclasses over slices of one tensor): they reach the
    compiled body as tensors with a constant layout, so 3 + 4 blocks make 2 graphs, and the output equals eager's
    (float32)."""
    from support.shapes import TINY_CHROMA, TINY_FLUX2

    shape = {"flux2": TINY_FLUX2, "chroma": TINY_CHROMA}[arch]
    model = build_flux({**shape, "depth": 3, "depth_single_blocks": 4}, dtype=torch.float32)
    hw = 8 if arch == "flux2" else 16
    ref = _denoise_once(model, hw=hw)
    compiled_model, _ = apply_compile(model, CompileConfig(persistent_cache=False, separate_process=False))
    out = _denoise_once(compiled_model, hw=hw)
    assert fresh_dynamo["stats"]["unique_graphs"] == 2
    assert rel_err(out, ref) < 1e-4


def test_fp8_blocks_compiled_match_eager(tiny_flux, fresh_dynamo, cpu_fp8):
    from fluxaccel.core.quant.fp8 import Fp8Config
    from fluxaccel.core.quant.patch import apply_fp8

    model, _ = apply_fp8(tiny_flux, Fp8Config("per_row"))
    ref = _denoise_once(model)
    compiled_model, compiled = apply_compile(model, CompileConfig(persistent_cache=False, separate_process=False))
    out = _denoise_once(compiled_model)
    assert compiled.stats.calls == 1 and fresh_dynamo["stats"]["unique_graphs"] == 2
    assert rel_err(out, ref) < 2e-2, rel_err(out, ref)  # bf16: within ~1 % of eager


def test_blocks_compile_once_per_shape_and_leave_the_model_alone(fresh_dynamo):
    base = build_flux("tiny", dtype=torch.float32)
    ref = _sample(base, seed=1)
    model, compiled = apply_compile(base, CompileConfig(resolution_policy="recompile", persistent_cache=False,
                                                        separate_process=False))
    out = _sample(model, seed=1)
    assert rel_err(out, ref) < 1e-4, rel_err(out, ref)  # float32: only summation order differs
    graphs = fresh_dynamo["stats"]["unique_graphs"]
    assert graphs == 2
    _sample(model, seed=2, text_seed=5)
    assert fresh_dynamo["stats"]["unique_graphs"] == graphs, "another seed/prompt must not recompile"
    dm = base.model.diffusion_model
    assert all("forward" not in vars(b) for b in [*dm.double_blocks, *dm.single_blocks])
    assert torch.equal(_sample(base, seed=1), ref), "the input model must still run the original code"
    from fluxaccel.core.patches import describe, label

    assert label(model) == "fp32+compile"  # the dtype it computes in (a float32 model here); no graphs on a CPU
    (phases,) = describe(model)["compile"]["compile_phases_s"].values()  # one shape compiled: where its time went
    assert phases["bytecode_tracing"] > 0


def test_reference_latents_with_per_token_modulation_are_refused(tiny_flux):
    """ComfyUI 0.33's index_timestep_zero reference latents modulate tokens inside each block (modulation_dims): the
    compiled blocks' replacement would not pass that on, so the compiled call refuses instead of computing without
    it."""
    from fluxaccel.core.errors import FluxAccelError

    _, compiled = apply_compile(tiny_flux, CompileConfig(separate_process=False))
    x, t, ctx, y, guidance = flux_inputs(tiny_flux.model.diffusion_model)
    with pytest.raises(FluxAccelError, match="index_timestep_zero.*bypass the Compile node"):
        compiled(x, t, context=ctx, y=y, guidance=guidance, ref_latents=[x], ref_latents_method="index_timestep_zero")
    assert compiled.stats.calls == 0
