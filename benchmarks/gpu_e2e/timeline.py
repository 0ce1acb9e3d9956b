"""Step timeline of one in-process vLLM engine (benchmark only).

Why: a reload's TTFT is "engine steps before the load is submitted + the load + steps until
a poll sees it done + the forward that makes the first token". The transfer totals give the
load alone; this says where the rest of the wall time went, the same way for vLLM's native
spec and ours (it wraps the engine and the connector, not our worker), so a TTFT gap between
them can be put on a step. Timestamps are ``time.perf_counter()`` in the engine's process.
"""

from __future__ import annotations

import gc
import os
import time
from typing import Any, Callable

_EVENTS: list[tuple[float, str, float, dict]] = []  # (start, what, seconds, details)
_GPU: list[tuple[float, str, Any, Any]] = []  # (start, what, start event, end event): device time of a call
_installed = False
_gc_start = [0.0]


def _on_gc(phase: str, info: dict) -> None:
    """Python's collector pauses the engine's thread too: a long one inside a forward step
    shows up here as "gc" (generation, collected objects)."""
    if phase == "start":
        _gc_start[0] = time.perf_counter()
    else:
        t0 = _gc_start[0]
        _EVENTS.append((t0, "gc", time.perf_counter() - t0, {"gen": info.get("generation"),
                                                             "collected": info.get("collected")}))


def _wrap(obj: Any, name: str, what: str, details: Callable[[Any, tuple], dict] | None = None) -> bool:
    fn = getattr(obj, name, None)
    if fn is None:
        return False

    def timed(*args, **kw):
        t0, c0 = time.perf_counter(), time.thread_time()
        out = fn(*args, **kw)
        t1, c1 = time.perf_counter(), time.thread_time()
        d = details(out, args) if details else {}
        d["cpu_ms"] = round((c1 - c0) * 1e3, 3)  # this thread's CPU time: wall minus it = waiting
        _EVENTS.append((t0, what, t1 - t0, d))
        return out

    setattr(obj, name, timed)
    return True


def _wrap_gpu(obj: Any, name: str, what: str) -> bool:
    """Time the device work a call enqueues on the current stream (CUDA events around it, read
    back in ``since``). Why: with async scheduling the step's wall time is CPU time, and the
    question "does the offload slow the model's kernels" is about device time."""
    fn = getattr(obj, name, None)
    try:
        import torch

        usable = fn is not None and torch.cuda.is_available()
    except ImportError:
        usable = False
    if not usable:
        return False

    def timed(*args, **kw):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        out = fn(*args, **kw)
        end.record()
        _GPU.append((t0, what, start, end))
        return out

    setattr(obj, name, timed)
    return True


def _sched_details(out, _args) -> dict:
    meta = getattr(out, "kv_connector_metadata", None)
    return {"tokens": int(getattr(out, "total_num_scheduled_tokens", 0) or 0),
            "loads": len(getattr(meta, "load_jobs", None) or {}),
            "stores": len(getattr(meta, "store_jobs", None) or {}),
            "flush": len(getattr(meta, "jobs_to_flush", None) or ())}


def _finished_details(out, _args) -> dict:
    recving = out[1] if isinstance(out, tuple) and len(out) > 1 else None
    return {"recv": len(recving or ())}


def engine_core(llm) -> Any:
    """The in-process engine core of one ``LLM`` (None when the engine runs in another process)."""
    return getattr(getattr(getattr(llm, "llm_engine", None), "engine_core", None), "engine_core", None)


def install(llm, gpu_events: bool = True) -> list[str]:
    """Wrap one ``LLM``'s engine step, scheduler and worker-side connector; returns what was
    wrapped (a vLLM without one of them just records less). ``gpu_events`` False: no CUDA events
    around the executor's calls (tensor parallel: the model runs in worker processes, and events
    here would only open a CUDA context in the engine's process)."""
    global _installed
    if _installed:
        return []
    _installed = True
    gc.callbacks.append(_on_gc)
    done = ["gc"]
    core = engine_core(llm)
    if core is not None:
        if _wrap(core, "step_fn", "step"):
            done.append("step")
        sched = getattr(core, "scheduler", None)
        if sched is not None and _wrap(sched, "schedule", "schedule", _sched_details):
            done.append("schedule")
        if sched is not None and _wrap(sched, "update_from_output", "update"):
            done.append("update")
        ex = getattr(core, "model_executor", None)
        if ex is not None:
            for name, what in (("execute_model", "execute"), ("sample_tokens", "sample")):
                if gpu_events and _wrap_gpu(ex, name, f"gpu_{what}"):  # inner: the events bracket the call only
                    done.append(f"gpu_{what}")
                if _wrap(ex, name, what):
                    done.append(what)
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
        conn = get_kv_transfer_group() if has_kv_transfer_group() else None
    except Exception:  # noqa: BLE001 - no connector (offload off) or another vLLM layout
        conn = None
    if conn is not None:
        for name, what, det in (("start_load_kv", "start_load", None), ("get_finished", "finished", _finished_details),
                                ("handle_preemptions", "preempt", None)):
            if _wrap(conn, name, what, det):
                done.append(what)
    return done


def mark() -> int:
    """Start a new record (the engine runs one ``generate`` at a time, so older events are
    dropped: memory stays bounded over long runs)."""
    _EVENTS.clear()
    _GPU.clear()
    return 0


def since(start: int, t0: float) -> list[dict]:
    """Events recorded after ``mark()`` returned ``start``, in ms from ``t0``; device times
    ("gpu_*", waits for their end events) are placed at their call's start."""
    gpu = []
    for t, w, a, b in _GPU:
        b.synchronize()
        gpu.append((t, w, a.elapsed_time(b) / 1e3, {}))
    _GPU.clear()
    _EVENTS.extend(gpu)
    _EVENTS.sort(key=lambda e: e[0])
    return [{"t_ms": round((t - t0) * 1e3, 3), "what": w, "ms": round(s * 1e3, 3), **d}
            for t, w, s, d in _EVENTS[start:]]


def breakdown(events: list[dict], wall_ms: float) -> dict:
    """Where one reload's wall time went: the step that scheduled the load, the first poll
    that saw it done, the first step that ran tokens after that, and the step count."""
    sched = [e for e in events if e["what"] == "schedule"]
    load_at = next((e["t_ms"] for e in sched if e["loads"]), None)
    seen = next((e for e in events if e["what"] == "finished" and e.get("recv")), None)
    seen_at = seen["t_ms"] + seen["ms"] if seen else None
    fwd = next((e for e in sched if e["tokens"] and (seen_at is None or e["t_ms"] >= seen_at)), None)
    steps = [e for e in events if e["what"] == "step"]
    run = next((e for e in events if e["what"] == "execute" and fwd and e["t_ms"] >= fwd["t_ms"]), None)
    return {"wall_ms": round(wall_ms, 3), "load_scheduled_ms": load_at, "load_seen_ms": seen_at,
            "forward_scheduled_ms": fwd["t_ms"] if fwd else None,
            "forward_ms": run["ms"] if run else None, "forward_cpu_ms": run.get("cpu_ms") if run else None,
            "steps": len(steps), "longest_step_ms": max((e["ms"] for e in steps), default=None),
            "flush_steps": sum(1 for e in sched if e["flush"]),
            "gc_ms": round(sum(e["ms"] for e in events if e["what"] == "gc"), 3),
            "gc_in_forward_ms": round(sum(e["ms"] for e in events if e["what"] == "gc" and fwd
                                          and e["t_ms"] >= fwd["t_ms"]), 3),
            "preempt_ms": round(sum(e["ms"] for e in events if e["what"] == "preempt"), 3)}


def totals(events: list[dict]) -> dict[str, list[float]]:
    """Per event kind: [count, total ms] (where one call's time went, e.g. a no-reuse batch)."""
    out: dict[str, list[float]] = {}
    for e in events:
        t = out.setdefault(e["what"], [0, 0.0])
        t[0] += 1
        t[1] = round(t[1] + e["ms"], 3)
    return out


HOST_COLUMNS = ("schedule", "execute", "sample", "update", "connector")  # step_rows' host ms, after the 4 first
CONNECTOR_CALLS = ("start_load", "finished", "preempt")


def step_rows(events: list[dict]) -> list[list[float]]:
    """One row per engine step: [tokens scheduled, step ms, device ms of the forward, device ms
    of sampling] (the calls that started inside the step), then the host ms of its parts
    (``HOST_COLUMNS``: the wall time of schedule, execute_model, sample_tokens, update, and of the
    connector's wrapped worker calls). Compact enough to keep every step of a no-reuse round, so
    prefill and decode steps can be compared on their own, and a slower step split into device
    time and which host part."""
    steps = [e for e in events if e["what"] == "step"]
    host = {w: 4 + i for i, w in enumerate(HOST_COLUMNS)}
    host.update({w: host["connector"] for w in CONNECTOR_CALLS})
    inner = [e for e in events if e["what"] in ("gpu_execute", "gpu_sample") or e["what"] in host]
    rows, j = [], 0
    for s in steps:
        end = s["t_ms"] + s["ms"]
        row = [0, s["ms"], 0.0, 0.0] + [0.0] * len(HOST_COLUMNS)
        while j < len(inner) and inner[j]["t_ms"] < s["t_ms"]:
            j += 1
        while j < len(inner) and inner[j]["t_ms"] <= end:
            e = inner[j]
            if e["what"] == "schedule":
                row[0] += e["tokens"]
            if e["what"] in host:  # schedule too: its tokens above, its ms here
                k = host[e["what"]]
                row[k] = round(row[k] + e["ms"], 3)
            else:
                k = 2 if e["what"] == "gpu_execute" else 3
                row[k] = round(row[k] + e["ms"], 3)
            j += 1
        rows.append(row)
    return rows


def thread_cpu() -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system) of every thread of this process, by thread id, with its name
    (Linux /proc; only the whole process, id 0, elsewhere)."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    times = os.times()
    out: dict[int, tuple[str, float]] = {0: ("(process)", times.user + times.system)}  # ended threads count here
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for t in tids:
        try:
            with open(f"/proc/self/task/{t}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(t)] = (name, (int(fields[11]) + int(fields[12])) / tick)  # utime, stime
    return out


def thread_cpu_delta(before: dict, after: dict, main_tid: int, top: int = 6) -> dict:
    """What the process's threads spent between two ``thread_cpu`` snapshots: the calling
    (engine) thread's CPU ms, the other threads' total (the process's less the engine thread's:
    threads that ended meanwhile count), and the busiest living others [name, ms]. Why: a slower
    engine step may share its core, cache or turbo budget with a busy thread of its own process
    (checked for ours' steady decode offset, docs/benchmarks.md: no such thread)."""
    d = {t: (n, c - before.get(t, (n, 0.0))[1]) for t, (n, c) in after.items()}
    main = d.get(main_tid, ("", 0.0))[1]
    others = sorted(((n, c) for t, (n, c) in d.items() if t not in (0, main_tid)), key=lambda x: -x[1])
    return {"main_ms": round(main * 1e3, 1), "others_ms": round((d.get(0, ("", 0.0))[1] - main) * 1e3, 1),
            "threads": len(after) - 1, "busiest": [[n, round(c * 1e3, 1)] for n, c in others[:top] if c > 0]}
