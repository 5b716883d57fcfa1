"""core/quant/static_scales.py: FP8 Linears with a static activation scale, calibrated by observing real inputs."""
import pytest
import torch

from fluxaccel.core.bench.metrics import rel_err
from fluxaccel.core.errors import FluxAccelError
from fluxaccel.core.quant.fp8 import Fp8Config, fp8_linear
from fluxaccel.core.quant.linear import is_fp8_linear, quantize_linear
from fluxaccel.core.quant.patch import apply_fp8, fp8_state, remove_fp8
from fluxaccel.core.quant.static_scales import (STATIC_KEY, StaticFp8Linear, StaticScalesConfig, calibrate,
                                                remove_static_scales, static_scales_state, with_observers)
from fluxaccel.core.models import swaps


def _linear(granularity: str, k: int = 64, n: int = 96):
    torch.manual_seed(0)
    lin = torch.nn.Linear(k, n, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.mul_(torch.logspace(-2, 1, n, dtype=torch.bfloat16)[:, None])
    return lin, quantize_linear(lin, Fp8Config(granularity, layout="plain"), "cpu")


def _activations(seed: int, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 7, 64, generator=g) * torch.logspace(-1, 1, 7)[None, :, None]  # rows of different ranges
    return (x * scale).to(torch.bfloat16)


def test_calibrated_at_its_own_range_a_per_tensor_linear_computes_what_dynamic_does(cpu_fp8):
    """per_tensor: a static scale set from this very input's absmax (headroom 1) is the scale torchao computes per
    call (torchao divides in the input's bf16, the static scale in float32: equal up to bf16's rounding), so the
    output is the dynamic one up to that rounding; while observing, the wrapper's output is the dynamic one."""
    from fluxaccel.core.quant.fp8 import float8_ops

    _, q = _linear("per_tensor")
    w = StaticFp8Linear(q)
    x = _activations(1)
    with torch.no_grad():
        assert torch.equal(w(x), q(x))  # observing: inner's own call
        assert w.amax == x.abs().amax().float()
        assert w.set_scale(1.0) and w.amax is None and w.act_scale.dtype == torch.float32
        dynamic = float8_ops().choose_scale(x, float8_dtype=torch.float8_e4m3fn, block_size=list(x.shape))
        assert torch.allclose(w.act_scale.reshape(()), dynamic.reshape(()), rtol=2**-8, atol=0)
        assert rel_err(w(x).float(), q(x).float()) < 0.01


def test_per_row_static_scales_stay_close_to_dynamic_and_to_bf16(cpu_fp8):
    """per_row weights with one activation scale per tensor (2x headroom): within the same error class as each row's
    own scale against the bf16 Linear, on inputs other than the calibration's."""
    lin, q = _linear("per_row")
    w = StaticFp8Linear(q)
    with torch.no_grad():
        for seed in range(3):
            w(_activations(seed))
        w.set_scale(StaticScalesConfig().headroom)
        x = _activations(7)
        ref, dyn, static = lin(x).float(), q(x).float(), w(x).float()
    assert not torch.equal(static, dyn), "the static scale must be in use"
    assert rel_err(static, ref) < 2 * rel_err(dyn, ref) + 0.01 and rel_err(static, ref) < 0.08


def test_values_beyond_the_calibrated_range_saturate(cpu_fp8):
    """An input larger than calibration saw is clamped to FP8's largest value (no inf or NaN): the output is that of
    the input clamped at headroom x the calibrated absmax."""
    _, q = _linear("per_row")
    w = StaticFp8Linear(q)
    with torch.no_grad():
        x = _activations(3)
        w(x)
        w.set_scale(1.0)
        big = x * 10
        bound = float(x.abs().amax())
        out = w(big)
        clamped = fp8_linear(big.clamp(-bound, bound), q.weight, q.fp8_weight_scale, q.bias, q.fp8_act_kwargs,
                             q.fp8_mm_config, w.act_scale)
    assert torch.isfinite(out).all()
    assert torch.equal(out, clamped)


def test_the_scale_moves_with_the_module_and_survives_a_dtype_cast(cpu_fp8):
    _, q = _linear("per_row")
    w = StaticFp8Linear(q)
    x = _activations(1)
    with torch.no_grad():
        w(x)
        w.set_scale(2.0)
        ref = w(x)
        w.to(torch.bfloat16)  # the scale is rounded to bf16; the FP8 data keeps its dtype (inner's own _apply)
        assert q.weight.dtype == torch.float8_e4m3fn
        assert rel_err(w(x).float(), ref.float()) < 0.01
        w.to("meta")
    assert w.act_scale.device.type == q.weight.device.type == "meta"


def test_a_linear_calibration_never_reached_keeps_dynamic_scales(cpu_fp8):
    _, q = _linear("per_row")
    w = StaticFp8Linear(q)
    assert not w.set_scale(2.0) and w.act_scale is None
    x = _activations(2)
    with torch.no_grad():
        assert torch.equal(w(x), q(x))
    assert w.amax is None, "after calibration nothing is recorded any more"


def test_headroom_below_one_is_refused():
    with pytest.raises(FluxAccelError, match="headroom must be at least 1"):
        StaticScalesConfig(headroom=0.5)


def test_wrapping_a_quantized_model_leaves_its_input_as_it_was(cpu_fp8, tiny_flux):
    """with_observers + calibrate: a clone whose object patches are wrappers around the same FP8 Linears (no copy of
    the weights); the Quantize FP8 output keeps its own Linears and no attachment; remove_static_scales and
    remove_fp8 take the wrappers off."""
    from support.runs import sample

    q, _ = apply_fp8(tiny_flux, Fp8Config("per_row", layout="plain"))
    keys = fp8_state(q).keys
    before = {k: swaps.get(q, k) for k in keys}
    clone, wrappers = with_observers(q, "test")
    assert set(wrappers) == set(keys) and clone.patches_uuid != q.patches_uuid
    assert all(swaps.get(clone, k).inner is before[k] for k in keys)
    state = calibrate(clone, wrappers, StaticScalesConfig(), lambda: sample(clone, steps=2), "test run")
    assert static_scales_state(clone) is state and state.dynamic == () and state.keys == tuple(keys)
    assert all(torch.isfinite(w.act_scale).all() and (w.act_scale > 0).all() for w in wrappers.values())
    assert "static FP8 activation scales on 20 of 20 Linears" in state.summary()
    assert {k: swaps.get(q, k) for k in keys} == before and q.get_attachment(STATIC_KEY) is None
    assert all(is_fp8_linear(m) for m in before.values())
    back = remove_static_scales(clone)
    assert static_scales_state(back) is None and all(swaps.get(back, k) is before[k] for k in keys)
    assert static_scales_state(remove_fp8(clone)) is None, "remove_fp8 takes the wrappers with the FP8 Linears"


def test_calibration_that_reaches_nothing_is_refused(cpu_fp8, tiny_flux):
    q, _ = apply_fp8(tiny_flux, Fp8Config("per_row", layout="plain"))
    clone, wrappers = with_observers(q, "test")
    with pytest.raises(FluxAccelError, match="reached none of the FP8 Linears"):
        calibrate(clone, wrappers, StaticScalesConfig(), lambda: None, "nothing")


def test_static_scales_need_plain_fp8_linears(cpu_fp8, tiny_flux):
    with pytest.raises(FluxAccelError, match="Node X: activation_scales 'static' .* put Quantize FP8 \\(FluxAccel\\)"):
        with_observers(tiny_flux, "Node X")
    sub, _ = apply_fp8(tiny_flux, Fp8Config("per_row", layout="subclass"))
    with pytest.raises(FluxAccelError, match="needs Quantize FP8's 'plain' layout \\(this model is 'subclass'\\)"):
        with_observers(sub, "Node X")
