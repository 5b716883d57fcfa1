"""core/chart.py renders the Benchmark chart from result rows."""
from core.chart import render, to_image_tensor


def test_chart_draws_each_series_and_bar():
    rows = [{"config": "eager-bf16", "step_times": [0.17, 0.17, 0.18], "speedup_vs_eager": 1.0},
            {"config": "fp8-per_row+compile+graphs", "step_times": [0.11, 0.11, 0.12], "speedup_vs_eager": 1.54}]
    img = render(rows)
    t = to_image_tensor(img)
    assert t.shape == (1, 420, 960, 3) and 0 <= float(t.min()) and float(t.max()) <= 1
    colors = {c for _, c in img.getcolors(1 << 20)}
    assert (90, 160, 255) in colors and (245, 184, 61) in colors  # both series/bars drawn in their colours
    # the faster config's bar is longer: count its colour on the right half
    right = img.crop((600, 40, 960, 400))
    counts = {c: n for n, c in right.getcolors(1 << 20)}
    assert counts[(245, 184, 61)] > counts[(90, 160, 255)]
