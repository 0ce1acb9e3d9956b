#!/usr/bin/env python3
"""Device time of the staged gather (SM copy kernel, 16 programs) over tile sizes and warps,
for a few KV shapes: how fast the device-local half of a staged store can go on this GPU.
CUDA only. Prints one line per shape with the best variants."""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from benchmarks.core_bench import SHAPES, CoreRig  # noqa: E402
from vllm_npu_offload.copy.base import DescriptorRange, Direction  # noqa: E402
from vllm_npu_offload.copy.sm_triton import SmCopyPath  # noqa: E402
from vllm_npu_offload.platform import get_platform  # noqa: E402


def main() -> None:
    p = get_platform("cuda")
    for name in ("qwen2.5-0.5b", "qwen2.5-0.5b-fp8", "llama-8b", "mla-ascend-split"):
        rig = CoreRig(p, SHAPES[name])
        core = rig.core
        dev, chunks = rig.ids("random", 1)
        plan = core.plan(Direction.D2H, dev, [len(dev)], [0], chunks, staged=True).plan
        n, nbytes = len(plan.local), plan.local.total_bytes
        s, ev0, ev1 = p.new_stream(), p.new_event(), p.new_event()
        out = []
        for tile in (32768, 65536, 131072, 262144):
            for warps in (4, 8, 16):
                path = SmCopyPath(p, SHAPES[name].pages, programs=16, tile_bytes=tile, num_warps=warps)
                with p.stream_context(s):
                    prep = path.prepare(plan.local)
                    ts = []
                    for _ in range(8):
                        ev0.record(s)
                        path.copy_range(prep, DescriptorRange(0, n), Direction.D2H, s)
                        ev1.record(s)
                        s.synchronize()
                        ts.append(ev0.elapsed_time(ev1) * 1e3)
                out.append((float(np.median(ts[2:])), tile, warps))
        out.sort()
        print(f"{name} {n} desc {nbytes / 2**20:.0f} MiB: " + "; ".join(
            f"tile {t // 1024}K w{w}: {us:.0f} us {nbytes / us / 1e3:.0f} GB/s" for us, t, w in out[:6]), flush=True)
        core.pool.release(plan.buffers)
        rig.close()


if __name__ == "__main__":
    main()
