"""core/compile/telemetry.py: what a first call and a warm call record, observed on a stand-in compiled model (no
compile): it only records and reports, it never changes a call."""
from types import SimpleNamespace

import pytest
import torch

from fluxaccel.core.compile import telemetry as tm
from fluxaccel.core.compile.shapes import ShapeKey
from fluxaccel.core.compile.stats import CompileStats

KEY = ShapeKey(1, 16, 16, 16, "bfloat16")


def _compiled(outcome=None, graphs=False):
    packages = SimpleNamespace(outcome={KEY: outcome} if outcome else {}, load_seconds={KEY: 0.5} if outcome else {})
    c = SimpleNamespace(stats=CompileStats(), device=torch.device("cpu"), graphs=graphs, graphs_active=graphs,
                        graphs_running=graphs, runner=SimpleNamespace(packages=packages))
    return c


def test_first_call_records_time_package_outcome_and_tells_the_editor():
    c = _compiled("loaded")
    t = tm.Telemetry(c)
    told, progress = [], []
    t.on_compiled, t.on_progress = told.append, lambda text, s: progress.append(text)
    with t.first_call(KEY, {}, torch.zeros(1)) as watch:
        with watch.loading_package():
            assert "loading the warm-start package" in watch.text(0.0)
    st = c.stats
    assert KEY in st.compile_seconds and st.warm_start[KEY] == "loaded"
    assert st.compile_phases[KEY]["warm_start_load"] == 0.5 and told == [c]
    assert progress[-1].startswith(f"compiling {KEY.describe()}: ready")


def test_a_failed_first_call_records_no_compile():
    c = _compiled()
    t = tm.Telemetry(c)
    with pytest.raises(RuntimeError):
        with t.first_call(KEY, {}, torch.zeros(1)):
            raise RuntimeError("boom")
    assert KEY not in c.stats.compile_seconds


def test_graph_skips_at_compile_are_a_lost_degradation(monkeypatch):
    c = _compiled(graphs=True)
    n = iter([0, 2])
    monkeypatch.setattr(tm, "cudagraph_skips", lambda: next(n))
    with tm.Telemetry(c).first_call(KEY, {}, torch.zeros(1)):
        pass
    (d,) = c.stats.degradations
    assert c.stats.graph_skips == {KEY: 2} and d.kind == "lost" and "2 time(s)" in d.why and d.since


def test_warm_call_timing_and_counts():
    c = _compiled()
    t = tm.Telemetry(c)
    with t.warm_call(KEY, torch.zeros(1)):
        pass
    t.count_call(False)
    assert len(c.stats.host_s) == 1 and c.stats.calls == 1 and c.stats.model_compiler_paused == 0


def test_model_compiler_answers_are_counted_apart():
    from fluxaccel.core.upstream import Unavailable

    c = _compiled()
    t = tm.Telemetry(c)
    t.count_call(True)
    t.count_call(Unavailable("ComfyUI", "0.38.1", "pause_malloc_graph"))
    assert (c.stats.model_compiler_paused, c.stats.model_compiler_unknown) == (1, 1)
