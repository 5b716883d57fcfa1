"""core/quant/act_quant.py: GELU and row-wise FP8 activation quantization in one pass, against torchao's own
quantization of torch's GELU."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fluxaccel.core.quant import act_quant
from fluxaccel.core.quant.fp8 import float8_ops

ROOT = Path(__file__).resolve().parents[3]


def _rows(seed: int = 0, m: int = 12, n: int = 320):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, n, generator=g) * torch.logspace(-2, 1, m)[:, None]  # rows of very different ranges
    return x.to(torch.bfloat16)


def _torchao(h: torch.Tensor, lb=None, ub=None):
    """torchao's dynamic row-wise FP8 of h, as fp8.fp8_linear calls it."""
    ao = float8_ops()
    scale = ao.choose_scale(h, float8_dtype=torch.float8_e4m3fn, block_size=[1, h.shape[-1]], hp_value_lb=lb,
                            hp_value_ub=ub)
    return ao.quantize(h, scale, torch.float8_e4m3fn), scale


@pytest.mark.parametrize("gelu_from", [0, 64])
def test_reference_is_torchao_row_wise_fp8_of_torch_gelu(gelu_from):
    x = _rows()
    h = torch.cat([x[:, :gelu_from], torch.nn.functional.gelu(x[:, gelu_from:], approximate="tanh")], 1)
    q, scale = act_quant.reference(x, gelu_from)
    tq, tscale = _torchao(h)
    assert torch.equal(scale, tscale) and scale.shape == (x.shape[0], 1)
    assert torch.equal(q.float(), tq.float())
    assert not torch.equal(q.float()[:, :gelu_from], _torchao(torch.nn.functional.gelu(x, approximate="tanh"))[0]
                           .float()[:, :gelu_from]) or gelu_from == 0, "columns before gelu_from take no GELU"


def test_bounds_on_the_absmax_are_torchaos():
    x = _rows(1)
    q, scale = act_quant.reference(x, 0, lb=0.5, ub=2.0)
    tq, tscale = _torchao(torch.nn.functional.gelu(x, approximate="tanh"), lb=0.5, ub=2.0)
    bf16 = lambda v: float(torch.tensor(v, dtype=torch.bfloat16))  # noqa: E731  (torchao divides in bf16)
    assert torch.equal(scale, tscale) and float(scale.min()) == bf16(0.5 / 448) and \
        float(scale.max()) == bf16(2.0 / 448)
    assert torch.equal(q.float(), tq.float())


def test_the_registered_op_eager_and_compiled_equals_the_reference():
    """Off the GPU the op runs the reference; compiled, inductor compiles that into the graph: same values."""
    x = _rows(2).reshape(3, 4, 320)  # leading dims are flattened into rows
    rq, rs = act_quant.reference(x.reshape(-1, 320), 32)
    q, s = act_quant.gelu_rowwise_fp8(x, 32)
    assert torch.equal(q.float(), rq.float()) and torch.equal(s, rs)
    torch._dynamo.reset()
    cq, cs = torch.compile(lambda t: act_quant.gelu_rowwise_fp8(t, 32), dynamic=False,
                           options={"emulate_precision_casts": True})(x)  # as FluxAccel compiles
    assert torch.equal(cq.float(), rq.float()) and torch.equal(cs, rs)
    assert hasattr(torch.ops.fluxaccel, "gelu_rowwise_fp8")


@pytest.mark.parametrize("lb, ub", [(None, None), (0.5, 2.0)])
def test_the_pair_op_is_the_one_input_op_on_the_concatenated_row(lb, ub):
    """[a | GELU(m)] read from two tensors (m a strided view, as the single block's MLP stream is): the one-input
    op's values and scales on torch.cat((a, m)), eager and compiled, with torchao's absmax bounds too."""
    x = _rows(5, m=12, n=480)
    a, m = x[:, :96], x[:, 96:416]  # m: a view with row stride 480
    rq, rs = act_quant.gelu_rowwise_fp8(torch.cat((a, m), -1), 96, lb, ub)
    q, s = act_quant.gelu_pair_rowwise_fp8(a, m, lb, ub)
    assert q.shape == (12, 416) and torch.equal(q.float(), rq.float()) and torch.equal(s, rs)
    torch._dynamo.reset()
    cq, cs = torch.compile(lambda u, v: act_quant.gelu_pair_rowwise_fp8(u, v, lb, ub), dynamic=False,
                           options={"emulate_precision_casts": True})(a.reshape(3, 4, 96), m.reshape(3, 4, 320))
    assert torch.equal(cq.float(), rq.float()) and torch.equal(cs, rs)
    assert hasattr(torch.ops.fluxaccel, "gelu_pair_rowwise_fp8")


def _silu_gate(x: torch.Tensor, gate_from: int) -> torch.Tensor:
    """ComfyUI's SiLUActivation on x's columns from gate_from on: gate_fn(x1) * x2 (eager bf16)."""
    m1, m2 = x[:, gate_from:].chunk(2, dim=-1)
    return torch.cat([x[:, :gate_from], torch.nn.SiLU()(m1) * m2], 1)


@pytest.mark.parametrize("gate_from", [0, 64])
def test_silu_gate_reference_is_torchao_row_wise_fp8_of_comfyuis_gate(gate_from):
    x = _rows(6, n=gate_from + 2 * 160)
    q, scale = act_quant.silu_gate_reference(x, gate_from)
    tq, tscale = _torchao(_silu_gate(x, gate_from))
    assert q.shape == (12, gate_from + 160) and torch.equal(scale, tscale) and torch.equal(q.float(), tq.float())


@pytest.mark.parametrize("lb, ub", [(None, None), (0.5, 2.0)])
def test_the_silu_gate_ops_eager_and_compiled_equal_the_reference(lb, ub):
    """The one-input op on [a | m1 | m2] and the pair op on (a, [m1 | m2]) (m a strided view, as FLUX.2's single
    block's MLP stream is): the reference's values and scales, eager and compiled, with torchao's bounds too."""
    x = _rows(7, m=12, n=96 + 2 * 160 + 32)
    a, m = x[:, :96], x[:, 96:416]  # m: a view with row stride 448
    rq, rs = act_quant.silu_gate_reference(torch.cat((a, m), -1), 96, lb, ub)
    for q, s in (act_quant.silu_gate_rowwise_fp8(torch.cat((a, m), -1), 96, lb, ub),
                 act_quant.silu_gate_pair_rowwise_fp8(a, m, lb, ub)):
        assert q.shape == (12, 256) and torch.equal(q.float(), rq.float()) and torch.equal(s, rs)
    torch._dynamo.reset()
    opts = {"emulate_precision_casts": True}
    cq, cs = torch.compile(lambda u, v: act_quant.silu_gate_pair_rowwise_fp8(u, v, lb, ub), dynamic=False,
                           options=opts)(a.reshape(3, 4, 96), m.reshape(3, 4, 320))
    assert torch.equal(cq.float(), rq.float()) and torch.equal(cs, rs)
    dq, ds = torch.compile(lambda t: act_quant.silu_gate_rowwise_fp8(t, 0, lb, ub), dynamic=False, options=opts)(m)
    eq, es = act_quant.silu_gate_reference(m, 0, lb, ub)
    assert torch.equal(dq.float(), eq.float()) and torch.equal(ds, es)
    assert hasattr(torch.ops.fluxaccel, "silu_gate_rowwise_fp8") and hasattr(torch.ops.fluxaccel,
                                                                             "silu_gate_pair_rowwise_fp8")


_INTERPRETED = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
from tools.plugin import register
register()
from fluxaccel.core.quant import act_quant
g = torch.Generator().manual_seed(3)
x = (torch.randn(16, 300, generator=g) * torch.logspace(-2, 1, 16)[:, None]).to(torch.bfloat16)
out = {}
for gelu_from in (0, 100):
    h = torch.cat([x[:, :gelu_from], torch.nn.functional.gelu(x[:, gelu_from:], approximate="tanh")], 1)
    _, rs = act_quant.reference(x, gelu_from)
    rv = (h.float() / rs).clamp(-448, 448)  # the reference's values before their cast to e4m3
    v, s = torch.empty(16, 300), torch.empty_like(rs)  # a float32 output: the kernel's values before the cast
    act_quant._kernel()[(16,)](x, v, s, 300, x.stride(0), v.stride(0), 0.0, 0.0, GELU_FROM=gelu_from, HAS_LB=False,
                               HAS_UB=False, BLOCK=512)
    out[gelu_from] = (float(((s - rs) / rs).abs().max()), float(((v - rv).abs() / rv.abs().clamp(min=1)).max()),
                      float((v - rv).abs().max()))
a, m = x[:, :100], x[:, 100:]  # the pair kernel: the same row read from two tensors
_, rs = act_quant.reference(x, 100, 0.5, 3.0)
h = torch.cat([a, torch.nn.functional.gelu(m, approximate="tanh")], 1)
rv = (h.float() / rs).clamp(-448, 448)
v, s = torch.empty(16, 300), torch.empty_like(rs)
act_quant._kernel("gelu_pair_rowwise_fp8_kernel")[(16,)](a, m, v, s, 100, 200, a.stride(0), m.stride(0), v.stride(0),
                                                         0.5, 3.0, HAS_LB=True, HAS_UB=True, BLOCK_A=128, BLOCK_M=256)
out["pair"] = (float(((s - rs) / rs).abs().max()), float(((v - rv).abs() / rv.abs().clamp(min=1)).max()),
               float((v - rv).abs().max()))
for gate_from in (0, 100):  # FLUX.2's SiLU gate: x = [x0 | m1 | m2], 100 columns each
    _, rs = act_quant.silu_gate_reference(x, gate_from, 0.5, 3.0)
    m1, m2 = x[:, gate_from:].chunk(2, dim=-1)
    h = torch.cat([x[:, :gate_from], torch.nn.functional.silu(m1) * m2], 1)
    rv = (h.float() / rs).clamp(-448, 448)
    n = h.shape[1]
    v, s = torch.empty(16, n), torch.empty_like(rs)
    act_quant._kernel("silu_gate_rowwise_fp8_kernel")[(16,)](
        x, v, s, n, (300 - gate_from) // 2, x.stride(0), v.stride(0), 0.5, 3.0, GATE_FROM=gate_from, HAS_LB=True,
        HAS_UB=True, BLOCK=256)
    out[f"silu {gate_from}"] = (float(((s - rs) / rs).abs().max()),
                                float(((v - rv).abs() / rv.abs().clamp(min=1)).max()), float((v - rv).abs().max()))
a, m = x[:, :100], x[:, 100:]  # the SiLU-gate pair kernel
_, rs = act_quant.silu_gate_reference(x, 100)
m1, m2 = m.chunk(2, dim=-1)
rv = (torch.cat([a, torch.nn.functional.silu(m1) * m2], 1).float() / rs).clamp(-448, 448)
v, s = torch.empty(16, 200), torch.empty_like(rs)
act_quant._kernel("silu_gate_pair_rowwise_fp8_kernel")[(16,)](
    a, m, v, s, 100, 100, a.stride(0), m.stride(0), v.stride(0), 0.0, 0.0, HAS_LB=False, HAS_UB=False, BLOCK_A=128,
    BLOCK_H=128)
out["silu pair"] = (float(((s - rs) / rs).abs().max()), float(((v - rv).abs() / rv.abs().clamp(min=1)).max()),
                    float((v - rv).abs().max()))
print(out)
"""


def test_the_triton_kernel_in_tritons_interpreter_matches_the_reference(tmp_path):
    """The GPU kernels run by Triton's CPU interpreter (rows, columns, GELU from gelu_from on, reduction and
    scaling; the pair kernel reading the row from two tensors, with absmax bounds; FLUX.2's SiLU-gate kernels, one
    input with a kept prefix and the pair), writing values before the e4m3 cast (a float32 output): each row's scale
    and every value as the reference's, up to the interpreter's bf16 casts, which truncate (the GPU's own rounding
    and e4m3 cast run only on the GPU)."""
    pytest.importorskip("triton")
    script = tmp_path / "interpreted.py"
    script.write_text(_INTERPRETED)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, str(script), str(ROOT)], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = eval(done.stdout.strip().splitlines()[-1])  # noqa: S307  (our own script's printed dict)
    assert set(result) == {0, 100, "pair", "silu 0", "silu 100", "silu pair"}
    for gelu_from, (scale_err, value_err, _) in result.items():
        # truncations of one bf16 step (2^-7 relative at most) each: the GELU value and the absmax, the scale; the
        # value divided by the scale adds its own (a wrong column, GELU or scale would be off by far more)
        # the SiLU gate rounds twice (SiLU, then the product), so one truncation more in the absmax and the value
        steps = 3 if str(gelu_from).startswith("silu") else 2
        assert scale_err < steps * 2 ** -7 and value_err < (steps + 1) * 2 ** -7, (gelu_from, result)


def test_imported_again_the_module_reuses_the_registered_operator():
    """A second import of the module (another package name in one process) finds the operator already registered
    and uses it, rather than failing to register it again and turning fusion off."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("act_quant_again", act_quant.__file__)
    again = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(again)
    assert again.UNAVAILABLE == "" and again._OP is not None
    assert again.PAIR_UNAVAILABLE == "" and again._PAIR_OP is not None
    assert again.SILU_UNAVAILABLE == again.SILU_PAIR_UNAVAILABLE == "" and again._SILU_PAIR_OP is not None
    x = _rows(4)
    assert torch.equal(again.gelu_rowwise_fp8(x, 0)[1], act_quant.gelu_rowwise_fp8(x, 0)[1])


def test_without_triton_the_operator_is_unavailable_with_the_reason(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    for name, body in ((act_quant.OP_NAME, act_quant._op_body), (act_quant.PAIR_OP_NAME, act_quant._pair_body),
                       (act_quant.SILU_OP_NAME, act_quant._silu_body),
                       (act_quant.SILU_PAIR_OP_NAME, act_quant._silu_pair_body)):
        op, why = act_quant._register(name, body)
        assert op is None and why == "Triton is not installed (the fused kernel is a Triton kernel)"
