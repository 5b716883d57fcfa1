"""core/compile/runner.py: a CUDA-graph step marked before every call, the output copied out of graph memory, and a
graph break refused as an error that says where (fullgraph)."""
import pytest
import torch

from fluxaccel.core.compile import runner as runner_mod
from fluxaccel.core.compile.runner import Runner
from fluxaccel.core.compile.shapes import ShapeKey
from fluxaccel.core.errors import FluxAccelError

KEY = ShapeKey(1, 2, 2, 0, "float32")


class Breaks(torch.nn.Module):
    def forward(self, x, timestep, context=None, transformer_options={}, **kwargs):
        y = x * 2
        torch._dynamo.graph_break()
        return y + 1


class Whole(torch.nn.Module):
    def forward(self, x, timestep, context=None, transformer_options={}, **kwargs):
        return x * 2 + timestep


def test_graph_step_marked_per_call_and_output_copied(monkeypatch):
    marks = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    held = torch.ones(2)
    r = Runner(Whole(), {}, graphs=True)
    r.compiled = lambda *a, **k: held  # what a graph replay returns: memory the next replay overwrites
    outs = [r(KEY, torch.ones(2), torch.zeros(1), None, {}, {}) for _ in range(3)]
    assert len(marks) == 3 and all(o is not held and torch.equal(o, held) for o in outs)


def test_without_graphs_no_mark_and_no_copy(monkeypatch):
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: pytest.fail("marked without graphs"))
    held = torch.ones(2)
    r = Runner(Whole(), {}, graphs=False)
    r.compiled = lambda *a, **k: held
    assert r(KEY, torch.ones(2), torch.zeros(1), None, {}, {}) is held


def test_compiled_call_equals_eager():
    x, t = torch.randn(3, 4), torch.tensor(0.5)
    out = Runner(Whole(), {}, graphs=False)(KEY, x, t, None, {}, {})
    assert torch.equal(out, Whole()(x, t))


def test_a_graph_break_is_an_error_naming_where_and_the_versions():
    with pytest.raises(FluxAccelError, match=r"cannot trace it in one piece: .*test_runner\.py:\d+ in forward.*ComfyUI .*torch "):
        Runner(Breaks(), {}, graphs=False)(KEY, torch.ones(2), torch.zeros(1), None, {}, {})


def test_graph_break_type_missing_lets_torchs_own_error_through(monkeypatch):
    from fluxaccel.core.upstream import Unavailable

    monkeypatch.setattr(runner_mod.torch_internals, "graph_break_error", lambda: Unavailable("torch", "x", "Unsupported"))
    with pytest.raises(Exception) as e:
        Runner(Breaks(), {}, graphs=False)(KEY, torch.ones(2), torch.zeros(1), None, {}, {})
    assert not isinstance(e.value, FluxAccelError)


class Norm(torch.nn.Module):
    def forward(self, x, timestep, context=None, transformer_options={}, **kwargs):
        return torch.nn.functional.layer_norm(x, (x.shape[-1],)) * timestep


def test_the_call_lowers_under_fluxaccels_reduction_limits(tmp_path, monkeypatch):
    """The compile a call triggers runs inside reductions.persistent(): inductor's cache holds its graph under that
    choice, so the same graph compiled inside the context is a hit and outside it a miss."""
    from torch._dynamo.utils import counters

    from fluxaccel.core.compile import reductions

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    x, t = torch.randn(8, 3072), torch.tensor(0.5)
    opts = {"fx_graph_cache": True}

    def compile_plain():
        torch._dynamo.reset()
        before = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
        torch.compile(Norm(), backend="inductor", dynamic=False, fullgraph=True, options=opts)(x, t)
        after = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
        return after[0] - before[0], after[1] - before[1]

    torch._dynamo.reset()
    Runner(Norm(), opts, graphs=False)(KEY, x, t, None, {}, {})
    with reductions.persistent():
        assert compile_plain() == (1, 0)
    assert compile_plain() == (0, 1)
