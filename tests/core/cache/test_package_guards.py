"""Warm starts that cannot be wrong: a package keeps no dynamo guards (ComfyUI's op classes cannot be saved in them),
so every property dynamo would guard is in the package's file key -- the call signature (inputs, options, autograd
mode) or the cache key (versions, device, compile config, the model's layout and FP8 config). One test per property:
a call differing in it gets another signature or key, and never runs the package of the first."""
import contextlib

import pytest
import torch

from fluxaccel.core.cache import packages as warm_start
from fluxaccel.core.compile.attention import OVERRIDE_KEY, sdpa_cudnn_first
from fluxaccel.core.compile.config import CompileConfig
from fluxaccel.core.compile.keys import cache_key

from fluxaccel.core.compile.shapes import ShapeKey
from fluxaccel.core.cache.packages import NotPackageable, Packages, signature
from support.models import TINY, build_flux

KEY = ShapeKey(1, 16, 16, 16, "bfloat16")


def _call(**over):
    g = torch.Generator().manual_seed(0)
    call = {"x": torch.randn(1, 16, 16, 16, generator=g).bfloat16(), "t": torch.tensor([0.5]),
            "context": torch.randn(1, 16, 64, generator=g).bfloat16(), "y": torch.randn(1, 64).bfloat16(),
            "options": {"rope_options": {"scale_x": 1.0}, OVERRIDE_KEY: sdpa_cudnn_first}}
    call.update(over)
    return call


def _sig(call) -> str:
    return signature((call["x"], call["t"]), {"context": call["context"], "y": call["y"],
                                              "transformer_options": call["options"]})


@pytest.mark.parametrize("what,call", [
    ("input shape", _call(x=torch.zeros(1, 16, 16, 24, dtype=torch.bfloat16))),
    ("input strides", _call(x=torch.zeros(1, 16, 16, 16, dtype=torch.bfloat16).transpose(-1, -2))),
    ("input dtype", _call(x=torch.zeros(1, 16, 16, 16))),
    ("input device", _call(x=torch.zeros(1, 16, 16, 16, dtype=torch.bfloat16, device="meta"))),
    ("text tokens", _call(context=torch.zeros(1, 24, 64, dtype=torch.bfloat16))),
    ("an extra input", _call(y=None)),
    ("an option's value", _call(options={"rope_options": {"scale_x": 2.0}, OVERRIDE_KEY: sdpa_cudnn_first})),
    ("an option added", _call(options={"rope_options": {"scale_x": 1.0}, OVERRIDE_KEY: sdpa_cudnn_first, "new": 1})),
    ("an option removed", _call(options={OVERRIDE_KEY: sdpa_cudnn_first})),
    ("the attention function", _call(options={"rope_options": {"scale_x": 1.0}, OVERRIDE_KEY: warm_start.signature})),
])
def test_each_input_property_is_in_the_signature(what, call):
    assert _sig(call) != _sig(_call()), what


def test_autograd_modes_are_in_the_signature():
    with torch.inference_mode(False):
        with torch.no_grad():
            no_grad = _sig(_call())
        with torch.enable_grad():
            grad = _sig(_call())
    assert len({_sig(_call()), no_grad, grad}) == 3  # inference mode (as ComfyUI runs nodes), no_grad, grad


def test_an_attention_function_that_may_differ_in_the_next_process_is_not_packaged():
    def closure(*a, **k):
        return a
    with pytest.raises(NotPackageable, match="not a module-level function"):
        _sig(_call(options={OVERRIDE_KEY: closure}))


def _key(model, cfg=CompileConfig()):
    return cache_key(model, cfg, torch.device("cpu"), cfg.inductor_options(capture=False))


def test_weight_dtypes_shapes_fp8_configs_and_modes_are_in_the_cache_key(cpu_fp8):
    from fluxaccel.core.quant.fp8 import Fp8Config
    from fluxaccel.core.quant.patch import apply_fp8

    bf16 = build_flux()
    keys = {
        "bf16": _key(bf16),
        "fp32 weights": _key(build_flux(dtype=torch.float32)),
        "deeper model": _key(build_flux({**TINY, "depth": 3})),
        "wider text input": _key(build_flux({**TINY, "context_in_dim": 128})),
        "fp8 per_row": _key(apply_fp8(bf16, Fp8Config("per_row"))[0]),
        "fp8 per_tensor": _key(apply_fp8(bf16, Fp8Config("per_tensor"))[0]),
        "fp8 blocks+modulation": _key(apply_fp8(bf16, Fp8Config("per_row", "blocks+modulation"))[0]),
        "max-autotune": _key(bf16, CompileConfig(mode="max-autotune")),
        "tuned kernels": _key(bf16, CompileConfig(mode="tuned-kernels")),
        "fp8 attention": _key(bf16, CompileConfig(attention="fp8")),
    }
    assert len(set(keys.values())) == len(keys), keys
    assert _key(build_flux(seed=5)) == keys["bf16"], "new weights of the same layout share the package"


class _Store:
    """A WarmStart holding one package, for the signature of the base call."""

    def __init__(self, fn):
        self.fn, self.loaded = fn, []

    def load(self, sig, options=None):
        self.loaded.append(sig)
        return self.fn if sig == _sig(_call()) else None

    def save(self, sig, fn):
        return True


def test_a_call_that_differs_never_runs_the_package(monkeypatch):
    package, compiled_now = object(), object()
    monkeypatch.setattr(warm_start, "aot_compile", lambda *a, **k: compiled_now)
    p = Packages(_Store(package), {})

    def get(call):
        return p.get(KEY, warm_start.Call(None, (call["x"], call["t"]), {"context": call["context"], "y": call["y"],
                                                                         "transformer_options": call["options"]}),
                     contextlib.nullcontext)

    assert get(_call()) is package and p.outcome[KEY] == "loaded"
    strided = _call(x=torch.zeros(1, 16, 16, 16, dtype=torch.bfloat16).transpose(-1, -2))
    assert get(strided) is compiled_now
    assert get(_call(options={"rope_options": {"scale_x": 2.0}, OVERRIDE_KEY: sdpa_cudnn_first})) is compiled_now
