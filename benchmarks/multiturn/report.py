"""Summaries (p50/p90/p99), text tables, side-by-side comparison and JSON output."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

METRICS = ("ttft_ms", "tpot_ms", "latency_ms", "input_tokens", "output_tokens")
PCTS = (50, 90, 99)


def _dist(vals: list[float]) -> dict[str, float]:
    v = np.array([x for x in vals if not math.isnan(x)], dtype=float)
    if v.size == 0:
        return {"count": 0}
    d = {"count": int(v.size), "mean": float(v.mean()), "min": float(v.min()), "max": float(v.max())}
    d.update({f"p{p}": float(np.percentile(v, p)) for p in PCTS})
    return d


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    """Aggregate a ``driver.run_load`` result; throughput counts successful requests only."""
    res = run["results"]
    ok = [r for r in res if r.ok]
    rt = max(run["runtime_s"], 1e-9)
    s: dict[str, Any] = {
        "label": run["label"], "url": run["url"], "model": run["model"],
        "clients": run["clients"], "max_active": run["max_active"],
        "planned": run["planned"], "completed": len(ok), "failed": len(res) - len(ok), "skipped": run["skipped"],
        "runtime_s": run["runtime_s"], "warmup_s": run["warmup_s"],
        "requests_per_s": len(ok) / rt,
        "input_tokens_per_s": sum(r.input_tokens for r in ok) / rt,
        "output_tokens_per_s": sum(r.output_tokens for r in ok) / rt,
        "tokens_from": sorted({r.tokens_from for r in ok}),
        "errors": sorted({r.error for r in res if not r.ok})[:5],
        "server": run.get("server", {}),
    }
    for m in METRICS:
        s[m] = _dist([float(getattr(r, m)) for r in ok])
    by_turn: dict[int, list[float]] = {}
    for r in ok:
        by_turn.setdefault(r.turn, []).append(r.ttft_ms)
    s["ttft_by_turn"] = {str(t): _dist(v) for t, v in sorted(by_turn.items())}
    return s


def _fmt(x: float) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if float(x).is_integer() and abs(x) < 1000:
        return str(int(x))
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.3g}" if abs(x) < 10 else f"{x:.1f}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    w = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(str(c).rjust(w[i]) if i else str(c).ljust(w[i]) for i, c in enumerate(r)) + " |"
    return "\n".join([line(header), "|" + "|".join("-" * (x + 2) for x in w) + "|"] + [line(r) for r in rows])


def _rows(s: dict[str, Any]) -> list[tuple[str, float]]:
    rows = [("requests ok / planned", None), ("failed", s["failed"]), ("runtime s", s["runtime_s"]),
            ("req/s", s["requests_per_s"]), ("input tok/s", s["input_tokens_per_s"]),
            ("output tok/s", s["output_tokens_per_s"])]
    for m in METRICS:
        for k in ("mean",) + tuple(f"p{p}" for p in PCTS):
            rows.append((f"{m} {k}", s[m].get(k, float("nan"))))
    srv, nan = s.get("server") or {}, float("nan")
    rows += [("server prefix hit %", 100 * srv.get("prefix_hit_rate", nan)),
             ("server offload hit %", 100 * srv.get("external_hit_rate", nan)),
             ("offload loaded MiB", srv.get("offload_load_bytes", nan) / 2**20),
             ("offload stored MiB", srv.get("offload_store_bytes", nan) / 2**20)]
    return rows


def format_summary(s: dict[str, Any]) -> str:
    rows = [[name, f"{s['completed']} / {s['planned']}" if val is None else _fmt(val)] for name, val in _rows(s)]
    head = (f"{s['label']}: {s['url']} model={s['model']} clients={s['clients']} max_active={s['max_active']} "
            f"tokens from {'+'.join(s['tokens_from']) or '-'}")
    out = head + "\n" + _table(["metric", "value"], rows)
    if s["errors"]:
        out += "\nerrors: " + "; ".join(s["errors"])
    return out


def format_compare(off: dict[str, Any], on: dict[str, Any]) -> str:
    """Side by side; ratio = on / off (below 1 is better for times, above 1 for rates)."""
    rows = []
    for (name, a), (_, b) in zip(_rows(off), _rows(on)):
        if a is None:
            rows.append([name, f"{off['completed']} / {off['planned']}", f"{on['completed']} / {on['planned']}", ""])
            continue
        ratio = b / a if a and not (math.isnan(a) or math.isnan(b)) else float("nan")
        if name.startswith(("server", "offload")):
            ratio = float("nan")  # counters, not a speed: a ratio would mislead
        rows.append([name, _fmt(a), _fmt(b), "-" if math.isnan(ratio) else f"{ratio:.2f}x"])
    turns = sorted(set(off["ttft_by_turn"]) & set(on["ttft_by_turn"]), key=int)
    for t in turns:
        a, b = off["ttft_by_turn"][t]["p50"], on["ttft_by_turn"][t]["p50"]
        rows.append([f"ttft_ms p50 turn {t}", _fmt(a), _fmt(b), f"{b / a:.2f}x" if a else "-"])
    return _table(["metric", off["label"], on["label"], "on/off"], rows)


def write_json(path: str | Path, payload: dict[str, Any]) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(payload, indent=1, default=str))


def run_payload(run: dict[str, Any], summary: dict[str, Any]) -> dict[str, Any]:
    return {"summary": summary, "requests": [r.to_dict() for r in run["results"]]}
