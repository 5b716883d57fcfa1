"""core/quant/fp8.py: layer selection, per-tensor/per-row numerics through torchao's real Float8Tensor path.

Error bounds: e4m3 keeps 3 mantissa bits, so one rounding has relative error <= 2^-4 and RMS ~2^-4/sqrt(3)
~ 3.6%/sqrt(3)... concretely, a GEMM with both operands rounded has RMS relative error ~2.5-4% (measured
~3% on a single Linear here). A whole FLUX forward averages many such errors against a residual stream,
so 8% (SQNR >= ~22 dB) bounds both a block and the whole tiny model with margin while still failing for
a broken scale (a wrong scale gives O(1) errors) or an unquantized path (error exactly 0 is rejected too).
"""
import pytest
import torch

from fluxaccel.core.errors import FluxAccelError
from fluxaccel.core.quant.fp8 import Fp8Config, in_scope, is_fp8_weight, linear_weight_bytes, select_linears
from fluxaccel.core.quant.linear import is_fp8_linear, quantize_linear
from fluxaccel.core.bench.metrics import rel_err, sqnr_db

BOUND = 0.08


def test_scope_filter_names():
    assert in_scope("double_blocks.0.img_attn.qkv", "blocks")
    assert in_scope("single_blocks.3.linear2", "blocks")
    assert not in_scope("double_blocks.0.img_mod.lin", "blocks")
    assert not in_scope("single_blocks.0.modulation.lin", "blocks")
    assert in_scope("double_blocks.0.txt_mod.lin", "blocks+modulation")
    for name in ("img_in", "txt_in", "time_in.in_layer", "vector_in.out_layer", "guidance_in.in_layer",
                 "final_layer.linear", "final_layer.adaLN_modulation.1"):
        assert not in_scope(name, "blocks") and not in_scope(name, "blocks+modulation")
        assert in_scope(name, "all_linear")


@pytest.mark.parametrize("scope,expected", [
    # tiny FLUX: 2 double blocks x (qkv, proj, mlp.0, mlp.2) x (img, txt) + 2 single x (linear1, linear2)
    ("blocks", 2 * 8 + 2 * 2),
    ("blocks+modulation", 2 * 8 + 2 * 2 + 2 * 2 + 2),
    ("all_linear", None),
])
def test_selection_per_scope(tiny_flux, scope, expected):
    dm = tiny_flux.model.diffusion_model
    linears = [(n, m) for n, m in dm.named_modules() if isinstance(m, torch.nn.Linear)]
    sel = select_linears(linears, Fp8Config(scope=scope))
    assert len(sel.chosen) + len(sel.skipped) == len(linears)
    if expected is None:  # all_linear: everything whose dims are multiples of 16 (all of tiny FLUX's)
        assert len(sel.chosen) == len(linears)
    else:
        assert len(sel.chosen) == expected
    if scope == "blocks":
        assert "double_blocks.0.img_mod.lin" in sel.skipped
        assert "final_layer.linear" in sel.skipped and "img_in" in sel.skipped
        assert all("outside scope" in r for r in sel.skipped.values())


def test_selection_skips_dims_not_multiple_of_16():
    lin = torch.nn.Linear(40, 24, dtype=torch.bfloat16)
    sel = select_linears([("double_blocks.0.img_attn.proj", lin)], Fp8Config())
    assert sel.chosen == [] and "not divisible by 16" in sel.skipped["double_blocks.0.img_attn.proj"]


def test_per_row_needs_bf16():
    lin = torch.nn.Linear(32, 32, dtype=torch.float16)
    with pytest.raises(FluxAccelError, match="per_row FP8 needs bfloat16 weights.*per_tensor"):
        select_linears([("double_blocks.0.img_attn.proj", lin)], Fp8Config("per_row"))
    assert select_linears([("double_blocks.0.img_attn.proj", lin)], Fp8Config("per_tensor")).chosen


def test_bad_config_values():
    with pytest.raises(FluxAccelError, match="granularity must be one of"):
        Fp8Config(granularity="per_block")
    with pytest.raises(FluxAccelError, match="scope must be one of"):
        Fp8Config(scope="everything")


def test_removed_inputs_are_said_and_unknown_ones_refused(caplog):
    """A saved workflow's inputs the node no longer has (layout, fuse_gelu, ...) load with one log line; a name the
    node never had is refused by name."""
    import logging

    with caplog.at_level(logging.INFO, logger="fluxaccel.nodes"):
        cfg = Fp8Config.from_inputs({"granularity": "per_tensor", "layout": "subclass", "fuse_gelu": False}, "Q")
    assert cfg == Fp8Config("per_tensor")
    said = [r.getMessage() for r in caplog.records if r.name == "fluxaccel.nodes"]
    assert len(said) == 1 and "layout='subclass', fuse_gelu=False" in said[0] and "no longer has" in said[0]
    with pytest.raises(FluxAccelError, match="Q has no input 'scopes'"):
        Fp8Config.from_inputs({"scopes": "blocks"}, "Q")


@pytest.mark.parametrize("granularity", ["per_tensor", "per_row"])
def test_scales_have_the_granularity(cpu_fp8, granularity):
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 96, dtype=torch.bfloat16)
    # rows of very different magnitude: per-row scales must differ row by row, per-tensor has one
    with torch.no_grad():
        lin.weight.mul_(torch.logspace(-2, 1, 96, dtype=torch.bfloat16)[:, None])
    q = quantize_linear(lin, Fp8Config(granularity), "cpu")
    assert not is_fp8_weight(q.weight) and q.weight.dtype == torch.float8_e4m3fn
    scale = q.fp8_weight_scale.float().flatten()
    if granularity == "per_row":
        assert scale.numel() == 96
        amax = lin.weight.float().abs().amax(dim=1)
        torch.testing.assert_close(scale, amax / torch.finfo(torch.float8_e4m3fn).max, rtol=1e-2, atol=0)
    else:
        assert scale.numel() == 1
    assert not is_fp8_weight(lin.weight), "the original Linear must stay bf16"


@pytest.mark.parametrize("granularity", ["per_tensor", "per_row"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_block_fidelity(cpu_fp8, tiny_flux, granularity, compiled):
    """One FLUX double block with its Linears quantized, against the bf16 block on the same inputs."""
    import copy

    dm = tiny_flux.model.diffusion_model
    block = dm.double_blocks[0]
    qblock = copy.deepcopy(block)
    cfg = Fp8Config(granularity)
    for name, mod in list(qblock.named_modules()):
        if isinstance(mod, torch.nn.Linear) and in_scope(f"double_blocks.0.{name}", cfg.scope):
            parent, _, leaf = name.rpartition(".")
            setattr(qblock.get_submodule(parent) if parent else qblock, leaf, quantize_linear(mod, cfg, "cpu"))
    g = torch.Generator().manual_seed(1)
    img = torch.randn(1, 64, 256, generator=g).bfloat16()
    txt = torch.randn(1, 16, 256, generator=g).bfloat16()
    vec = torch.randn(1, 256, generator=g).bfloat16()
    ids = torch.zeros(1, 80, 3)
    pe = dm.pe_embedder(ids)
    # ComfyUI's FLUX blocks update img/txt in place: give each call its own copies.
    ref_img, ref_txt = block(img.clone(), txt.clone(), vec, pe)
    fn = torch.compile(qblock, dynamic=False) if compiled else qblock
    out_img, out_txt = fn(img.clone(), txt.clone(), vec, pe)
    for out, ref in ((out_img, ref_img), (out_txt, ref_txt)):
        e = rel_err(out, ref)
        assert 0 < e < BOUND, f"{granularity} block rel err {e:.4f} (SQNR {sqnr_db(out, ref):.1f} dB)"


def _inputs_of_compiled(fn, *args) -> list:
    """The tensors a torch.compile'd call takes as graph inputs (recorded by a pass-through backend)."""
    seen = []

    def backend(gm, example_inputs):
        seen.extend(example_inputs)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, dynamic=False)(*args)
    return seen


def _torchao_linear(lin: torch.nn.Linear, cfg: Fp8Config) -> torch.nn.Linear:
    """torchao's own quantization of a copy of `lin` (its weight a Float8Tensor: F.linear dispatches to torchao)."""
    import copy

    from torchao.quantization import quantize_

    sub = copy.deepcopy(lin)
    with torch.no_grad():
        quantize_(sub, cfg.torchao_config())
    return sub


@pytest.mark.parametrize("granularity", ["per_tensor", "per_row"])
def test_fp8_linear_is_torchao_numerics_on_plain_tensors(cpu_fp8, granularity):
    """FluxAccel's FP8 Linear runs torchao's functions on the FP8 data and scale: bit-identical to F.linear on
    torchao's Float8Tensor weight in eager mode, the same weight bytes, and a compiled call takes no tensor-subclass
    inputs (torchao's own Linear does: that is what the plain tensors remove from every compiled call)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 96, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.mul_(torch.logspace(-2, 1, 96, dtype=torch.bfloat16)[:, None])
    sub = _torchao_linear(lin, Fp8Config(granularity))
    plain = quantize_linear(lin, Fp8Config(granularity), "cpu")
    assert is_fp8_linear(plain) and not is_fp8_linear(sub) and not is_fp8_linear(lin)
    assert isinstance(plain, type(lin)) and not is_fp8_weight(plain.weight)
    assert plain.weight.dtype == torch.float8_e4m3fn and type(plain.weight) is torch.nn.Parameter
    assert torch.equal(plain.weight.view(torch.uint8), sub.weight.qdata.view(torch.uint8))
    assert torch.equal(plain.fp8_weight_scale, sub.weight.scale)
    assert linear_weight_bytes(plain) == sub.weight.qdata.numel() + 4 * sub.weight.scale.numel() \
        < linear_weight_bytes(lin)
    x = torch.randn(2, 7, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        ref, out = sub(x), plain(x)
        assert torch.equal(out, ref)
        assert 0 < rel_err(out, lin(x)) < BOUND

        sub_inputs = _inputs_of_compiled(sub, x)
        plain_inputs = _inputs_of_compiled(plain, x)
    assert any(is_fp8_weight(t) for t in sub_inputs), [type(t).__name__ for t in sub_inputs]
    assert plain_inputs and all(type(t) in (torch.Tensor, torch.nn.Parameter) for t in plain_inputs), \
        [type(t).__name__ for t in plain_inputs]


def test_fp8_linear_moves_and_refuses_weight_functions(cpu_fp8):
    """ComfyUI moves modules with .to() (data and scale move together) and attaches weight functions for lowvram
    or LoRA patches: an FP8 Linear refuses them instead of ignoring them."""
    lin = torch.nn.Linear(32, 48, dtype=torch.bfloat16)
    q = quantize_linear(lin, Fp8Config("per_row"), "cpu")
    moved = quantize_linear(lin, Fp8Config("per_row"), "cpu").to("meta")
    assert moved.weight.device.type == moved.fp8_weight_scale.device.type == moved.bias.device.type == "meta"
    assert moved.weight.dtype == torch.float8_e4m3fn
    assert q(torch.randn(3, 32, dtype=torch.bfloat16)).shape == (3, 48)
    q.weight_function = [lambda w: w]
    with pytest.raises(FluxAccelError, match="a per-call weight function.*Put that node before Quantize FP8"):
        q(torch.randn(3, 32, dtype=torch.bfloat16))


def test_fp8_linear_keeps_its_fp8_data_through_a_dtype_cast(cpu_fp8):
    """module.to(torch.bfloat16) on an FP8 Linear must not cast the FP8 data to bf16 values without their scale (the
    next forward would raise): the data and scales keep their dtypes, the output is unchanged."""
    lin = torch.nn.Linear(32, 48, dtype=torch.bfloat16)
    q = quantize_linear(lin, Fp8Config("per_row"), "cpu")
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    ref = q(x)
    scale_dtype = q.fp8_weight_scale.dtype
    q.to(torch.bfloat16)
    assert q.weight.dtype == torch.float8_e4m3fn and q.fp8_weight_scale.dtype == scale_dtype
    assert torch.equal(q(x), ref)


def test_quantized_copy_has_its_own_hook_registries(cpu_fp8):
    """A hook registered on the quantized copy (or on the original) stays on that module: the copy once shared the
    original's hook dicts, so the loaded bf16 model ran hooks meant for the FP8 clone."""
    lin = torch.nn.Linear(32, 48, dtype=torch.bfloat16)
    q = quantize_linear(lin, Fp8Config("per_row"), "cpu")
    q.register_forward_hook(lambda *a: None)
    q.register_forward_pre_hook(lambda *a: None)
    assert len(q._forward_hooks) == 1 and len(q._forward_pre_hooks) == 1
    assert not lin._forward_hooks and not lin._forward_pre_hooks


def test_torchao_config_pins_the_torch_kernel_path():
    """torchao's own quantization is pinned to its TORCH kernel path (torch._scaled_mm), the one fp8_linear
    replays."""
    from torchao.quantization.quantize_.common import KernelPreference

    for g in ("per_row", "per_tensor"):
        c = Fp8Config(g).torchao_config()
        assert c.kernel_preference == KernelPreference.TORCH and c.set_inductor_config is False
