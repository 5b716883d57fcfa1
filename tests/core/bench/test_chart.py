"""core/bench/chart.py: the Benchmark chart's content, checked from its data and the figure's artists (not its
pixels)."""
import pytest

from fluxaccel.core.bench.chart import chart_data, render, to_image_tensor

ROWS = [{"config": "eager-bf16", "step_times": [0.17, 0.17, 0.18], "speedup_vs_baseline": 1.0, "first_run_s": 6.0,
         "peak_vram_gib": 22.7},
        {"config": "fp8-per_row+compile+graphs", "step_times": [0.11, 0.105, 0.12], "speedup_vs_baseline": 1.54,
         "first_run_s": 47.3, "peak_vram_gib": 14.3}]


def _panel(fig, title):
    (ax,) = [a for a in fig.axes if a.get_title(loc="left").startswith(title)]
    return ax


def test_chart_shows_each_series_bar_and_value():
    data = chart_data(ROWS)
    assert data["step_ms"] == [[170.0, 170.0, 180.0], [110.0, 105.0, 120.0]] and data["speedup"] == [1.0, 1.54]
    fig = render(ROWS)
    steps = _panel(fig, "time per sampling step")
    lines = steps.get_lines()
    assert [list(line.get_ydata()) for line in lines] == data["step_ms"] and steps.get_ylabel() == "ms"
    (legend,) = [a.get_legend() for a in fig.axes if a.get_legend() is not None]
    assert [t.get_text() for t in legend.get_texts()] == data["configs"]
    assert [h.get_color() for h in legend.legend_handles] == [line.get_color() for line in lines]
    speed = _panel(fig, "speedup vs its baseline")
    widths = [p.get_width() for p in speed.patches]
    assert widths == pytest.approx([1.0, 1.54])
    assert [t.get_text() for t in speed.texts] == ["1.00x", "1.54x"]
    assert [p.get_facecolor() for p in speed.patches] == [p.get_facecolor() for p in _panel(fig, "first run").patches]
    assert [t.get_text() for t in _panel(fig, "first run").texts] == ["6.0 s", "47.3 s"]
    assert [t.get_text() for t in _panel(fig, "peak VRAM").texts] == ["22.7", "14.3"]
    img = to_image_tensor(fig)
    assert img.shape == (1, 560, 960, 3) and 0 <= float(img.min()) and float(img.max()) <= 1


def test_a_cpu_run_says_vram_was_not_measured():
    rows = [{**r, "peak_vram_gib": None} for r in ROWS]
    vram = _panel(render(rows), "peak VRAM")
    assert not vram.patches and [t.get_text() for t in vram.texts] == ["not measured here"]


def test_without_matplotlib_the_chart_is_refused_with_the_install_command(monkeypatch):
    import sys

    from fluxaccel.core.bench.chart import ChartUnavailable

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # what an environment without matplotlib imports
    with pytest.raises(ChartUnavailable, match=r"the chart needs matplotlib .*python -m pip install matplotlib"):
        render(ROWS)
