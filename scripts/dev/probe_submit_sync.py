#!/usr/bin/env python3
"""Does a transfer's submit wait for the model's stream? (a GPU, no vLLM)

vLLM calls submit on its engine thread between steps while the step's kernels still run: a
submit that synchronizes with the device (explicitly, or implicitly: a page-locked host or device
allocation, a free) stalls the engine thread for the rest of the step. For each round this
sleeps the current stream (``--sleep-ms``), submits a store or a load of a worker core, and reports
how long submit took and whether the busy stream was through when it returned; rounds whose submit
took longer than ``--slow-ms`` are profiled (the top entries by cumulative time). Shapes: the GPU
test's (4 tensors of 4 KiB pages, tiny slots: many slices) and a per-layer 8B one (64 tensors of
32 KiB pages). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from vllm_npu_offload import staging  # noqa: E402
from vllm_npu_offload.copy.base import Direction  # noqa: E402
from vllm_npu_offload.device_kv import DeviceKVTensor, GroupRef  # noqa: E402
from vllm_npu_offload.offload_worker import OffloadWorkerCore  # noqa: E402
from vllm_npu_offload.platform import get_platform  # noqa: E402

SHAPES = {  # name: (tensors, page bytes, device blocks, host chunks, blocks per transfer, tiny slots)
    "test": (4, 4096, 48, 40, 12, True),
    "perlayer-8b": (64, 32768, 256, 512, 16, False),
}


def _cycles_per_ms() -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    torch.cuda._sleep(100_000_000)
    torch.cuda.synchronize()
    return 100_000_000 / ((time.perf_counter() - t) * 1e3)


def run_shape(name: str, rounds: int, sleep_ms: float, slow_ms: float, cycles: float) -> list[dict]:
    n_t, page, dev_blocks, chunks, n, tiny = SHAPES[name]
    saved = staging.MIN_SLOT_BYTES, staging.MIN_SLICE_BYTES
    if tiny:
        staging.MIN_SLOT_BYTES = staging.MIN_SLICE_BYTES = 0
    try:
        tensors = [torch.zeros((dev_blocks, page), dtype=torch.uint8, device="cuda") for _ in range(n_t)]
        core = OffloadWorkerCore([DeviceKVTensor.from_block_view(t) for t in tensors],
                                 [[GroupRef(i, page) for i in range(n_t)]], 1, chunks, get_platform("cuda"))
    finally:
        staging.MIN_SLOT_BYTES, staging.MIN_SLICE_BYTES = saved
    rng = np.random.default_rng(0)
    rows, job = [], 0
    for r in range(rounds):
        for d in (Direction.D2H, Direction.H2D):
            dev_ids = rng.choice(dev_blocks, n, replace=False).astype(np.int64)
            host = rng.choice(chunks, n, replace=False).astype(np.int64)
            job += 1
            torch.cuda.synchronize()
            busy = torch.cuda.current_stream()
            torch.cuda._sleep(int(sleep_ms * cycles))
            prof = cProfile.Profile()
            t0 = time.perf_counter()
            prof.enable()
            core.submit(job, d, dev_ids, [n], [0], host, staged=True)
            prof.disable()
            ms = (time.perf_counter() - t0) * 1e3
            row = {"shape": name, "round": r, "dir": d.name, "submit_ms": round(ms, 3), "busy_done": bool(busy.query())}
            if ms > slow_ms:
                out = io.StringIO()
                pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(14)
                row["profile"] = out.getvalue()
            rows.append(row)
            core.wait([job])
            res = core.poll()
            assert [x.job_id for x in res] == [job] and res[0].success, res
    core.shutdown()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="test,perlayer-8b", help=f"comma-separated of {sorted(SHAPES)}")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sleep-ms", type=float, default=200.0)
    ap.add_argument("--slow-ms", type=float, default=20.0)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    os.environ.setdefault("NPU_OFFLOAD_STAGED", "1")
    os.environ.setdefault("NPU_OFFLOAD_CALIBRATE", "0")
    cycles = _cycles_per_ms()
    rows = []
    for name in a.shapes.split(","):
        rows += run_shape(name, a.rounds, a.sleep_ms, a.slow_ms, cycles)
    print(f"device: {torch.cuda.get_device_name()}; busy stream {a.sleep_ms:.0f} ms before each submit")
    print(f"{'shape':<12} {'round':>5} {'dir':<4} {'submit ms':>10} {'busy stream done':>17}")
    for row in rows:
        print(f"{row['shape']:<12} {row['round']:>5} {row['dir']:<4} {row['submit_ms']:>10.3f} {str(row['busy_done']):>17}")
    for row in rows:
        if "profile" in row:
            print(f"\n--- {row['shape']} round {row['round']} {row['dir']}: {row['submit_ms']:.1f} ms\n{row['profile']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "sleep_ms": a.sleep_ms, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
