#!/usr/bin/env python3
"""What each piece of a staged transfer's front end costs where it really runs (issue #22), on a GPU.

``probe_whole_split.py`` times the front end whole: the Python before the native call (~14 us on an
H200 host) and the poll that reports the transfer (~10 us), several times what the same code takes
in a loop. The difference is the state the host is in: a transfer's driver calls, its DMA and the
wait for it leave the caches (and the driver's own state) cold. This probe times one piece at a time
in that state: before each timed piece it runs a real transfer (submit, the end event's synchronize,
the poll), then times the piece alone, once. Pieces take turns, so a slow period of the host touches
every piece alike. Prints the median (and p25-p75) us of each piece, cold and hot (the same piece
again at once), and writes JSON.

Poll side (timed right after the synchronize of a transfer not yet reported, as the reporting poll
is): ``noop`` (an empty Python call), ``perf_counter``, ``lock``, ``query`` (torch's query of the end
event), ``elapsed`` (its elapsed_time), ``native_poll`` (both in one library call, ``lib.event_poll``),
``native_raw`` (that call's C function with its arguments made beforehand: the driver's part), ``poll``
(the whole reporting poll). Submit side (timed right
after a reporting poll, where the next submit starts): ``ascontig`` (the two id arrays as int64),
``addresses`` (their addresses, as the request takes them), ``fields`` (nine fields of the request set),
``acquire`` (a pooled room and back), ``raw_current`` (torch's current raw stream), ``raw_order``
(the engine's events as driver handles), ``request`` (the pipeline's request for a planned
transfer), ``submit_pre`` (``OffloadWorkerCore.submit`` until its native call starts).

    python3 scripts/dev/probe_cold_pieces.py --shape qwen2.5-0.5b-fp8@172 --reps 60 --json out.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import threading
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from benchmarks.core_bench import CoreRig, shape_named  # noqa: E402
from vllm_npu_offload.copy.base import Direction  # noqa: E402
from vllm_npu_offload.platform import get_platform  # noqa: E402

POLL_SIDE = ("noop", "perf_counter", "lock", "query", "elapsed", "native_poll", "native_raw", "poll")
SUBMIT_SIDE = ("ascontig", "addresses", "fields", "acquire", "raw_current", "raw_order", "request", "submit_pre")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen2.5-0.5b-fp8@172")
    ap.add_argument("--direction", default="H2D", choices=[d.name for d in Direction])
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    platform = get_platform()
    rig = CoreRig(platform, shape_named(a.shape))
    core, d = rig.core, Direction[a.direction]
    stager = core.stager
    if stager is None or not stager.orders_natively:
        raise SystemExit("the core's staged transfers are not natively ordered here: nothing to probe")
    lane = stager._fused._lane(stager, d)
    real_call = lane.call
    marks: list[float] = []

    def marked_call():
        marks.append(time.perf_counter())
        return real_call()

    lane.call = marked_call
    lock = threading.Lock()
    get_raw, get_dev = torch._C._cuda_getCurrentRawStream, torch._C._cuda_getDevice
    base = getattr(torch._C, "_CudaEventBase", None)
    query = base.query if base is not None else (lambda e: e.query())
    elapsed = base.elapsed_time if base is not None else (lambda s, e: s.elapsed_time(e))

    def noop():
        return None

    def lock_cycle():
        with lock:
            pass

    lib = stager._fused.lib
    raw_ev = platform.raw_event_handle
    ms = ctypes.c_float()
    ms_ref, msg = ctypes.byref(ms), ctypes.create_string_buffer(512)
    raw_poll = lib._lib.npo_cuda_event_poll
    addr, from_buffer = ctypes.addressof, ctypes.c_char.from_buffer
    req = lane.req

    def fields():
        req.compute, req.after, req.start, req.end = 1, 2, 3, 4
        req.job.stream, req.job.aux, req.n_groups, req.ids_capacity, req.slot_blocks = 5, 6, 1, 8, req.slot_blocks

    def transfer() -> tuple:
        """One real transfer submitted; its (start, end) events."""
        dev, chunks = rig.ids("seq", seed=rig._job)
        rig._job += 1
        core.submit(rig._job, d, dev, [len(dev)], [0], chunks, staged=True)
        item = core.engine._queues[d][-1]
        return item.start, item.end

    def settle(start, end) -> None:
        end.synchronize()
        res = core.poll()
        if len(res) != 1 or not res[0].success:
            raise RuntimeError(f"transfer failed: {res}")

    cold: dict[str, list[float]] = {k: [] for k in POLL_SIDE + SUBMIT_SIDE}
    hot: dict[str, list[float]] = {k: [] for k in POLL_SIDE + SUBMIT_SIDE}
    for _ in range(5):  # warm-up: lanes, rooms, events, the slice layouts
        settle(*transfer())
    pc = time.perf_counter
    for rep in range(a.reps):
        for name in POLL_SIDE:
            start, end = transfer()
            end.synchronize()
            rs, re_ = raw_ev(start), raw_ev(end)
            fn = {"noop": noop, "perf_counter": pc, "lock": lock_cycle, "query": lambda: query(end),
                  "elapsed": lambda: elapsed(start, end), "native_poll": lambda: lib.event_poll(rs, re_),
                  "native_raw": lambda: raw_poll(rs, re_, ms_ref, msg, 512), "poll": core.poll}[name]
            for store in (cold, hot):
                t = pc()
                out = fn()
                store[name].append(pc() - t)
                if name == "poll" and store is cold and len(out) != 1:
                    raise RuntimeError(f"the reporting poll reported {out}")
            if name != "poll":
                settle(start, end)
        for name in SUBMIT_SIDE:
            settle(*transfer())  # the state a submit starts in: right after a reporting poll
            dev, chunks = rig.ids("seq", seed=rep)
            if name == "submit_pre":  # cold, then a second submit at once (hot; before 2026-11-27 12:00 UTC
                # the second one also followed a reporting poll, so both columns were cold)
                for store in (cold, hot):
                    marks.clear()
                    rig._job += 1
                    t = pc()
                    core.submit(rig._job, d, dev, [len(dev)], [0], chunks, staged=True)
                    store[name].append(marks[0] - t)
                core.engine._queues[d][-1].end.synchronize()
                if len(core.poll()) != 2:
                    raise RuntimeError("the two submits were not reported")
                continue
            if name == "request":  # a planned transfer, then only its request timed
                tr = core.plan(d, dev, [len(dev)], [0], chunks, staged=True)
                hs = stager._fused._ordered[d]
                _, raw_s, raw_a = next(iter(hs.values()))
                fn = lambda: stager._fused.request(stager, tr, raw_s, raw_a)  # noqa: E731
            elif name == "raw_order":
                ev = core.engine._events
                s_ev, e_ev = (ev[-1], ev[-2]) if len(ev) >= 2 else (platform.new_event(), platform.new_event())
                fn = lambda: platform.raw_order(s_ev, e_ev, None)  # noqa: E731
            else:
                saved = (req.compute, req.after, req.start, req.end, req.job.stream, req.job.aux, req.n_groups,
                         req.ids_capacity)
                fn = {"ascontig": lambda: (np.ascontiguousarray(dev, dtype=np.int64),
                                           np.ascontiguousarray(chunks, dtype=np.int64)),
                      "addresses": lambda: (addr(from_buffer(dev)), addr(from_buffer(chunks))),
                      "fields": fields,
                      "acquire": lambda: core.pool.release([core.pool.acquire(64)]),
                      "raw_current": lambda: get_raw(get_dev())}[name]
            for store in (cold, hot):
                t = pc()
                fn()
                store[name].append(pc() - t)
            if name == "request":
                core.pool.release(tr.buffers)
            if name == "fields":
                (req.compute, req.after, req.start, req.end, req.job.stream, req.job.aux, req.n_groups,
                 req.ids_capacity) = saved
                lane.streams = (None, None)  # the next request writes its streams again
    lane.call = real_call
    res = {"device": platform.device_name(), "shape": a.shape, "direction": a.direction, "reps": a.reps,
           "cold": {}, "hot": {}}
    print(f"{platform.device_name()}, {a.shape} {a.direction}: us per piece, median (p25-p75) of {a.reps}")
    print(f"{'piece':14s} {'cold':>22s} {'hot':>22s}")
    for name in POLL_SIDE + SUBMIT_SIDE:
        row = []
        for label, store in (("cold", cold), ("hot", hot)):
            v = np.array(store[name]) * 1e6
            res[label][name] = {"median": float(np.median(v)), "p25": float(np.percentile(v, 25)),
                                "p75": float(np.percentile(v, 75))}
            row.append(f"{np.median(v):7.2f} ({np.percentile(v, 25):5.2f}-{np.percentile(v, 75):5.2f})")
        print(f"{name:14s} {row[0]:>22s} {row[1]:>22s}")
    rig.close()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
