#!/usr/bin/env python3
"""Device timeline of one staged transfer against one contiguous copy (CUDA; a probe, not a test).

Why: a staged transfer of small pages spends a fixed ~18 us of device time over one contiguous
copy of the same bytes (docs/benchmarks.md), and the parts of that cost were so far inferred
from separate probes. This records the device activities themselves (CUPTI, through
torch.profiler): every kernel and copy of the transfer with its start and length, the gaps
between them, and the contiguous copy of the same bytes, the stream held busy while the CPU
enqueues (so CPU time makes no gaps). Prints a table per shape and direction; --json.

  python3 scripts/dev/probe_staged_timeline.py [--shapes qwen2.5-0.5b-fp8,tiny-1k] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def device_ops(prof) -> list[dict]:
    """Kernels and copies the profiler saw on the device, in start order (us), without the hold
    kernel (``_sleep``'s spin)."""
    ops = []
    for e in prof.events():
        dt = getattr(e, "device_type", None)
        if dt is None or "CUDA" not in str(dt):
            continue
        name = e.name
        if "spin" in name.lower() or "sleep" in name.lower():
            continue
        start = e.time_range.start
        ops.append({"name": name[:60], "start_us": float(start), "us": float(e.time_range.end - start)})
    ops.sort(key=lambda o: o["start_us"])
    return ops


def one_rep(torch, platform, fn, stream) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        platform.hold(stream, 2e-3)
        fn()
        stream.synchronize()
    ops = device_ops(prof)
    if ops:
        t0 = ops[0]["start_us"]
        prev_end = t0
        for o in ops:
            o["at_us"] = o["start_us"] - t0
            o["gap_us"] = o["start_us"] - prev_end
            prev_end = max(prev_end, o["start_us"] + o["us"])
            del o["start_us"]
    return ops


def span(ops: list[dict]) -> float:
    return max((o["at_us"] + o["us"] for o in ops), default=0.0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen2.5-0.5b-fp8,tiny-1k,qwen2.5-0.5b")
    ap.add_argument("--reps", type=int, default=5, help="profiled reps per case (the median-span one is printed)")
    ap.add_argument("--host", default="random", choices=("random", "seq"))
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)

    import torch

    from benchmarks.core_bench import CoreRig, shape_named
    from benchmarks.transfer import contiguous_copy_fn
    from vllm_npu_offload.copy.base import Direction
    from vllm_npu_offload.platform import get_platform

    platform = get_platform()
    if platform.kind != "cuda":
        print("this probe needs CUDA", file=sys.stderr)
        return 2
    out = []
    for name in a.shapes.split(","):
        shape = shape_named(name)  # NAME@N: N blocks per transfer
        rig = CoreRig(platform, shape)
        nbytes = shape.blocks * sum(shape.pages)
        host_t = rig.core.host.tensor[:nbytes]
        dev_t = torch.empty(nbytes, dtype=torch.uint8, device=platform.device)
        stream = platform.new_stream()
        dev, chunks = rig.ids(a.host, seed=7)
        for d in Direction:
            cases = {"contiguous": contiguous_copy_fn(platform, dev_t, host_t, d, stream)}
            fn, planned = rig.executor(d, dev, chunks, True, stream)
            cases["staged"] = fn
            for _ in range(3):  # warm-up: module load, id buffers, events
                for f in cases.values():
                    f()
                stream.synchronize()
            res = {"shape": name, "dir": d.name, "bytes": nbytes}
            for label, f in cases.items():
                reps = [one_rep(torch, platform, f, stream) for _ in range(a.reps)]
                reps.sort(key=span)
                mid = reps[len(reps) // 2]
                res[label] = {"span_us": [span(r) for r in reps], "ops": mid}
            rig.core.pool.release(planned.buffers)
            ref, st = statistics.median(res["contiguous"]["span_us"]), statistics.median(res["staged"]["span_us"])
            res["extra_us"] = st - ref
            out.append(res)
            print(f"\n== {name} {d.name}: {nbytes / 2**20:.1f} MiB; contiguous {ref:.1f} us, staged {st:.1f} us "
                  f"(+{st - ref:.1f} us, {100 * ref / st:.1f}%); median-span rep of {a.reps}:")
            for o in res["staged"]["ops"]:
                print(f"  at {o['at_us']:8.1f}  {o['us']:8.1f} us  gap {o['gap_us']:6.1f}  {o['name']}")
        rig.close()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
