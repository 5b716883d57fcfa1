"""core/graph_capture.py on the CPU: the bookkeeping of graphs captured around the compiled call.

A real CUDA graph needs a GPU (bench/probes/graph_capture.py runs this module's CapturedGraphs with
torch.cuda.CUDAGraph under cudaMallocAsync on the H200, results in bench/results/). Here the capture function is
CPU replay: `replay()` re-runs the captured closure on the *static* buffers into the *same* output tensor, which is
what a graph does -- so these tests fail if inputs are not copied into the buffers, if the output is handed out
without a copy, or if moved weights are not captured again.
"""
import pytest
import torch

from core.compile import CompileConfig, CompiledFlux
from core.graph_capture import CapturedGraphs, signature, weight_addresses
from fluxaccel_testing import denoise_once


class CpuReplay:
    """Stands in for torch.cuda.CUDAGraph on the CPU: replay recomputes fn() into the captured output's memory."""

    def __init__(self, fn):
        self.fn, self.replays = fn, 0
        self.out = fn()

    def replay(self):
        self.replays += 1
        self.out.copy_(self.fn())


def cpu_capture(fn):
    g = CpuReplay(fn)
    return g, g.out


class Scale(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([2.0]), requires_grad=False)

    def forward(self, x, *, bias=0.0, opts=None):
        return x * self.w + bias


def test_first_call_uncaptured_second_captures_then_replays_with_new_inputs():
    m = Scale()
    calls = []

    def fn(*a, **kw):
        calls.append(1)
        return m(*a, **kw)

    g = CapturedGraphs(fn, m, capture=cpu_capture)
    x1, x2, x3 = torch.ones(3), torch.full((3,), 5.0), torch.arange(3.0)
    assert torch.equal(g(x1, bias=1.0), x1 * 2 + 1)
    assert (g.stats.ungraphed_calls, g.stats.captures, len(g)) == (1, 0, 0)
    o2 = g(x2, bias=1.0)
    assert torch.equal(o2, x2 * 2 + 1) and (g.stats.captures, g.stats.replays) == (1, 1)
    o3 = g(x3, bias=1.0)
    assert torch.equal(o3, x3 * 2 + 1), "replay must read this call's input, copied into the static buffer"
    assert torch.equal(o2, x2 * 2 + 1), "an earlier output must survive the next replay (a copy is returned)"
    assert (g.stats.captures, g.stats.replays, len(calls)) == (1, 2, 4)  # 1 eager + capture + 2 replays


def test_signature_separates_shapes_dtypes_and_non_tensor_arguments():
    x = torch.ones(2, 3)
    base = signature((x,), {"bias": 1.0})
    assert signature((torch.zeros(2, 3),), {"bias": 1.0}) == base  # values do not matter
    assert signature((torch.ones(3, 2),), {"bias": 1.0}) != base
    assert signature((x.to(torch.bfloat16),), {"bias": 1.0}) != base
    assert signature((x.t().contiguous().t(),), {"bias": 1.0}) != base  # strides
    assert signature((x,), {"bias": 2.0}) != base  # a baked-in constant (e.g. a rope option)
    f, h = (lambda: 0), (lambda: 0)
    assert signature((x,), {"opts": {"o": f}}) == signature((x,), {"opts": {"o": f}})
    assert signature((x,), {"opts": {"o": f}}) != signature((x,), {"opts": {"o": h}})  # another attention override


def test_each_signature_gets_its_own_graph():
    m = Scale()
    g = CapturedGraphs(m, m, capture=cpu_capture)
    for _ in range(3):
        for bias in (0.0, 1.0):
            out = g(torch.ones(2), bias=bias)
            assert torch.equal(out, torch.full((2,), 2.0 + bias))
    assert (len(g), g.stats.captures, g.stats.ungraphed_calls, g.stats.replays) == (2, 2, 2, 4)


def test_moved_weights_are_captured_again():
    m = Scale()
    g = CapturedGraphs(m, m, capture=cpu_capture)
    x = torch.ones(2)
    g(x), g(x)
    before = weight_addresses(m)
    m.w = torch.nn.Parameter(torch.tensor([3.0]), requires_grad=False)  # a reload: new storage, new value
    assert weight_addresses(m) != before
    assert torch.equal(g(x), torch.full((2,), 3.0)), "a graph must not replay with the old weights' addresses"
    assert (g.stats.recaptures, g.stats.captures, len(g)) == (1, 2, 1)
    with torch.no_grad():
        m.w.copy_(torch.tensor([4.0]))  # in place (same address): the graph reads the new value, no recapture
    assert torch.equal(g(x), torch.full((2,), 4.0)) and g.stats.recaptures == 1


def test_weight_addresses_of_a_tensor_subclass_are_its_inner_tensors(cpu_fp8):
    from core.fp8 import Fp8Config
    from core.fp8_patch import apply_fp8
    from core.test_models import build_flux

    model = build_flux("tiny", seed=0)
    q, _ = apply_fp8(model, Fp8Config(granularity="per_row", layout="subclass"))
    q.patch_model()
    try:
        addrs = weight_addresses(q.model.diffusion_model)
        assert len(addrs) > sum(1 for _ in q.model.diffusion_model.parameters()), "FP8 data and scales counted"
        assert all(isinstance(a, int) and a for a in addrs)
    finally:
        q.unpatch_model()


def test_failed_capture_is_counted_and_that_signature_runs_without_graphs(caplog):
    m = Scale()

    def broken(fn):
        raise RuntimeError("operation not permitted when stream is capturing")

    g = CapturedGraphs(m, m, capture=broken)
    x = torch.ones(2)
    outs = [g(x) for _ in range(4)]
    assert all(torch.equal(o, x * 2) for o in outs)
    assert g.stats.captures == 0 and g.stats.ungraphed_calls == 4 and len(g.stats.failed) == 1
    assert "stream is capturing" in next(iter(g.stats.failed.values()))
    assert sum("capturing the compiled FLUX call as a CUDA graph failed" in r.message for r in caplog.records) == 1


def test_compiled_flux_captures_only_on_cuda(tiny_flux):
    dm = tiny_flux.model.diffusion_model
    cfg = CompileConfig(persistent_cache=False, block_regions=False)
    c = CompiledFlux(dm, cfg, torch.device("cpu"), capture=True)
    assert c.captured is None and c.graph_mode == "off"  # no CUDA graphs on the CPU, whatever was asked
    assert not CompileConfig().inductor_options(torch.device("cuda"), trees=False)["triton.cudagraphs"]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_captured_runner_in_compiled_flux_matches_the_uncaptured_call(tiny_flux, compiled, monkeypatch):
    """CompiledFlux with its CapturedGraphs (CPU replay): every call, captured or not, equals the plain call."""
    import core.compile as cc
    from core.compile_patch import apply_compile

    ref = denoise_once(tiny_flux)
    monkeypatch.setattr(cc.CompiledFlux, "graphs_active", property(lambda self: True))
    clone, c = apply_compile(tiny_flux, CompileConfig(persistent_cache=False, block_regions=False))
    fn = c._compiled if compiled else c._dm
    c.captured = CapturedGraphs(fn, c._dm, capture=cpu_capture)
    outs = [denoise_once(clone) for _ in range(3)]
    assert c.graph_mode == "captured" and c.stats.marks == 0  # no inductor step marks in this mode
    assert (c.captured.stats.ungraphed_calls, c.captured.stats.captures, c.captured.stats.replays) == (1, 1, 2)
    tol = 0 if not compiled else 0.02
    for o in outs:
        assert (o.float() - ref.float()).norm() / ref.float().norm() <= tol
    assert torch.equal(outs[1], outs[2])
