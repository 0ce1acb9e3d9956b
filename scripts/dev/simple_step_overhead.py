"""Per-step host overhead of the simple-offload worker with many events in flight.

A step = bind (one load event with 2 requests, one store event) + launch load + launch
store + get_finished twice + take load errors + take store results, while N events
stay in flight (one old event completes per step, so N is steady). The transport is
a no-op (measures the worker's bookkeeping only) or, for the last row, the real
CoreTransport on the CPU platform (descriptors, engine submit, memmove thread).

Usage: PYTHONPATH=. python scripts/dev/simple_step_overhead.py [--steps 2000]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import deque


from vllm_npu_offload.copy.base import Direction  # noqa: E402
from vllm_npu_offload.simple_core import SimpleOffloadCore, StepPlan  # noqa: E402


class NullTransport:
    def __init__(self):
        self.outstanding = deque()
        self.ready = []

    def launch(self, d, ev, src, dst):
        self.outstanding.append((d, ev))

    def finish_oldest(self, core):
        from vllm_npu_offload.simple_core import Completion

        d, ev = self.outstanding.popleft()
        self.ready.append(Completion(d, ev, True))

    def poll(self):
        ready, self.ready = self.ready, []
        return ready

    def flush(self):
        return self.poll()

    def shutdown(self):
        pass


def plan(i, blocks=16):
    ids = list(range(blocks))
    return StepPlan(load_event=i, load_host_blocks=ids, load_device_blocks=ids,
                    load_event_to_reqs={i: [f"a{i}", f"b{i}"]},
                    store_event=i, store_device_blocks=ids, store_host_blocks=ids)


def step(core, i):
    core.bind(plan(i))
    core.launch(Direction.H2D)
    core.launch(Direction.D2H)
    core.collect()
    core.collect()
    core.take_load_errors()
    core.take_store_results()


def bench_null(in_flight: int, steps: int) -> float:
    t = NullTransport()
    core = SimpleOffloadCore(t)
    half = in_flight // 2  # loads + stores
    for i in range(half):
        step(core, i)
    assert sum(core.in_flight()) == 2 * half
    t0 = time.perf_counter()
    for i in range(half, half + steps):
        step(core, i)
        t.finish_oldest(core)
        t.finish_oldest(core)
    dt = (time.perf_counter() - t0) / steps
    assert sum(core.in_flight()) == 2 * half + 2  # the last two completions are not collected yet
    return dt


def bench_engine(steps: int) -> float:
    import torch

    from vllm_npu_offload.platform import get_platform
    from vllm_npu_offload.device_kv import tensor_segments
    from vllm_npu_offload.simple_core import CoreTransport

    kv = torch.zeros(2, 64, 32, 2, 32)  # 2 x 64 blocks x 8 KiB pages
    tr = CoreTransport.from_segments(tensor_segments(kv, 64), 64, get_platform("cpu"))
    core = SimpleOffloadCore(tr)
    t0 = time.perf_counter()
    for i in range(steps):
        step(core, i)
        if i % 8 == 7:
            tr.engine.drain()  # transfers finish within a few steps, as on a device
    dt = (time.perf_counter() - t0) / steps
    core.shutdown()
    return dt


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=2000)
    a = p.parse_args(argv)
    print(f"{'transport':<22} {'in flight':>9} {'us / step':>10}")
    print("-" * 43)
    for n in (0, 100, 1000, 5000):
        us = min(bench_null(n, a.steps) for _ in range(3)) * 1e6
        print(f"{'none (bookkeeping)':<22} {n:>9} {us:>10.1f}")
    us = bench_engine(min(a.steps, 400)) * 1e6
    print(f"{'CoreTransport, cpu':<22} {'<=16':>9} {us:>10.1f}   (16 blocks x 2 segments each way, real memmove)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
