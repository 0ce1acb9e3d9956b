"""Profile of one forward that makes tokens, inside a running engine (benchmark only).

Why: in every reload-TTFT run the forward that makes the first token after our load took 1-4 ms
longer than the same forward after native's load (docs/benchmarks.md, "Eighth run"). The forward
is CPU-bound in eager mode, so its host operators and device kernels (torch.profiler, CUPTI)
say whether our process does more work there, or waits.

``install(llm)`` wraps the executor's ``execute_model`` once; ``arm()`` makes the next call that
runs tokens a profiled one (``arm(skip=k)``: the one after k more such calls, e.g. a steady decode
step of a no-reuse round); ``take()`` returns its summary (``summarize``).
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

from . import timeline

_state: dict[str, Any] = {"armed": False, "skip": 0, "top": 12, "steps": 1, "open": None, "left": 0, "t0": None,
                          "last": None, "installed": False}


def summarize(events: list[Any], wall_s: float, cpu_s: float, top: int = 12) -> dict:
    """Host operators by self CPU time and device activities by total time, from profiler
    events (anything with ``name``, ``device_type``, ``self_cpu_time_total`` in us and
    ``time_range.start/end`` in us)."""
    host: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    dev: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    spans = []
    for e in events:
        if "CUDA" in str(getattr(e, "device_type", "")):
            a, b = float(e.time_range.start), float(e.time_range.end)
            spans.append((a, b, e.name[:40]))
            d = dev[e.name[:70]]
            d[0] += 1
            d[1] += b - a
        else:
            h = host[e.name[:70]]
            h[0] += 1
            h[1] += float(getattr(e, "self_cpu_time_total", 0.0))
    spans.sort()
    busy, end, last = 0.0, None, None
    # idle time by the pair of activities around it: where the device waits, not only how long
    gaps: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for a, b, name in spans:  # device time covered by at least one activity
        if end is None or a >= end:
            if end is not None:
                g = gaps[f"{last} > {name}"]
                g[0] += 1
                g[1] += a - end
            busy += b - a
            end, last = b, name
        elif b > end:
            busy += b - end
            end, last = b, name
    rank = lambda m: [[k, int(v[0]), round(v[1] / 1e3, 3)] for k, v in sorted(m.items(), key=lambda kv: -kv[1][1])[:top]]
    return {"wall_ms": round(wall_s * 1e3, 3), "cpu_ms": round(cpu_s * 1e3, 3),
            "host_ops": sum(int(v[0]) for v in host.values()),
            "host_self_ms": round(sum(v[1] for v in host.values()) / 1e3, 3),
            "device_ops": len(spans), "device_busy_ms": round(busy / 1e3, 3),
            "device_span_ms": round((spans[-1][1] - spans[0][0]) / 1e3, 3) if spans else 0.0,
            "top_host": rank(host), "top_device": rank(dev), "top_gaps": rank(gaps)}


def _tokens(args: tuple) -> int:
    return int(getattr(args[0], "total_num_scheduled_tokens", 0) or 0) if args else 0


def install(llm) -> bool:
    """Wrap ``execute_model`` of this engine's executor (in-process engine only)."""
    if _state["installed"]:
        return True
    ex = getattr(timeline.engine_core(llm), "model_executor", None)
    fn = getattr(ex, "execute_model", None)
    if fn is None:
        return False

    def profiled(*args, **kw):
        if _state.get("open") is not None and _tokens(args):
            _state["left"] -= 1
            if _state["left"] <= 0:
                _close()  # the window ends where the next step's forward begins
            return fn(*args, **kw)
        if not (_state["armed"] and _tokens(args)):
            return fn(*args, **kw)
        if _state["skip"] > 0:
            _state["skip"] -= 1
            return fn(*args, **kw)
        import torch
        from torch.profiler import ProfilerActivity, profile

        _state["armed"] = False
        cuda = torch.cuda.is_available()
        # a window of steps traces the device only (and the runtime calls CUPTI reports): tracing
        # every host operator would slow the host enough to open gaps of its own between steps
        window = _state["steps"] > 1 and cuda
        prof = profile(activities=([] if window else [ProfilerActivity.CPU]) + ([ProfilerActivity.CUDA] if cuda else []))
        prof.__enter__()
        _state.update(open=prof, left=_state["steps"], t0=(time.perf_counter(), time.thread_time()))
        out = fn(*args, **kw)
        if _state["steps"] <= 1:
            _close()
        return out

    ex.execute_model = profiled
    _state["installed"] = True
    return True


def _close() -> None:
    """End the open profile: wait for the kernels launched in it (for CUPTI), then summarize."""
    import torch

    prof, (t0, c0) = _state["open"], _state["t0"]
    t1, c1 = time.perf_counter(), time.thread_time()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    prof.__exit__(None, None, None)
    _state["open"] = None
    _state["last"] = summarize(list(prof.events()), t1 - t0, c1 - c0, top=_state["top"])


def arm(skip: int = 0, top: int = 12, steps: int = 1) -> None:
    """Profile the next call that runs tokens after ``skip`` such calls; keep ``top`` operators.
    ``steps`` > 1: one profile over that many engine steps (from this forward to the start of
    the forward ``steps`` later, host work between them included), so the device's idle gaps
    between steps show (device span minus busy time)."""
    _state.update(armed=True, skip=max(0, skip), top=top, steps=max(1, steps), last=None)


def take() -> dict | None:
    if _state.get("open") is not None:  # the run ended inside the window
        _close()
    out, _state["last"], _state["armed"] = _state["last"], None, False
    return out
