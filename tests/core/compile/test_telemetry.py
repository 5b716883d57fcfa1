"""core/compile/telemetry.py: what a first call and a warm call record, observed on a stand-in compiled model (no
compile): it only records and reports, it never changes a call."""
from types import SimpleNamespace

import pytest
import torch

from fluxaccel.core.compile import telemetry as tm
from fluxaccel.core.compile.shapes import ShapeKey
from fluxaccel.core.compile.stats import CompileStats

KEY = ShapeKey(1, 16, 16, 16, "bfloat16")


def _compiled(outcome=None, graphs=False, per_block=False):
    """A stand-in CompiledFlux; outcome: its warm-start package's (or, per_block, both block kinds' packages')."""
    from pathlib import Path

    from fluxaccel.core.compile.blocks import BlockCall
    from fluxaccel.core.cache.packages import Packages, WarmStart

    packages = Packages(WarmStart("k" * 32, Path("unused")), {})
    for k in ((BlockCall(KEY, "double_block"), BlockCall(KEY, "single_block")) if per_block else (KEY,)):
        if outcome:
            packages.outcome[k], packages.load_seconds[k] = outcome, 0.5
    c = SimpleNamespace(stats=CompileStats(), device=torch.device("cpu"), graphs_running=graphs, packages=packages,
                        runner=SimpleNamespace(call_graphs=None))
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


def test_per_block_packages_reported_for_their_shape():
    """A shape's outcome is its block kinds' packages' (both loaded: "loaded", load times summed); kinds that differ
    are each named."""
    c = _compiled("loaded", per_block=True)
    t = tm.Telemetry(c)
    with t.first_call(KEY, {}, torch.zeros(1)):
        pass
    assert c.stats.warm_start[KEY] == "loaded" and c.stats.compile_phases[KEY]["warm_start_load"] == 1.0
    from fluxaccel.core.compile.blocks import BlockCall

    c.packages.outcome[BlockCall(KEY, "single_block")] = "saved"
    outcome, _ = c.packages.outcome_of(KEY)
    assert outcome == (f"double_block blocks at {KEY.describe()}: loaded; single_block blocks at {KEY.describe()}: "
                       f"saved")


def test_a_failed_first_call_records_no_compile():
    c = _compiled()
    t = tm.Telemetry(c)
    with pytest.raises(RuntimeError):
        with t.first_call(KEY, {}, torch.zeros(1)):
            raise RuntimeError("boom")
    assert KEY not in c.stats.compile_seconds


def test_warm_call_timing_and_counts():
    c = _compiled()
    t = tm.Telemetry(c)
    with t.warm_call(torch.zeros(1)):
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
