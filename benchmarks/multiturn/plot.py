"""PNG of TTFT by turn index (one line per run, e.g. offload off vs on).

Uses Pillow, which every vLLM install already has (no matplotlib needed); without Pillow it
returns None with a message instead of failing the benchmark.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

COLORS = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189)]


def _nice_max(v: float) -> float:
    import math

    if v <= 0:
        return 1.0
    e = 10 ** math.floor(math.log10(v))
    for m in (1, 2, 2.5, 5, 10):
        if m * e >= v:
            return m * e
    return 10 * e


def plot_ttft_by_turn(summaries: list[dict[str, Any]], path: str | Path, stat: str = "p50") -> Path | None:
    """Line chart: x = turn index, y = TTFT ``stat`` in ms, one series per summary."""
    try:
        from PIL import Image, ImageDraw, ImageFont
    except ImportError:
        print("plot skipped: Pillow is not installed (pip install pillow)", file=sys.stderr)
        return None
    series = [(s["label"], {int(t): d[stat] for t, d in s["ttft_by_turn"].items() if d.get("count")})
              for s in summaries]
    turns = sorted({t for _, pts in series for t in pts})
    if not turns:
        print("plot skipped: no successful requests", file=sys.stderr)
        return None
    W, H, L, R, T, B = 900, 540, 80, 30, 50, 60
    img = Image.new("RGB", (W, H), "white")
    d = ImageDraw.Draw(img)
    try:
        font = ImageFont.load_default(size=14)
    except TypeError:  # Pillow < 10.1
        font = ImageFont.load_default()
    ymax = _nice_max(max(v for _, pts in series for v in pts.values()) * 1.05)
    xmin, xmax = turns[0], max(turns[-1], turns[0] + 1)
    X = lambda t: L + (t - xmin) / (xmax - xmin) * (W - L - R)
    Y = lambda v: H - B - v / ymax * (H - T - B)
    for i in range(6):
        v = ymax * i / 5
        d.line([(L, Y(v)), (W - R, Y(v))], fill=(225, 225, 225))
        d.text((L - 8, Y(v)), f"{v:g}", fill="black", font=font, anchor="rm")
    step = max(1, len(turns) // 15)
    for t in range(xmin, xmax + 1, step):
        d.text((X(t), H - B + 8), str(t), fill="black", font=font, anchor="mt")
    d.line([(L, T), (L, H - B), (W - R, H - B)], fill="black", width=2)
    d.text((W / 2, H - 18), "turn index (0 = first user turn)", fill="black", font=font, anchor="mm")
    d.text((L, 22), f"TTFT {stat} (ms) by turn", fill="black", font=font, anchor="lm")
    for k, (label, pts) in enumerate(series):
        c = COLORS[k % len(COLORS)]
        xy = [(X(t), Y(pts[t])) for t in sorted(pts)]
        if len(xy) > 1:
            d.line(xy, fill=c, width=3)
        for x, y in xy:
            d.ellipse([x - 4, y - 4, x + 4, y + 4], fill=c)
        lx = W - R - 200
        d.line([(lx, T + 12 + 20 * k), (lx + 30, T + 12 + 20 * k)], fill=c, width=3)
        d.text((lx + 38, T + 12 + 20 * k), label, fill="black", font=font, anchor="lm")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    img.save(out)
    return out
