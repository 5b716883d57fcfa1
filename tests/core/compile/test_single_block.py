"""core/compile/single_block.py: FluxAccel's single-block forward (no concatenation written before linear2), on
ComfyUI's own FLUX blocks, quantized by Quantize FP8's apply_fp8 with the fused GELU.

What is checked: the forward is recognised by its source (ComfyUI 0.33.0's: the real upstream source is hashed here,
so a ComfyUI that edits it turns the copy off, said); it gives ComfyUI's forward's output bit for bit, and it runs only
where linear2 takes the two parts; compiled through the Compile node, the pair operator is traced in and compiles
once; the Compile node says when it cannot run; the compile cache keys the forward's source.
"""
import comfy.ldm.flux.layers as flux_layers
import comfy.ldm.flux.math as flux_math
import pytest
import torch

from fluxaccel.core.compile import single_block
from fluxaccel.core.compile.config import CompileConfig
from fluxaccel.core.compile.patch import apply_compile
from fluxaccel.core.quant import linear
from fluxaccel.core.quant.fp8 import Fp8Config
from fluxaccel.core.quant.patch import apply_fp8
from support.runs import denoise_once, flux_inputs

CFG = CompileConfig(persistent_cache=False, separate_process=False)


@pytest.fixture
def pair_calls(monkeypatch):
    """How often linear2 was called on the two parts (FluxAccel's forward ran)."""
    calls = []
    real = linear._Fp8Linear.fp8_forward_pair

    def counted(self, a, m):
        calls.append(tuple(a.shape) + tuple(m.shape))
        return real(self, a, m)

    monkeypatch.setattr(linear._Fp8Linear, "fp8_forward_pair", counted)
    return calls


_TRACED = []  # pair_traced's count (a comptime function takes no free variables)


def _traced(ctx):
    _TRACED.append(1)


@pytest.fixture
def pair_traced(monkeypatch):
    """How often dynamo traced linear2's call on the two parts (counted at trace time only: a list the compiled code
    appended to would be guarded on, and recompile)."""
    from torch._dynamo.comptime import comptime

    real = linear._Fp8Linear.fp8_forward_pair

    def counted(self, a, m):
        comptime(_traced)
        return real(self, a, m)

    monkeypatch.setattr(linear._Fp8Linear, "fp8_forward_pair", counted)
    _TRACED.clear()
    return _TRACED


def _loaded(model):
    import comfy.model_management as mm

    mm.load_models_gpu([model])
    return model.model.diffusion_model


def _block_inputs(dm, tokens=24, seed=0):
    """(x, vec, pe) for a single block of `dm`: its hidden width, FLUX.1's vector, positions of `tokens` tokens."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, tokens, dm.hidden_size, generator=g).to(torch.bfloat16)
    vec = torch.randn(1, dm.hidden_size, generator=g).to(torch.bfloat16)
    pe = dm.pe_embedder(torch.zeros(1, tokens, 3))
    return x, vec, pe


def test_comfyuis_single_block_forward_is_known_by_its_source():
    assert single_block.known(flux_layers.SingleStreamBlock) == ""
    assert single_block.source_hash(flux_layers.SingleStreamBlock) in single_block.KNOWN
    assert single_block._FUNCTIONS == {"apply_mod": flux_layers.apply_mod, "attention": flux_math.attention}


def test_a_forward_written_otherwise_is_not_known():
    class Rewritten(flux_layers.SingleStreamBlock):
        def forward(self, x, vec, pe, attn_mask=None, modulation_dims=None, transformer_options={}):  # noqa: B006
            return super().forward(x, vec, pe, attn_mask, modulation_dims, transformer_options)

    why = single_block.known(Rewritten)
    assert why.endswith("Rewritten.forward is not a single-block forward FluxAccel has read (read: ComfyUI 0.33.0)")


def test_a_module_without_the_functions_the_forward_calls_is_named(monkeypatch):
    monkeypatch.delitem(flux_layers.SingleStreamBlock.forward.__globals__, "apply_mod")
    assert single_block.known(flux_layers.SingleStreamBlock) == "comfy.ldm.flux.layers has no apply_mod"


def test_it_equals_comfyuis_forward_bit_for_bit(cpu_fp8, tiny_flux, pair_calls):
    """Eager, every single block: FluxAccel's forward calls linear2 on the attention output and the MLP stream, and
    its output equals ComfyUI's forward's exactly (the pair operator computes the one-input operator's numbers on the
    same row)."""
    fused, _ = apply_fp8(tiny_flux, Fp8Config("per_row"))
    dm = _loaded(fused)
    x, vec, pe = _block_inputs(dm)
    hidden = dm.hidden_size
    assert single_block.known(type(dm.single_blocks[0])) == ""  # keeps the functions the forward calls
    for block in dm.single_blocks:
        assert single_block.ready(block)
        ours = single_block.forward(block, x.clone(), vec, pe)
        assert torch.equal(ours, block(x.clone(), vec, pe))
    assert [c[-1] for c in pair_calls] == [4 * hidden] * len(dm.single_blocks) and {c[2] for c in pair_calls} == {hidden}


def test_flux2s_single_blocks_run_it_with_the_silu_gate(cpu_fp8, pair_calls):
    """FLUX.2's single blocks (the same class, shared modulation, a SiLU-gated MLP stream twice the gated width):
    with Quantize FP8's fused SiLU gate FluxAccel's forward runs in each of them (compiled, through the Compile node),
    linear2 reads the MLP stream whole, and the output is eager's within bf16 compile tolerance."""
    from support.models import build_flux
    from support.shapes import TINY_FLUX2

    fused, _ = apply_fp8(build_flux(TINY_FLUX2, seed=0), Fp8Config("per_row"))
    ref = denoise_once(fused, hw=8)
    dm = fused.model.diffusion_model
    n, block = len(dm.single_blocks), dm.single_blocks[0]
    assert single_block.ready(block) and block.mlp_hidden_dim_first == 2 * block.mlp_hidden_dim
    compiled_model, _ = apply_compile(fused, CFG)
    pair_calls.clear()
    out = denoise_once(compiled_model, hw=8)
    assert len(pair_calls) == n and {c[-1] for c in pair_calls} == {block.mlp_hidden_dim_first}
    assert (out - ref).abs().max() <= 2e-2 * ref.abs().max()


@pytest.mark.parametrize("fp8", [None, "per_tensor"])
def test_it_runs_only_where_linear2_takes_the_two_parts(cpu_fp8, tiny_flux, pair_calls, fp8):
    """bf16, and FP8 without the fused GELU (per_tensor scales): the block's own forward runs, compiled too."""
    model = tiny_flux if fp8 is None else apply_fp8(tiny_flux, Fp8Config(fp8))[0]
    dm = _loaded(model)
    assert not any(single_block.ready(b) for b in dm.single_blocks)
    denoise_once(apply_compile(model, CFG)[0])
    assert pair_calls == []


def test_the_compile_node_compiles_it_once_within_tolerance(cpu_fp8, tiny_flux, fresh_dynamo, pair_traced):
    """Inductor through apply_compile: one compile per block kind for two calls, FluxAccel's forward traced in, the
    output within bf16 tolerance of eager."""
    fused, _ = apply_fp8(tiny_flux, Fp8Config("per_row"))
    ref = denoise_once(fused)
    model, compiled = apply_compile(fused, CFG)
    pair_traced.clear()
    out, again = denoise_once(model), denoise_once(model)
    assert pair_traced, "FluxAccel's forward was not traced"
    assert fresh_dynamo["stats"]["unique_graphs"] == 2 and compiled.stats.calls == 2
    assert torch.equal(out, again) and (out - ref).abs().max() <= 2e-2 * ref.abs().max(), (out - ref).abs().max()
    assert compiled.stats.degradations == []


def test_the_compile_node_says_when_the_forward_is_not_known(cpu_fp8, tiny_flux, monkeypatch, pair_traced):
    """A ComfyUI whose single-block forward FluxAccel has not read: ComfyUI's forward runs (the pair operator is never
    traced), and the node's text says why; a model without the fused input has nothing to say."""
    monkeypatch.setattr(single_block, "KNOWN", {"0" * 64: "ComfyUI 0.0"})
    fused, _ = apply_fp8(tiny_flux, Fp8Config("per_row"))
    model, compiled = apply_compile(fused, CFG)
    assert [d.line().split(" (since")[0] for d in compiled.stats.degradations] == [
        "single blocks' fused input off: comfy.ldm.flux.layers.SingleStreamBlock.forward is not a single-block forward "
        "FluxAccel has read (read: ComfyUI 0.0); ComfyUI's forward runs (linear2's concatenated input is written "
        "first)"]
    pair_traced.clear()
    denoise_once(model)
    assert pair_traced == []
    assert apply_compile(tiny_flux, CFG)[1].stats.degradations == []


def test_the_compile_cache_keys_the_forwards_source(tiny_flux, monkeypatch):
    from fluxaccel.core.compile.keys import cache_key

    dm = tiny_flux.model.diffusion_model
    tag = single_block.cache_tag(dm)
    assert tag == f"single_blocks=fluxaccel:{single_block.source_hash(type(dm.single_blocks[0]))[:16]}"
    before = cache_key(tiny_flux, CFG, torch.device("cpu"), {})
    monkeypatch.setattr(single_block, "source_hash", lambda cls: "f" * 64)
    assert cache_key(tiny_flux, CFG, torch.device("cpu"), {}) != before


def test_linear2_refuses_a_pair_split_elsewhere(cpu_fp8, tiny_flux):
    from fluxaccel.core.errors import FluxAccelError

    fused, _ = apply_fp8(tiny_flux, Fp8Config("per_row"))
    dm = _loaded(fused)
    lin, hidden = dm.single_blocks[0].linear2, dm.hidden_size
    x = torch.randn(1, 4, lin.in_features).to(torch.bfloat16)
    with pytest.raises(FluxAccelError, match=f"starts at column {hidden}, not at the first input's end \\(8\\)"):
        lin.fp8_forward_pair(x[..., :8], x[..., 8:])
    assert torch.equal(lin.fp8_forward_pair(x[..., :hidden], x[..., hidden:]), lin(x))
