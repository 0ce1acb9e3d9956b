"""README's picture: serving req/s and later-turn TTFT p50 per workload, from the GPU yardstick's JSON.

    .venv/bin/python scripts/plot_serving.py            # writes docs/serving.png (needs matplotlib)

Each input is a ``run serve`` result (``*.json`` or ``*.json.gz``: ``runs[].runs[]`` with a label and
the client's summary); a bar is the median over the passes of that server in that file. The default
inputs are the files behind docs/benchmarks.md's serving tables.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = [
    ("Ascend's layout, 32 clients", "docs/results/gpu_e2e_default_2026-11-27l/run9_serve.json.gz"),
    ("3x host KV (ours + disk: reuse admission)", "docs/results/disk_tier_2026-11-28/serve_cap_b.json"),
    ("3x host KV (ours + disk: default admission)", "docs/results/disk_tier_2026-11-28/serve_cap_c.json"),
]
ORDER = ["off", "native", "ours", "upper", "native-fs", "ours-disk"]
NAMES = {"upper": "bound", "native-fs": "vLLM fs tier", "ours-disk": "ours + disk"}


def medians(path: Path) -> dict[str, tuple[float, float]]:
    """label -> (median req/s, median later-turn TTFT p50 in s) over the passes in ``path``."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        doc = json.load(f)
    by: dict[str, list[tuple[float, float]]] = {}
    for part in doc["runs"]:
        for run in part.get("runs", []):
            s = run.get("summary", {})
            ttft = s.get("ttft_later_ms", {}).get("p50")
            if s.get("requests_per_s") and ttft is not None:
                by.setdefault(run["label"], []).append((s["requests_per_s"], ttft / 1e3))
    return {k: (statistics.median(r for r, _ in v), statistics.median(t for _, t in v)) for k, v in by.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "docs/serving.png"))
    ap.add_argument("inputs", nargs="*", help="TITLE=PATH pairs (default: the files behind docs/benchmarks.md)")
    a = ap.parse_args(argv)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot_serving.py needs the matplotlib package (pip install matplotlib)", file=sys.stderr)
        return 2
    inputs = [tuple(x.split("=", 1)) for x in a.inputs] if a.inputs else DEFAULT
    data = [(title, medians(ROOT / path if not Path(path).is_absolute() else Path(path))) for title, path in inputs]
    fig, axes = plt.subplots(2, len(data), figsize=(4.2 * len(data), 6.2), squeeze=False)
    colors = {"off": "#9e9e9e", "native": "#5b8def", "ours": "#e8743b", "upper": "#4caf50",
              "native-fs": "#8e6fd8", "ours-disk": "#c0392b"}
    for col, (title, med) in enumerate(data):
        labels = [k for k in ORDER if k in med]
        for row, (idx, ylabel) in enumerate(((0, "req/s"), (1, "later-turn TTFT p50 (s)"))):
            ax = axes[row][col]
            vals = [med[k][idx] for k in labels]
            bars = ax.bar([NAMES.get(k, k) for k in labels], vals, color=[colors[k] for k in labels])
            ax.bar_label(bars, fmt="%.2f", fontsize=8)
            ax.set_ylabel(ylabel)
            ax.tick_params(axis="x", labelsize=8, rotation=20)
            if row == 0:
                ax.set_title(title, fontsize=10)
    fig.suptitle("vLLM 0.23.0 on one H200, vLLM's multi-turn client (medians over passes)", fontsize=11)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print(a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
