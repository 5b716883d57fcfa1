"""core/compile/skeleton.py: a real ComfyUI FLUX (FP8 Linears in it) pickled without its data and rebuilt as zeros."""
import pickle

import pytest
import torch

from fluxaccel.core.compile import skeleton
from fluxaccel.core.quant.fp8 import Fp8Config
from fluxaccel.core.quant.linear import fp8_class_origin, is_fp8_linear
from fluxaccel.core.quant.patch import apply_fp8
from fluxaccel.core.models import swaps


def _layout(m: torch.nn.Module) -> list:
    return [(n, tuple(t.shape), tuple(t.stride()), t.dtype, type(t).__name__) for n, t in m.state_dict().items()]


def test_the_live_fp8_model_round_trips_by_layout(cpu_fp8, tiny_flux):
    q, _ = apply_fp8(tiny_flux, Fp8Config("per_row"))
    q.patch_model()  # the live module tree holds the FP8 Linears, as the compiled call sees it
    try:
        dm = q.model.diffusion_model
        blob, nbytes = skeleton.dumps(dm)
        layout, classes = _layout(dm), [type(m) for m in dm.modules()]
        mm_config = dm.double_blocks[0].img_attn.qkv.fp8_mm_config
    finally:
        q.unpatch_model()
    back = skeleton.loads(blob, "cpu")
    assert len(blob) < nbytes / 100  # no data in it: megabytes of tensors, kilobytes of pickle
    assert nbytes == sum(t.numel() * t.element_size() for t in back.state_dict().values())
    assert _layout(back) == layout
    assert all(not t.float().any() for t in back.state_dict().values())  # zeros, never the weights
    assert [type(m) for m in back.modules()] == classes  # FP8 Linear classes rebuilt as the same classes
    qkv = back.double_blocks[0].img_attn.qkv
    assert is_fp8_linear(qkv) and fp8_class_origin(type(qkv)) is not None
    assert "in_features=" in repr(qkv)  # torchao's extra_repr (a bound partial) survives the trip
    assert qkv.fp8_mm_config == mm_config


def test_call_inputs_keep_their_layout_and_grad_flags():
    x = torch.randn(2, 3, 4).transpose(1, 2)
    w = torch.nn.Parameter(torch.ones(3), requires_grad=True)
    blob, nbytes = skeleton.dumps(({"x": x, "w": w, "n": 3, "f": torch.nn.functional.silu}, [None]))
    (d, rest) = skeleton.loads(blob, "cpu")
    assert d["x"].shape == x.shape and d["x"].stride() == x.stride() and not d["x"].any()
    assert isinstance(d["w"], torch.nn.Parameter) and d["w"].requires_grad
    assert d["n"] == 3 and d["f"] is torch.nn.functional.silu and rest == [None]
    assert nbytes == 2 * 3 * 4 * 4 + 3 * 4


def test_what_cannot_be_rebuilt_is_named(cpu_fp8, tiny_flux):
    import copy

    from torchao.quantization import quantize_

    lin = copy.deepcopy(tiny_flux.model.diffusion_model.double_blocks[0].img_attn.qkv)
    quantize_(lin, Fp8Config("per_row").torchao_config())  # torchao's own: a Float8Tensor weight (a tensor subclass)
    with pytest.raises(skeleton.NotPortable, match="Float8Tensor"):
        skeleton.dumps(lin)

    class Local(torch.nn.Module):  # a class made in a function, as ComfyUI's mixed-precision ops are
        pass

    with pytest.raises(skeleton.NotPortable, match="Local"):
        skeleton.dumps(Local())
    with pytest.raises((pickle.PicklingError, AttributeError)):  # the plain pickler refuses it too
        pickle.dumps(Local())
