"""core/compile/runner.py: the compiled call -- the block table's shape and package-load marker set for each call, the
call's compiles run under FluxAccel's settings (reduction limits), a graph break refused as an error that says
where (fullgraph)."""
import contextlib

import pytest
import torch

from fluxaccel.core.compile import runner as runner_mod
from fluxaccel.core.compile.runner import ModelCall, Runner
from fluxaccel.core.compile.shapes import ShapeKey
from fluxaccel.core.errors import FluxAccelError

KEY = ShapeKey(1, 2, 2, 0, "float32")


class Table:
    """Stands in for blocks.BlockTable: no blocks to replace; records what the runner sets on it."""

    shape = loading = None

    def transformer_options(self) -> dict:
        return {}


class Compiled(torch.nn.Module):
    """A model whose work is one torch.compile'd function, as a FLUX model's blocks are through the block table."""

    def __init__(self, fn, options=None):
        super().__init__()
        self.fn = torch.compile(fn, backend="inductor", dynamic=False, fullgraph=True, options=options or {})

    def forward(self, x, timestep, context=None, transformer_options={}, **kwargs):
        return self.fn(x, timestep)


def _twice(x, t):
    return x * 2 + t


def _breaks(x, t):
    y = x * 2
    torch._dynamo.graph_break()
    return y + 1


def test_compiled_call_equals_eager_and_tells_the_table_its_shape():
    x, t = torch.randn(3, 4), torch.tensor(0.5)
    table = Table()
    out = Runner(Compiled(_twice), table)(KEY, ModelCall(x, t, None, {}, {}), loading=contextlib.nullcontext)
    assert torch.equal(out, _twice(x, t)) and table.shape == KEY and table.loading is contextlib.nullcontext


def test_a_graph_break_is_an_error_naming_where_and_the_versions():
    with pytest.raises(FluxAccelError, match=r"each kind of FLUX block as one graph, and torch.compile cannot trace it "
                                             r"in one piece: .*test_runner\.py:\d+ in _breaks.*ComfyUI .*torch "):
        Runner(Compiled(_breaks), Table())(KEY, ModelCall(torch.ones(2), torch.zeros(1), None, {}, {}))


def test_graph_break_type_missing_lets_torchs_own_error_through(monkeypatch):
    from fluxaccel.core.upstream import Unavailable

    monkeypatch.setattr(runner_mod.torch_internals, "graph_break_error", lambda: Unavailable("torch", "x", "Unsupported"))
    with pytest.raises(Exception) as e:
        Runner(Compiled(_breaks), Table())(KEY, ModelCall(torch.ones(2), torch.zeros(1), None, {}, {}))
    assert not isinstance(e.value, FluxAccelError)


def _norm(x, t):
    return torch.nn.functional.layer_norm(x, (x.shape[-1],)) * t


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
        torch.compile(_norm, backend="inductor", dynamic=False, fullgraph=True, options=opts)(x, t)
        after = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
        return after[0] - before[0], after[1] - before[1]

    torch._dynamo.reset()
    Runner(Compiled(_norm, opts), Table())(KEY, ModelCall(x, t, None, {}, {}))
    with reductions.persistent():
        assert compile_plain() == (1, 0)
    assert compile_plain() == (0, 1)
