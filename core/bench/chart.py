"""The Benchmark chart, drawn with matplotlib (its object API and Agg canvas: no pyplot, no global style change).

Four panels from the result rows: ms per sampling step of each configuration over its steps (lines, legend, units),
speedup of each row against its own baseline (bars with their values, 1x marked), first-run seconds and peak VRAM
(small bar panels). Its own light background and dark text read the same in the editor's light and dark themes.
`chart_data` is what the chart shows, as numbers (the tests check it; the JSON keeps every one of them).
"""
from __future__ import annotations

import io
import math

import numpy as np
import torch


# colour-blind-safe (Okabe-Ito), dark enough on the light background
COLORS = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#000000")
SIZE_IN, DPI = (9.6, 5.6), 100  # 960 x 560 px: the preview keeps ~11 px text legible at the node's default width


class ChartUnavailable(RuntimeError):
    """matplotlib is not installed: the Benchmark says so in its table instead of drawing."""


def _matplotlib():
    """matplotlib's Agg canvas, Figure and MaxNLocator, imported when a chart is drawn (not when ComfyUI loads the
    nodes: about half of FluxAccel's import time)."""
    try:  # a requirement of FluxAccel; without it the Benchmark says so in its table instead of drawing
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError as e:
        raise ChartUnavailable(f"the chart needs matplotlib ({e}): python -m pip install matplotlib into ComfyUI's "
                               "Python (FluxAccel's requirements.txt lists it)") from None
    return FigureCanvasAgg, Figure, MaxNLocator


def chart_data(rows: list[dict]) -> dict:
    """Per configuration: ms per step (each step of its timed runs, median over runs), speedup vs its baseline,
    first-run s, peak VRAM GiB (None off-GPU)."""
    return {
        "configs": [r["config"] for r in rows],
        "step_ms": [[1000 * t for t in (r.get("step_times") or [])] for r in rows],
        "speedup": [r["speedup_vs_baseline"] for r in rows],
        "first_run_s": [r.get("first_run_s") for r in rows],
        "peak_vram_gib": [r.get("peak_vram_gib") for r in rows],
    }


def _bars(ax, values, fmt, title, unit):
    """Horizontal bars in the configurations' colours and order (names are in the legend), values written on them."""
    ax.set_title(title, fontsize=11, loc="left")
    ax.set_yticks([])
    shown = [(i, v) for i, v in enumerate(values) if v is not None and math.isfinite(v)]
    if not shown:
        ax.text(0.5, 0.5, "not measured here", ha="center", va="center", transform=ax.transAxes, fontsize=10)
        ax.set_xticks([])
        return
    bars = ax.barh([i for i, _ in shown], [v for _, v in shown], color=[COLORS[i % len(COLORS)] for i, _ in shown])
    ax.bar_label(bars, labels=[fmt.format(v) for _, v in shown], padding=3, fontsize=10)
    ax.set_ylim(len(values) - 0.5, -0.5)  # first configuration on top, as in the legend
    ax.set_xlabel(unit, fontsize=9)
    ax.margins(x=0.3)


def render(rows: list[dict]):
    """A matplotlib Figure of the rows (to_image_tensor makes it a ComfyUI IMAGE)."""
    _, Figure, MaxNLocator = _matplotlib()
    data = chart_data(rows)
    names = data["configs"]
    fig = Figure(figsize=SIZE_IN, dpi=DPI, facecolor="#f7f7f4", layout="constrained")
    grid = fig.add_gridspec(2, 3, height_ratios=(1.35, 1))
    steps, speed = fig.add_subplot(grid[0, :2]), fig.add_subplot(grid[0, 2])
    first, vram, key = fig.add_subplot(grid[1, 0]), fig.add_subplot(grid[1, 1]), fig.add_subplot(grid[1, 2])
    for ax in (steps, speed, first, vram):
        ax.set_facecolor("white")
        ax.tick_params(labelsize=9)
    steps.set_title("time per sampling step", fontsize=11, loc="left")
    for i, ms in enumerate(data["step_ms"]):
        if ms:
            steps.plot(range(1, len(ms) + 1), ms, marker="o", lw=2, color=COLORS[i % len(COLORS)])
    steps.set_xlabel("step", fontsize=9)
    steps.set_ylabel("ms", fontsize=9)
    steps.set_ylim(bottom=0)
    n = max((len(ms) for ms in data["step_ms"]), default=1)
    steps.set_xlim(0.5, n + 0.5)
    steps.xaxis.set_major_locator(MaxNLocator(integer=True))
    _bars(speed, data["speedup"], "{:.2f}x", "speedup vs its baseline", "x (median s/image)")
    speed.axvline(1.0, color="#444444", lw=1, ls="--")
    _bars(first, data["first_run_s"], "{:.1f} s", "first run (compile, capture)", "s")
    _bars(vram, data["peak_vram_gib"], "{:.1f}", "peak VRAM", "GiB")
    key.axis("off")
    handles = [key.plot([], [], color=COLORS[i % len(COLORS)], lw=6)[0] for i in range(len(names))]
    key.legend(handles, names, loc="center left", fontsize=9, frameon=False, title="configuration",
               title_fontsize=10, alignment="left")
    return fig


def to_png(fig) -> bytes:
    """The figure as PNG bytes (the chart file kept beside the results)."""
    buf = io.BytesIO()
    _matplotlib()[0](fig).print_png(buf)
    return buf.getvalue()


def to_image_tensor(fig):
    """ComfyUI IMAGE: float32 [1, H, W, 3] in 0..1."""
    canvas = _matplotlib()[0](fig)
    canvas.draw()
    rgba = np.asarray(canvas.buffer_rgba(), dtype=np.float32)[..., :3] / 255.0
    return torch.from_numpy(np.ascontiguousarray(rgba))[None]
