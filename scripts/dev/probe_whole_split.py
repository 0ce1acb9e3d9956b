#!/usr/bin/env python3
"""Where a whole staged transfer's fixed cost goes (issue #22), on a GPU, no vLLM.

core_bench splits the loss against one contiguous copy into "outside" the engine's device span
and "inside" it. This probe times the host side of the same transfers piece by piece (median
microseconds over ``--reps``, consecutive host chunks, the core's default staging):

- ``plan``: 0 (``OffloadWorkerCore.submit`` plans the common transfer inline: its split, ids checks and
  room are in ``pre_native``; earlier trees' probes timed ``OffloadWorkerCore.plan`` apart);
- ``submit_py``: ``OffloadWorkerCore.submit`` less the native call (the plan, events, stream order, the
  request, and what follows the call, which overlaps the copies); ``pre_native``: from submit until the
  native call begins (pre_native + finish: the Python on the critical path); ``native``:
  ``npo_cuda_staged_run`` (every driver call of the transfer), or
  with the native planner ``npo_cuda_staged_submit`` (its planning and every driver call);
- ``wait``: from submit's return until the end event's synchronize returns; ``finish``: the poll
  that reports it; ``span``: the engine's device span; ``whole``: all of it;
- ``ref``: one contiguous copy of the same bytes, enqueue + synchronize (the 100% line);
- ``floor``: the same transfer's native call alone, its request built once beforehand (no split, no
  request, no engine, no poll), enqueue + synchronize: what the library and the driver leave of the
  100% line, the bound for any Python front end on this host (``floor%``);
- the same three waited for by polling instead of a blocking sync (``spin``: submit, then
  ``poll`` until it reports the transfer, the earliest a connector can see it; ``ref_spin``: the
  copy, then the stream's query; ``floor_spin``: the native call, then the end's query) and
  ``spin%`` = ref_spin / spin, ``fspin%`` = ref_spin / floor_spin. A blocking sync lets the thread
  sleep (the poll after it took 16-28 us on an H200 host, its pieces timed in a loop 4-5 us:
  docs/benchmarks.md); vLLM's engine thread is busy between steps.

``--cpu-time`` adds a pass per shape and direction that reads the thread's CPU clock beside the wall
clock around plan, submit and the reporting poll. ``--detail`` also times the whole front end in a
loop with the native call a no-op (``hot_*``). Then single driver calls through the library, with the
stream held busy so none blocks: a one-descriptor ``cuMemcpyBatchAsync``, the same copy by
``cuMemcpyAsync``, and a 3- and 48-descriptor batch. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import threading
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from benchmarks.core_bench import CoreRig, shape_named  # noqa: E402
from benchmarks.transfer import contiguous_copy_fn, median_seconds  # noqa: E402
from vllm_npu_offload._native.cuda import load_library  # noqa: E402
from vllm_npu_offload.copy.base import Direction  # noqa: E402
from vllm_npu_offload.engine import TransferResult  # noqa: E402
from vllm_npu_offload.platform import get_platform  # noqa: E402
from vllm_npu_offload.stats import TOTALS  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from probe_host_ops import host  # noqa: E402

PARTS = ("plan", "submit_py", "pre_native", "native", "wait", "finish", "whole", "span", "ref", "floor")
SPIN_PARTS = ("spin", "ref_spin", "floor_spin")


def split_one(rig: CoreRig, direction: Direction, reps: int, lib) -> dict[str, float]:
    core, platform = rig.core, rig.platform
    native_s: list[float] = []
    native_at: list[float] = []  # when each native call began
    real_run, real_submit = lib.staged_run, lib.staged_submit

    def timed_run(job, rows):
        t = time.perf_counter()
        real_run(job, rows)
        native_s.append(time.perf_counter() - t)
        native_at.append(t)

    def timed_submit(request):
        t = time.perf_counter()
        links = real_submit(request)
        native_s.append(time.perf_counter() - t)
        native_at.append(t)
        return links

    lane = _ordered_lane(rig.core, direction)
    real_call = lane.call if lane is not None else None

    def timed_call():  # the ordered submit's native call (the lane's, not lib.staged_submit)
        t = time.perf_counter()
        rc = real_call()
        native_s.append(time.perf_counter() - t)
        native_at.append(t)
        return rc

    lib.staged_run, lib.staged_submit = timed_run, timed_submit
    if lane is not None:
        lane.call = timed_call
    rows: dict[str, list[float]] = {k: [] for k in PARTS}
    try:
        for rep in range(reps + 3):
            dev, chunks = rig.ids("seq", seed=rep)
            native_s.clear()
            native_at.clear()
            rig._job += 1
            t0 = time.perf_counter()
            core.submit(rig._job, direction, dev, [len(dev)], [0], chunks, staged=True)  # as the connectors do
            t2 = time.perf_counter()
            core.engine._queues[direction][-1].end.synchronize()
            t3 = time.perf_counter()
            res = core.poll()
            t4 = time.perf_counter()
            if len(res) != 1 or not res[0].success:
                raise RuntimeError(f"transfer failed: {res}")
            if rep < 3:
                continue
            nat = sum(native_s)
            pre = native_at[0] - t0 if native_at else float("nan")
            # plan: 0, inside pre_native (``core.submit`` plans the common transfer inline; earlier
            # trees' probes timed ``core.plan`` apart, the sum is the same critical path)
            for k, v in (("plan", 0.0), ("submit_py", t2 - t0 - nat), ("pre_native", pre), ("native", nat),
                         ("wait", t3 - t2),
                         ("finish", t4 - t3), ("whole", t4 - t0), ("span", res[0].seconds)):
                rows[k].append(v)
    finally:
        lib.staged_run, lib.staged_submit = real_run, real_submit
        if lane is not None:
            lane.call = real_call
    nbytes = rig.shape.blocks * sum(rig.shape.pages)
    host_t = core.host.tensor[:nbytes]
    dev_t = torch.empty(nbytes, dtype=torch.uint8, device=platform.device)
    stream = platform.new_stream()
    ref = contiguous_copy_fn(platform, dev_t, host_t, direction, stream)
    rows["ref"] = [median_seconds(ref, stream.synchronize, reps)]
    rows["ref_spin"] = [median_seconds(ref, lambda: _spin(stream.query), reps)]
    rows["floor"] = floor_one(rig, direction, reps, lib)
    rows["floor_spin"] = floor_one(rig, direction, reps, lib, spin=True)
    rows["spin"] = spin_one(rig, direction, reps)
    out = {k: float(np.median(v)) * 1e6 for k, v in rows.items()}
    out["bytes"] = nbytes
    out["slices"] = len(rig.core.stager.slice_sizes(rig.shape.blocks, direction))
    return out


def _ordered_lane(core, direction: Direction):
    """The pipeline's reused request of ``direction`` (made now if none ran yet), whose ``call`` a natively
    ordered submit makes instead of ``lib.staged_submit``; None where transfers are not ordered natively."""
    stager = core.stager
    if stager is None or not stager.orders_natively:
        return None
    return stager._fused._lane(stager, direction)


def cpu_one(rig: CoreRig, direction: Direction, reps: int) -> dict[str, float]:
    """Wall and thread-CPU us of a real transfer's plan, submit and reporting poll (a pass of its own:
    reading the thread's CPU clock is a system call). CPU near wall: the host ran the Python slowly
    (caches, clocks); CPU well under wall: the thread was off its core or waiting (a lock, the GIL)."""
    core = rig.core
    rows: dict[str, list[float]] = {k: [] for k in ("plan", "plan_cpu", "submit", "submit_cpu", "finish",
                                                   "finish_cpu")}
    wall, cpu = time.perf_counter, time.thread_time
    for rep in range(reps + 3):
        dev, chunks = rig.ids("seq", seed=rep)
        rig._job += 1
        w0, c0 = wall(), cpu()
        w1, c1 = w0, c0  # plan: inside submit (``core.submit`` plans inline)
        core.submit(rig._job, direction, dev, [len(dev)], [0], chunks, staged=True)
        w2, c2 = wall(), cpu()
        core.engine._queues[direction][-1].end.synchronize()
        w3, c3 = wall(), cpu()
        res = core.poll()
        w4, c4 = wall(), cpu()
        if len(res) != 1 or not res[0].success:
            raise RuntimeError(f"transfer failed: {res}")
        if rep >= 3:
            for k, v in (("plan", w1 - w0), ("plan_cpu", c1 - c0), ("submit", w2 - w1), ("submit_cpu", c2 - c1),
                         ("finish", w4 - w3), ("finish_cpu", c4 - c3)):
                rows[k].append(v)
    return {k: float(np.median(v)) * 1e6 for k, v in rows.items()}


def _spin(done) -> None:
    """Wait by polling ``done()`` (no blocking sync: the thread stays on its core, as vLLM's engine
    thread, busy every step, does)."""
    while not done():
        pass


def spin_one(rig: CoreRig, direction: Direction, reps: int) -> list[float]:
    """Seconds per whole transfer as the connector sees it: plan + submit, then ``poll`` again and
    again until it reports the transfer (the earliest a connector that polls can see it)."""
    out = []
    for rep in range(reps + 3):
        dev, chunks = rig.ids("seq", seed=rep)
        rig._job += 1
        seconds = whole_seconds(rig.core, rig._job, direction, dev, chunks, spin=True)
        if rep >= 3:
            out.append(seconds)
    return out


def whole_seconds(core, job: int, direction, dev, chunks, spin: bool, staged: bool | None = True) -> float:
    """One transfer through ``core`` (staged; ``staged=None``: the core's own choice, as a connector's),
    from submit until a poll reports it: after the end event's synchronize, or (``spin``) polling from
    the submit on (also ``ab_whole_paired.py``'s)."""
    t0 = time.perf_counter()
    core.submit(job, direction, dev, [len(dev)], [0], chunks, staged=staged)
    if not spin:
        core.engine._queues[direction][-1].end.synchronize()
    res = core.poll()
    while not res:
        res = core.poll()
    t1 = time.perf_counter()
    if len(res) != 1 or not res[0].success:
        raise RuntimeError(f"transfer failed: {res}")
    return t1 - t0


def floor_one(rig: CoreRig, direction: Direction, reps: int, lib, spin: bool = False) -> list[float]:
    """Seconds per transfer of the native call alone (its request built once, the stream order and
    events as the engine would pass them), enqueue + synchronize of the end event (``spin``: + polls
    of its query)."""
    core, platform = rig.core, rig.platform
    stager = core.stager
    if stager is None or not stager.plans_natively:
        return [float("nan")]
    dev, chunks = rig.ids("seq", seed=0)
    transfer = core.plan(direction, dev, [len(dev)], [0], chunks, staged=True)
    stream = core.engine.stream(direction)
    raw = platform.raw_stream_handle
    req = stager._fused.request(stager, transfer, raw(stream), raw(stager._aux_for(direction, stream, None)))
    start, end = platform.new_event(), platform.new_event()
    req.compute, req.after = platform.raw_current_stream() or None, None
    req.start, req.end = platform.raw_event_handle(start), platform.raw_event_handle(end)
    req.compute_mark = stager._fused.model_mark(direction)
    out = []
    try:
        for rep in range(reps + 3):
            t = time.perf_counter()
            lib.staged_submit(req)
            _spin(end.query) if spin else end.synchronize()
            if rep >= 3:
                out.append(time.perf_counter() - t)
    finally:
        core.pool.release(transfer.buffers)
    return out


def driver_calls(platform, lib, reps: int) -> dict[str, float]:
    """CPU us of single driver calls through the library, the stream held so none blocks."""
    stream = platform.new_stream()
    handle = platform.raw_stream_handle(stream)
    host = torch.empty(1 << 24, dtype=torch.uint8).pin_memory()
    dev = torch.empty(1 << 24, dtype=torch.uint8, device=platform.device)
    out = {}
    for name, n, batch in (("batch_1", 1, True), ("memcpy_1", 1, False), ("batch_3", 3, True),
                           ("batch_48", 48, True), ("memcpy_3", 3, False)):
        size = 4096
        src = np.array([host.data_ptr() + i * size for i in range(n)], np.int64)
        dst = np.array([dev.data_ptr() + i * size for i in range(n)], np.int64)
        sizes = np.full(n, size, np.int64)
        ts = []
        for rep in range(reps + 5):
            platform.hold(stream, 2e-3)
            t = time.perf_counter()
            lib.copy(src, dst, sizes, handle, batch, src_order_any=True)
            ts.append(time.perf_counter() - t)
            stream.synchronize()
        out[name] = float(np.median(ts[5:])) * 1e6
    return out


def _host() -> str:
    """The host's CPU model, Python and clock source (a VM's clock may make every timer read a
    system call, which the engine pays at each submit and poll)."""
    h = host()
    return f"{h['cpu']}, Python {h['python']}, clocksource {h['clocksource']}"


def _med_us(fn, reps: int) -> float:
    ts = []
    for _ in range(reps + 5):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts[5:])) * 1e6


def detail(platform, lib, shape: str, reps: int) -> dict:
    """CPU us of the host-side pieces of one staged load of ``shape`` (torch stream and event
    calls as the engine makes them, the planner's steps, the pipeline's job building with the
    native call a no-op), then a cProfile of ``reps`` whole submits."""
    rig = CoreRig(platform, shape_named(shape))
    core, d = rig.core, Direction.H2D
    stream, compute = core.engine.stream(d), platform.current_stream()
    ev = platform.new_event()
    dev, chunks = rig.ids("seq", seed=1)
    parts = core._split("dst", dev, [len(dev)], [0], chunks)

    def ctx():
        with platform.stream_context(stream):
            pass

    lock = threading.Lock()

    def lock_cycle():
        with lock:
            pass

    out = {  # the host itself first: an empty call (what every row below includes), the clock, a lock
        "noop": _med_us(lambda: None, reps),
        "perf_counter": _med_us(time.perf_counter, reps),
        "lock_cycle": _med_us(lock_cycle, reps),
        "current_stream": _med_us(platform.current_stream, reps),
        "wait_stream": _med_us(lambda: stream.wait_stream(compute), reps),
        "stream_context": _med_us(ctx, reps),
        "event_record": _med_us(lambda: ev.record(stream), reps),
        "event_query": _med_us(ev.query, reps),
        "split": _med_us(lambda: core._split("dst", dev, [len(dev)], [0], chunks), reps),
        "raw_current_stream": _med_us(platform.raw_current_stream, reps),
        "raw_event_handle": _med_us(lambda: platform.raw_event_handle(ev), reps),
        "ctypes_call": _med_us(lib._lib.npo_cuda_abi_version, reps),
        "stats_record": _med_us(lambda: TOTALS.pending.append((True, True, 1 << 24, 3e-4, 4e-4)), reps),
        "pool_cycle": _med_us(lambda: core.pool.release([core.pool.acquire(64)]), reps),
    }
    ev2 = platform.new_event()
    ev.record(stream)
    ev2.record(stream)
    ev2.synchronize()
    out["event_elapsed"] = _med_us(lambda: ev.elapsed_time(ev2), reps)
    out["event_query_done"] = _med_us(ev2.query, reps)
    out["result_object"] = _med_us(lambda: TransferResult(1, d, True, 1 << 24, 3e-4, 100, None), reps)
    plans = []
    out["staged_plan"] = _med_us(lambda: plans.append(core._staged_plan(d, parts)), reps)
    plan = plans[-1]
    real = lib.staged_run
    lib.staged_run = lambda job, rows: None
    try:
        out["pipeline_python"] = _med_us(lambda: core.stager.run(plan, d, stream), reps)
    finally:
        lib.staged_run = real
    stream.synchronize()
    for p in plans:
        core.pool.release(p.buffers)
    if core.stager.plans_natively:  # the native path's Python: the transfer and its request
        transfers = []
        out["native_transfer"] = _med_us(lambda: transfers.append(core._native_staged(d, parts, len(dev))), reps)
        raw = platform.raw_stream_handle(stream)
        out["native_request"] = _med_us(lambda: core.stager._fused.request(core.stager, transfers[-1], raw, raw), reps)
        for t in transfers:
            core.pool.release(t.buffers)
    out.update(front_end_hot(core, lib, rig, d, reps))
    prof = cProfile.Profile()
    for rep in range(reps):
        dev, chunks = rig.ids("seq", seed=rep)
        prof.enable()
        core.submit(10_000 + rep, d, dev, [len(dev)], [0], chunks, staged=True)
        prof.disable()
        core.wait([10_000 + rep])
        core.poll()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
    out["profile"] = buf.getvalue()
    prof = cProfile.Profile()  # the poll that reports one finished transfer
    for rep in range(reps):
        dev, chunks = rig.ids("seq", seed=rep)
        core.submit(20_000 + rep, d, dev, [len(dev)], [0], chunks, staged=True)
        core.engine._queues[d][-1].end.synchronize()
        prof.enable()
        core.poll()
        prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(20)
    out["profile_poll"] = buf.getvalue()
    rig.close()
    return out


def front_end_hot(core, lib, rig: CoreRig, d: Direction, reps: int) -> dict[str, float]:
    """The whole front end of a transfer (plan, submit, the poll that reports it) in a loop with the
    native call a no-op: no copy, no wait, so nothing between transfers cools the host's caches. Set
    against the probe's plan + submit_py + finish of real transfers, it tells a slow host (the two
    agree) from a cost that a transfer's wait adds (the real ones cost more)."""
    real = lib.staged_submit
    lib.staged_submit = lambda req: 0  # the job's events stay as last recorded (done), so the poll reports it
    lane = _ordered_lane(core, d)
    real_call = lane.call if lane is not None else None
    if lane is not None:
        lane.call = lambda: 0
    rows: dict[str, list[float]] = {"hot_plan": [], "hot_submit": [], "hot_poll": [], "hot_front_end": []}
    try:
        for rep in range(reps + 5):
            dev, chunks = rig.ids("seq", seed=rep)
            t0 = t1 = time.perf_counter()  # hot_plan: inside hot_submit (``core.submit`` plans inline)
            core.submit(30_000 + rep, d, dev, [len(dev)], [0], chunks, staged=True)
            t2 = time.perf_counter()
            res = core.poll()
            t3 = time.perf_counter()
            while not res:  # an event made at this submit was just recorded (warm-up): wait for it
                res = core.poll()
            if len(res) != 1:
                raise RuntimeError(f"no-op transfer reported wrong: {res}")
            if rep >= 5:
                for k, v in (("hot_plan", t1 - t0), ("hot_submit", t2 - t1), ("hot_poll", t3 - t2),
                             ("hot_front_end", t3 - t0)):
                    rows[k].append(v)
    finally:
        lib.staged_submit = real
        if lane is not None:
            lane.call = real_call
    return {k: float(np.median(v)) * 1e6 for k, v in rows.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", default="qwen2.5-0.5b,llama-70b-tp8,qwen2.5-0.5b-fp8,llama-8b",
                    help="comma list of core_bench shapes; NAME@N: N device blocks per transfer")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json", default=None)
    ap.add_argument("--detail", default="qwen2.5-0.5b", help="shape whose host-side pieces are timed one by one")
    ap.add_argument("--event-timing", default="1",
                    help="NPU_OFFLOAD_EVENT_TIMING per run of each shape: 1, 0 or 1,0 (both; rows of 0 are "
                         "named SHAPE~notime, their span is the host's submit -> poll time)")
    ap.add_argument("--engine-order", action="store_true",
                    help="natively planned transfers leave the stream order to the engine (torch calls), as "
                         "before the library took it (as NPU_OFFLOAD_STAGE_ORDER=engine)")
    ap.add_argument("--native-poll", default="0",
                    help="NPU_OFFLOAD_NATIVE_POLL per run of each shape: 0, 1 or 0,1 (both; rows of 1 are named "
                         "SHAPE~npoll: the poll asks the library, one call, instead of torch's query and "
                         "elapsed_time)")
    ap.add_argument("--cpu-time", action="store_true",
                    help="per shape and direction, a pass timing plan, submit and the reporting poll in wall and "
                         "thread-CPU time")
    a = ap.parse_args()
    platform = get_platform()
    lib = load_library()
    res = {"device": platform.device_name(), "library": lib.describe(), "shapes": {}, "host": _host()}
    print(f"device: {res['device']}; host: {res['host']}")
    print(f"us per staged transfer (median of {a.reps}), consecutive host chunks")
    print(f"{'shape':26s} {'dir':3s} {'MiB':>5s} {'sl':>2s} " + " ".join(f"{k:>9s}" for k in PARTS + SPIN_PARTS)
          + "  whole% floor%  spin% fspin%")
    runs = [(s, t, p) for s in a.shapes.split(",") if s for t in a.event_timing.split(",")
            for p in a.native_poll.split(",")]
    for shape_name, timing, native_poll in runs:
        # ~notime: NPU_OFFLOAD_EVENT_TIMING=0; ~npoll: NPU_OFFLOAD_NATIVE_POLL=1
        name = shape_name + ("" if timing == "1" else "~notime") + ("~npoll" if native_poll == "1" else "")
        os.environ["NPU_OFFLOAD_EVENT_TIMING"] = timing
        os.environ["NPU_OFFLOAD_NATIVE_POLL"] = native_poll
        rig = CoreRig(platform, shape_named(shape_name))  # "shape@N": N device blocks per transfer
        if a.engine_order and rig.core.stager is not None:
            rig.core.stager.orders_natively = False
        res["shapes"][name] = {}
        for d in Direction:
            r = split_one(rig, d, a.reps, lib)
            res["shapes"][name][d.name] = r
            print(f"{name:26s} {d.name:3s} {r['bytes'] / 2**20:5.1f} {r['slices']:2d} "
                  + " ".join(f"{r[k]:9.1f}" for k in PARTS + SPIN_PARTS)
                  + f"  {100 * r['ref'] / r['whole']:5.1f} {100 * r['ref'] / r['floor']:6.1f}"
                  + f"  {100 * r['ref_spin'] / r['spin']:5.1f} {100 * r['ref_spin'] / r['floor_spin']:6.1f}")
            if a.cpu_time:
                c = r["cpu"] = cpu_one(rig, d, a.reps)
                print(f"{'':26s} {d.name:3s} wall / thread CPU us: plan {c['plan']:.1f} / {c['plan_cpu']:.1f}, "
                      f"submit {c['submit']:.1f} / {c['submit_cpu']:.1f}, finish {c['finish']:.1f} / "
                      f"{c['finish_cpu']:.1f}")
        rig.close()
    res["driver_calls_us"] = driver_calls(platform, lib, a.reps)
    print("driver calls, CPU us each (stream held): "
          + ", ".join(f"{k} {v:.1f}" for k, v in res["driver_calls_us"].items()))
    if a.detail:
        det = res["detail"] = detail(platform, lib, a.detail, a.reps)
        print(f"{a.detail} H2D host pieces, CPU us each: "
              + ", ".join(f"{k} {v:.1f}" for k, v in det.items() if not k.startswith("profile")))
        print(det["profile"])
        print(det["profile_poll"])
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
