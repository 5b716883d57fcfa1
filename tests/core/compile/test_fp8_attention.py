"""core/compile/fp8_attention.py: FP8 attention through FlashAttention-3's FP8 operator (a CPU stand-in here, the
wheel runs on Hopper GPUs only): its numbers against SDPA, the QK-norm bound against real ComfyUI FLUX blocks, the
compiled blocks handing each block's bound to the kernel, and the refusals."""
import math

import pytest
import torch
import torch._dynamo.utils as dynamo_utils

from fluxaccel.core.bench.metrics import rel_err
from fluxaccel.core.compile import fp8_attention as fa
from fluxaccel.core.compile.attention import sdpa_cudnn_first
from fluxaccel.core.compile.config import CompileConfig
from fluxaccel.core.compile.options import refuse_unsupported
from fluxaccel.core.compile.patch import apply_compile
from fluxaccel.core.errors import FluxAccelError
from fluxaccel.core.upstream import comfy_internals
from support import fa3_standin
from support.runs import denoise_once


@pytest.fixture
def fa3():
    fa3_standin.register()
    fa3_standin.CALLS.clear()
    yield fa3_standin.CALLS


def _qkv(seed=0, n=64, d=128, heads=2):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, heads, n, d, generator=g).bfloat16() * s for s in (1.0, 1.0, 3.0)]


def _comfy():
    """ComfyUI's PyTorch attention: what an override hands a call it does not take (on the CPU)."""
    import comfy.ldm.modules.attention as attention

    return attention.attention_pytorch


def _w(norm) -> torch.Tensor:
    """A QK-norm's weight, as ComfyUI keeps it."""
    return comfy_internals.rms_norm_weight(norm)


def _reference(q, k, v):
    out = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
    return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)


def test_fp8_attention_matches_sdpa_within_fp8_rounding(fa3):
    q, k, v = _qkv()
    out = fa.sdpa_fp8(None, q, k, v, 2, skip_reshape=True, transformer_options={})
    ref, bf16 = _reference(q, k, v), sdpa_cudnn_first(_comfy(), q, k, v, 2, skip_reshape=True)
    err = rel_err(out, ref)
    assert 1e-3 < err < 0.06, err  # FP8's rounding, well above bf16's
    assert rel_err(bf16, ref) < err / 4
    (call,) = fa3
    assert torch.allclose(call["v_descale"], v.abs().amax().float() / 448)  # V: this call's absmax
    assert torch.allclose(call["q_descale"], q.abs().amax().float() / 448)  # Q/K too, without the block's bound


def test_given_scales_are_used_and_values_past_them_saturate(fa3):
    q, k, v = _qkv()
    scales = torch.tensor([q.abs().amax().item() / 448 / 2, k.abs().amax().item() / 448], dtype=torch.float32)
    out = fa.sdpa_fp8(None, q, k, v, 2, skip_reshape=True, transformer_options={fa.SCALES_KEY: scales})
    assert torch.equal(fa3[0]["q_descale"], scales[0].expand(1, 2)) and torch.isfinite(out).all()


def test_calls_flux_does_not_make_go_to_cudnn_first_sdpa(fa3):
    q, k, v = _qkv()
    mask = torch.zeros(q.shape[2], q.shape[2])
    out = fa.sdpa_fp8(_comfy(), q, k, v, 2, mask=mask, skip_reshape=True)
    assert torch.equal(out, sdpa_cudnn_first(_comfy(), q, k, v, 2, mask=mask, skip_reshape=True)) and not fa3


@pytest.mark.parametrize("kind", ["double", "single"])
def test_qk_norm_bound_holds_for_the_worst_vector(tiny_flux, kind):
    """An RMS-normed vector's element is at most sqrt(head_dim) x |weight|: a vector with one non-zero element
    reaches it. The scale must keep that under FP8's largest value, and be no looser than the margin."""
    dm = tiny_flux.model.diffusion_model
    block = dm.double_blocks[0] if kind == "double" else dm.single_blocks[0]
    norms = [block.img_attn.norm, block.txt_attn.norm] if kind == "double" else [block.norm]
    g = torch.Generator().manual_seed(3)
    for n in norms:
        for which in (n.query_norm, n.key_norm):
            _w(which).data = (torch.randn(_w(which).shape, generator=g) * 2).to(_w(which).dtype)
    scales = fa.qk_scales(block)
    d = _w(norms[0].query_norm).numel()
    for i, which in enumerate(("query_norm", "key_norm")):
        worst = max((getattr(n, which)(torch.eye(d)[[int(_w(getattr(n, which)).float().abs().argmax())]].bfloat16())
                     .float().abs().max()) for n in norms)
        assert worst <= scales[i] * 448
        assert worst >= scales[i] * 448 / fa.MARGIN * 0.99
        assert math.isclose(float(scales[i]) * 448, math.sqrt(d) * fa.MARGIN *
                            max(float(_w(getattr(n, which)).float().abs().max()) for n in norms), rel_tol=1e-3)


def test_no_bound_where_comfyui_patches_the_norm_per_call(tiny_flux):
    block = tiny_flux.model.diffusion_model.single_blocks[0]
    block.norm.query_norm.weight_function = [lambda w: w * 2]
    try:
        assert fa.qk_scales(block) is None
        assert "changes its QK-norm weights at each call" in fa.why_no_qk_bound(block)
    finally:
        block.norm.query_norm.weight_function = []


def test_compiled_blocks_hand_each_block_its_bound(tiny_flux, fa3, monkeypatch, fresh_dynamo):
    """Inside FluxAccel's compiled blocks every attention call runs the FP8 kernel with Q/K scales from its block's
    QK-norm weights; the output stays within FP8 rounding of the cuDNN-first graph."""
    monkeypatch.setattr(fa, "why_not", lambda device: None)  # the CPU stand-in runs where the kernel cannot
    dm = tiny_flux.model.diffusion_model
    bounds = {tuple(fa.qk_scales(b).tolist()) for b in (*dm.double_blocks, *dm.single_blocks)}
    ref_model, _ = apply_compile(tiny_flux, CompileConfig(persistent_cache=False, separate_process=False))
    ref = denoise_once(ref_model)
    dynamo_utils.counters.clear()
    model, compiled = apply_compile(tiny_flux, CompileConfig(persistent_cache=False, attention="fp8", separate_process=False))
    out = denoise_once(model)
    denoise_once(model)
    assert len(fa3) == 2 * (len(dm.double_blocks) + len(dm.single_blocks))
    seen = {(float(c["q_descale"][0, 0]), float(c["k_descale"][0, 0])) for c in fa3}
    assert {tuple(round(x, 6) for x in s) for s in seen} == {tuple(round(x, 6) for x in b) for b in bounds}
    assert dynamo_utils.counters["stats"]["unique_graphs"] == 2  # one per block kind, no recompile on the second call
    assert 1e-4 < rel_err(out, ref) < 0.1
    assert "FP8 attention (FlashAttention-3)" in compiled.cfg.summary("")
    from fluxaccel.core.patches import describe, label

    assert label(model).endswith("+compile+fp8-attention") and describe(model)["compile"]["attention"] == "fp8"


def test_a_block_whose_qk_norm_weight_cannot_be_read_takes_each_calls_absmax_and_it_is_said(tiny_flux, fa3,
                                                                                            monkeypatch, caplog):
    """A QK-norm whose weight FluxAccel cannot read (an RMSNorm keeping it under another name): that block's Q and K
    take each call's absmax, the others their bound; the model's stats and the log say how many blocks and why."""
    monkeypatch.setattr(fa, "why_not", lambda device: None)
    dm = tiny_flux.model.diffusion_model
    odd = dm.single_blocks[1].norm

    class Renamed(torch.nn.Module):  # the norm's weight under a name no ComfyUI uses
        def __init__(self, inner):
            super().__init__()
            self.gain = torch.nn.Parameter(_w(inner).detach().clone())

        def forward(self, x):
            return torch.nn.functional.rms_norm(x, self.gain.shape, self.gain.to(x.dtype), eps=1e-6)

    monkeypatch.setattr(odd, "query_norm", Renamed(odd.query_norm))
    assert "RMSNorm.weight" in fa.why_no_qk_bound(dm.single_blocks[1])
    bounds = {round(float(fa.qk_scales(b)[0]), 6) for b in (*dm.double_blocks, dm.single_blocks[0])}
    model, compiled = apply_compile(tiny_flux, CompileConfig(persistent_cache=False, attention="fp8", separate_process=False))
    denoise_once(model)
    q_scales = [round(float(c["q_descale"][0, 0]), 6) for c in fa3]
    assert len(q_scales) == 2 + 2 and set(q_scales[:3]) <= bounds and q_scales[3] not in bounds, (q_scales, bounds)
    (d,) = [d for d in compiled.stats.degradations if d.what == "FP8 attention's Q/K scales from the QK-norm bound"]
    assert d.why.startswith("1 of 4 blocks take each call's absmax of Q and K instead: its QK-norm weight cannot be "
                            "read") and "RMSNorm.weight" in d.why, d.why
    assert "runs without FP8 attention's Q/K scales from the QK-norm bound: 1 of 4 blocks" in caplog.text


def test_refused_where_it_cannot_run(tiny_flux):
    with pytest.raises(FluxAccelError, match=r"attention 'fp8' cannot run here: .*cpu.*Set attention to 'cudnn'"):
        apply_compile(tiny_flux, CompileConfig(attention="fp8", separate_process=False))
    assert "Hopper" in fa.why_not(torch.device("cpu"))


def test_a_mask_is_refused_with_fp8_attention():
    with pytest.raises(FluxAccelError, match="attention 'fp8' .* takes no attention mask"):
        refuse_unsupported({}, {"attention_mask": torch.ones(1, 4)}, "fp8")
    refuse_unsupported({}, {"attention_mask": torch.ones(1, 4)}, "cudnn")


def test_another_nodes_attention_override_is_refused_with_fp8_attention():
    def theirs(func, *args, **kwargs):
        return func(*args, **kwargs)

    with pytest.raises(FluxAccelError, match=r"attention 'fp8' and an attention override another node set \(theirs\)"):
        refuse_unsupported({"optimized_attention_override": theirs}, {}, "fp8")
    refuse_unsupported({"optimized_attention_override": theirs}, {}, "cudnn")  # theirs runs, as before
    refuse_unsupported({"optimized_attention_override": fa.sdpa_fp8}, {}, "fp8")  # FluxAccel's own


def test_config_names_the_setting():
    with pytest.raises(FluxAccelError, match="attention must be one of"):
        CompileConfig(attention="sage", separate_process=False)
