"""The Benchmark chart: per-step milliseconds of each config (left) and speedup bars (right), drawn with PIL."""
from __future__ import annotations

import numpy as np
from PIL import Image, ImageDraw

COLORS = [(90, 160, 255), (245, 184, 61), (120, 220, 140), (230, 110, 160), (180, 140, 255), (200, 200, 200)]


def render(rows: list[dict], width: int = 960, height: int = 420) -> Image.Image:
    img = Image.new("RGB", (width, height), (27, 31, 42))
    d = ImageDraw.Draw(img)
    pad, mid = 48, int(width * 0.62)
    # left: per-step time
    series = [(r["config"], [1000 * t for t in r.get("step_times") or []]) for r in rows]
    ymax = max((max(s) for _, s in series if s), default=1.0) * 1.1
    n = max((len(s) for _, s in series), default=1)
    x0, y0, x1, y1 = pad, pad, mid - pad // 2, height - pad
    d.rectangle([x0, y0, x1, y1], outline=(90, 90, 100))
    d.text((x0, 12), "ms per sampling step (median over timed runs)", fill=(230, 230, 230))
    d.text((x0 - 40, y0), f"{ymax:.0f}", fill=(170, 170, 170))
    d.text((x0 - 16, y1 - 10), "0", fill=(170, 170, 170))
    for i, (name, s) in enumerate(series):
        color = COLORS[i % len(COLORS)]
        pts = [(x0 + (x1 - x0) * (k + 0.5) / n, y1 - (y1 - y0) * v / ymax) for k, v in enumerate(s)]
        if len(pts) > 1:
            d.line(pts, fill=color, width=2)
        for p in pts:
            d.ellipse([p[0] - 2, p[1] - 2, p[0] + 2, p[1] + 2], fill=color)
        d.text((x0 + 8, y0 + 8 + 14 * i), name, fill=color)
    # right: speedup bars
    bx0, bx1 = mid + pad // 2, width - pad // 2
    d.text((bx0, 12), "speedup vs baseline (median s/image)", fill=(230, 230, 230))
    smax = max([r["speedup_vs_eager"] for r in rows] + [1.0]) * 1.15
    bar_h = (y1 - y0) / max(len(rows), 1)
    for i, r in enumerate(rows):
        color = COLORS[i % len(COLORS)]
        top = y0 + i * bar_h + 4
        w = (bx1 - bx0) * r["speedup_vs_eager"] / smax
        d.rectangle([bx0, top, bx0 + w, top + bar_h - 8], fill=color)
        d.text((bx0 + 4, top + 2), f"{r['speedup_vs_eager']:.2f}x  {r['config']}", fill=(20, 20, 20))
    one = bx0 + (bx1 - bx0) / smax
    d.line([(one, y0), (one, y1)], fill=(230, 230, 230), width=1)
    return img


def to_image_tensor(img: Image.Image):
    """ComfyUI IMAGE: float32 [1, H, W, 3] in 0..1."""
    import torch

    return torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0)[None]
