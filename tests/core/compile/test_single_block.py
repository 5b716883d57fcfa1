"""core/compile/single_block.py: FluxAccel's single-block forward (no concatenation written before linear2), on
ComfyUI's own FLUX blocks, quantized by Quantize FP8's apply_fp8 with the fused GELU.

What is checked: the forward is recognised by its source (ComfyUI 0.33.0's; another forward is named and kept); run
through the block regions it gives ComfyUI's forward's output bit for bit, and it runs only where linear2 takes the
two parts; compiled, the graph calls the two-input operator and compiles once; the Compile node says when it cannot
run; the compile cache keeps the two forwards apart.
"""
import comfy.ldm.flux.layers as flux_layers
import comfy.ldm.flux.math as flux_math
import pytest
import torch
import torch._dynamo.utils as dynamo_utils
from torch._dynamo.testing import EagerAndRecordGraphs

from conftest import COMFY_VERSION
from fluxaccel.core.compile import single_block
from fluxaccel.core.compile.block_regions import BlockRegions
from fluxaccel.core.compile.config import CompileConfig
from fluxaccel.core.compile.kernel_cache import cache_key
from fluxaccel.core.compile.patch import apply_compile
from fluxaccel.core.quant import linear
from fluxaccel.core.quant.fp8 import Fp8Config
from fluxaccel.core.quant.patch import apply_fp8
from fluxaccel.core.quant.static_scales import StaticFp8Linear
from support.runs import denoise_once, flux_inputs

READ = COMFY_VERSION == "0.33.0"  # the ComfyUI whose single-block forward FluxAccel's copies


@pytest.fixture
def pair_calls(monkeypatch):
    """How often linear2 was called on the two parts (FluxAccel's forward ran)."""
    calls = []
    real = linear._Fp8Plain.fp8_forward_pair

    def counted(self, a, m):
        calls.append(tuple(a.shape) + tuple(m.shape))
        return real(self, a, m)

    monkeypatch.setattr(linear._Fp8Plain, "fp8_forward_pair", counted)
    return calls


_TRACED = []  # pair_traced's count (a comptime function takes no free variables)


def _traced(ctx):
    _TRACED.append(1)


@pytest.fixture
def pair_traced(monkeypatch):
    """How often dynamo traced linear2's call on the two parts (counted at trace time only: a list the compiled code
    appended to would be guarded on, and recompile)."""
    from torch._dynamo.comptime import comptime

    real = linear._Fp8Plain.fp8_forward_pair

    def counted(self, a, m):
        comptime(_traced)
        return real(self, a, m)

    monkeypatch.setattr(linear._Fp8Plain, "fp8_forward_pair", counted)
    _TRACED.clear()
    return _TRACED


def _loaded(model):
    import comfy.model_management as mm

    mm.load_models_gpu([model])
    return model.model.diffusion_model


def _run(dm, inputs, options):
    x, t, ctx, y, guidance = inputs
    return dm(x, t, context=ctx, y=y, guidance=guidance, transformer_options=options)


def test_comfyuis_single_block_forward_is_known_by_its_source():
    why = single_block.known(flux_layers.SingleStreamBlock)
    if READ:
        assert why == "" and single_block.source_hash(flux_layers.SingleStreamBlock) in single_block.KNOWN
        assert single_block._FUNCTIONS == {"apply_mod": flux_layers.apply_mod, "attention": flux_math.attention}
    else:
        assert "comfy.ldm.flux.layers.SingleStreamBlock.forward is not a single-block forward FluxAccel has read " \
               "(read: ComfyUI 0.33.0)" == why


def test_a_forward_written_otherwise_is_not_known():
    class Rewritten(flux_layers.SingleStreamBlock):
        def forward(self, x, vec, pe, attn_mask=None, modulation_dims=None, transformer_options={}):  # noqa: B006
            return super().forward(x, vec, pe, attn_mask, modulation_dims, transformer_options)

    why = single_block.known(Rewritten)
    assert why.endswith("Rewritten.forward is not a single-block forward FluxAccel has read (read: ComfyUI 0.33.0)")


@pytest.mark.skipif(not READ, reason="the forward FluxAccel read is ComfyUI 0.33.0's")
def test_a_module_without_the_functions_the_forward_calls_is_named(monkeypatch):
    monkeypatch.delitem(flux_layers.SingleStreamBlock.forward.__globals__, "apply_mod")
    assert single_block.known(flux_layers.SingleStreamBlock) == "comfy.ldm.flux.layers has no apply_mod"


@pytest.mark.skipif(not READ, reason="the forward FluxAccel read is ComfyUI 0.33.0's")
def test_through_the_regions_it_equals_comfyuis_forward_bit_for_bit(cpu_fp8, tiny_flux, pair_calls):
    """Eager, the regions' table with single_blocks fluxaccel: FluxAccel's forward runs in every single block (linear2
    called on the attention output and the MLP stream) and the output equals ComfyUI's forward's exactly (the pair
    operator computes the one-input operator's numbers on the same row)."""
    fused, _ = apply_fp8(tiny_flux, Fp8Config("per_row"))
    dm = _loaded(fused)
    inputs = flux_inputs(dm)
    ours = _run(dm, inputs, BlockRegions(dm, "fluxaccel").transformer_options())
    hidden, n = dm.hidden_size, len(dm.single_blocks)
    assert [c[-1] for c in pair_calls] == [4 * hidden] * n and {c[2] for c in pair_calls} == {hidden}
    comfy = _run(dm, inputs, BlockRegions(dm, "comfyui").transformer_options())
    assert len(pair_calls) == n and torch.equal(ours, comfy)
    assert torch.equal(ours, _run(dm, inputs, {}))


@pytest.mark.skipif(not READ, reason="the forward FluxAccel read is ComfyUI 0.33.0's")
def test_flux2s_single_blocks_run_it_with_the_silu_gate(cpu_fp8, pair_calls):
    """FLUX.2's single blocks (the same class, shared modulation, a SiLU-gated MLP stream twice the gated width):
    with Quantize FP8's fused SiLU gate FluxAccel's forward runs in each of them, linear2 reads the MLP stream whole,
    and the output equals ComfyUI's forward's exactly."""
    from support.models import build_flux
    from support.shapes import TINY_FLUX2

    fused, _ = apply_fp8(build_flux(TINY_FLUX2, seed=0), Fp8Config("per_row"))
    dm = _loaded(fused)
    ours = denoise_once(fused, hw=8, transformer_options=BlockRegions(dm, "fluxaccel").transformer_options())
    n, block = len(dm.single_blocks), dm.single_blocks[0]
    assert len(pair_calls) == n and {c[-1] for c in pair_calls} == {block.mlp_hidden_dim_first} and \
        block.mlp_hidden_dim_first == 2 * block.mlp_hidden_dim
    comfy = denoise_once(fused, hw=8, transformer_options=BlockRegions(dm, "comfyui").transformer_options())
    assert len(pair_calls) == n and torch.equal(ours, comfy)


@pytest.mark.skipif(not READ, reason="the forward FluxAccel read is ComfyUI 0.33.0's")
@pytest.mark.parametrize("fp8", [None, Fp8Config("per_row", fuse_gelu=False), "static"])
def test_it_runs_only_where_linear2_takes_the_two_parts(cpu_fp8, tiny_flux, pair_calls, fp8):
    """bf16, FP8 without the fused GELU, and a linear2 run with a static activation scale: the block's own forward."""
    model = tiny_flux
    if fp8 is not None:
        model, _ = apply_fp8(tiny_flux, Fp8Config("per_row") if fp8 == "static" else fp8)
    dm = _loaded(model)
    if fp8 == "static":
        for block in dm.single_blocks:
            block.linear2 = StaticFp8Linear(block.linear2)
    assert not any(single_block.ready(b) for b in dm.single_blocks)
    inputs = flux_inputs(dm)
    assert torch.equal(_run(dm, inputs, BlockRegions(dm, "fluxaccel").transformer_options()), _run(dm, inputs, {}))
    assert pair_calls == []


def _ops_called(gm) -> set:
    """Every operator called by a dynamo graph and the region bodies it holds."""
    found = set()
    for mod in gm.modules():
        if isinstance(mod, torch.fx.GraphModule):
            found |= {str(n.target) for n in mod.graph.nodes if n.op == "call_function"}
    return found


@pytest.mark.skipif(not READ, reason="the forward FluxAccel read is ComfyUI 0.33.0's")
def test_compiled_the_graph_calls_the_pair_operator_once_per_single_block(cpu_fp8, tiny_flux, fresh_dynamo):
    fused, _ = apply_fp8(tiny_flux, Fp8Config("per_row"))
    dm = _loaded(fused)
    inputs = flux_inputs(dm)
    graphs = {}
    for forward in ("fluxaccel", "comfyui"):
        torch._dynamo.reset()
        rec = EagerAndRecordGraphs()
        out = _run(torch.compile(dm, backend=rec, fullgraph=True, dynamic=False), inputs,
                   BlockRegions(dm, forward).transformer_options())
        assert len(rec.graphs) == 1 and torch.equal(out, _run(dm, inputs, {}))
        graphs[forward] = _ops_called(rec.graphs[0])
    assert "fluxaccel.gelu_pair_rowwise_fp8.default" in graphs["fluxaccel"]
    assert "fluxaccel.gelu_pair_rowwise_fp8.default" not in graphs["comfyui"]


@pytest.mark.skipif(not READ, reason="the forward FluxAccel read is ComfyUI 0.33.0's")
def test_the_compile_node_compiles_it_once_within_tolerance(cpu_fp8, tiny_flux, fresh_dynamo, pair_traced):
    """Inductor through apply_compile: one compile for two calls, FluxAccel's forward traced in, the output as
    ComfyUI's forward compiled gives it (same numbers, one concatenation fewer)."""
    fused, _ = apply_fp8(tiny_flux, Fp8Config("per_row"))
    ref_model, _ = apply_compile(fused, CompileConfig(persistent_cache=False, separate_process=False))
    ref = denoise_once(ref_model)
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    model, compiled = apply_compile(fused, CompileConfig(persistent_cache=False, separate_process=False))
    pair_traced.clear()
    out, again = denoise_once(model), denoise_once(model)
    assert pair_traced, "FluxAccel's forward was not traced"
    assert fresh_dynamo["stats"]["unique_graphs"] == 1 and compiled.stats.calls == 2
    assert torch.equal(out, again) and (out - ref).abs().max() <= 1e-2 * ref.abs().max(), (out - ref).abs().max()
    assert compiled.stats.degradations == []
    assert "single blocks without the concatenation before linear2" in compiled.cfg.summary()


def test_the_compile_node_says_when_the_forward_is_not_known(cpu_fp8, tiny_flux, monkeypatch):
    monkeypatch.setattr(single_block, "KNOWN", {"0" * 64: "ComfyUI 0.0"})
    fused, _ = apply_fp8(tiny_flux, Fp8Config("per_row"))
    _, compiled = apply_compile(fused, CompileConfig(persistent_cache=False, separate_process=False))
    assert [d.line().split(" (since")[0] for d in compiled.stats.degradations] == [
        "single_blocks fluxaccel off: comfy.ldm.flux.layers.SingleStreamBlock.forward is not a single-block forward "
        "FluxAccel has read (read: ComfyUI 0.0); ComfyUI's forward runs (linear2's concatenated input is written "
        "first)"]
    for model, cfg in ((fused, CompileConfig(persistent_cache=False, separate_process=False)),
                       (tiny_flux, CompileConfig(persistent_cache=False, separate_process=False))):  # asked for nothing / nothing to use it
        assert apply_compile(model, cfg)[1].stats.degradations == []


def test_the_compile_cache_keeps_the_two_forwards_apart(tiny_flux):
    dm = tiny_flux.model.diffusion_model
    keys = {f: cache_key(dm, CompileConfig(separate_process=False), torch.device("cpu")) for f in ("fluxaccel", "comfyui")}
    assert keys["fluxaccel"] != keys["comfyui"]
    assert single_block.cache_tag(dm, "fluxaccel") == \
        f"single_blocks=fluxaccel:{single_block.source_hash(type(dm.single_blocks[0]))[:16]}"


def test_config_refuses_another_forward_by_name():
    from fluxaccel.core.errors import FluxAccelError

    with pytest.raises(FluxAccelError, match=r"single_blocks must be one of \('fluxaccel', 'comfyui'\), got 'mine'"):
        CompileConfig(separate_process=False)


def test_linear2_refuses_a_pair_split_elsewhere(cpu_fp8, tiny_flux):
    from fluxaccel.core.errors import FluxAccelError

    fused, _ = apply_fp8(tiny_flux, Fp8Config("per_row"))
    dm = _loaded(fused)
    lin, hidden = dm.single_blocks[0].linear2, dm.hidden_size
    x = torch.randn(1, 4, lin.in_features).to(torch.bfloat16)
    with pytest.raises(FluxAccelError, match=f"starts at column {hidden}, not at the first input's end \\(8\\)"):
        lin.fp8_forward_pair(x[..., :8], x[..., 8:])
    assert torch.equal(lin.fp8_forward_pair(x[..., :hidden], x[..., hidden:]), lin(x))
