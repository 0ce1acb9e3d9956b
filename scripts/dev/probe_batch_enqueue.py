#!/usr/bin/env python3
"""How long the host blocks enqueuing many small stream-ordered device->host copies (CUDA).

Why: in the GPU e2e miss rounds, direct stores (one cuMemcpyBatchAsync of ~8,000 32 KiB pages per
job, the engine thread) held vLLM's engine thread 2.7 s per round, while vLLM's native
offload, enqueuing the same pages with the same driver call from C++, took 0.28 s
(docs/benchmarks.md, sixth session). This probe times only the enqueue, with the copy stream
queued behind a long kernel (as a store waits for the forward it follows), for: our library's
batch and loop paths, and the driver's cuMemcpyBatchAsync resolved directly, by ABI (12.8's v1
with failIdx, 13.0's v2) and cuGetProcAddress flag (default or legacy stream), the way vLLM
resolves it (v1, default flag). Prints a table; ``--json`` writes it.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

PAGE = 32 * 1024


class MemcpyAttributes(ctypes.Structure):
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocType", ctypes.c_int), ("srcLocId", ctypes.c_int),
                ("dstLocType", ctypes.c_int), ("dstLocId", ctypes.c_int), ("flags", ctypes.c_uint)]


def driver_batch(version: int, flag: int):
    """cuMemcpyBatchAsync of the given ABI (12080: v1 with failIdx, 13000: v2) via cuGetProcAddress_v2."""
    cuda = ctypes.CDLL("libcuda.so.1")
    fn, status = ctypes.c_void_p(), ctypes.c_int()
    rc = cuda.cuGetProcAddress_v2(b"cuMemcpyBatchAsync", ctypes.byref(fn), version, ctypes.c_uint64(flag),
                                  ctypes.byref(status))
    if rc != 0 or not fn.value:
        raise RuntimeError(f"cuGetProcAddress_v2(cuMemcpyBatchAsync, {version}, flag {flag}): rc={rc}")
    p = ctypes.c_void_p
    if version < 13000:
        proto = ctypes.CFUNCTYPE(ctypes.c_int, p, p, p, ctypes.c_size_t, p, p, ctypes.c_size_t, p, p)
    else:
        proto = ctypes.CFUNCTYPE(ctypes.c_int, p, p, p, ctypes.c_size_t, p, p, ctypes.c_size_t, p)
    f = proto(fn.value)
    attr = MemcpyAttributes(srcAccessOrder=1)  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
    idx, fail = ctypes.c_size_t(0), ctypes.c_size_t(0)

    def call(src, dst, sizes, stream: int) -> None:
        args = [dst.ctypes.data, src.ctypes.data, sizes.ctypes.data, len(sizes), ctypes.addressof(attr),
                ctypes.addressof(idx), 1]
        rc = f(*args, ctypes.addressof(fail), stream) if version < 13000 else f(*args, stream)
        if rc != 0:
            raise RuntimeError(f"cuMemcpyBatchAsync ({version}): rc={rc}")
    return call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--pages", type=int, default=8000, help="descriptors per enqueue (a 125-block job: 8,000)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--block-ms", type=float, default=50.0, help="the kernel the copies queue behind (0: none)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="jobs enqueued back to back (each --pages copies): one prefill step stores ~8")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    import numpy as np

    from vllm_npu_offload._native.cuda import load_library

    lib = load_library()
    n = a.pages
    dev = torch.empty(n * PAGE, dtype=torch.uint8, device="cuda")
    dev.random_(0, 255)
    host = torch.empty(n * PAGE, dtype=torch.uint8)  # registered, as the offload host KV is
    torch.cuda.cudart().cudaHostRegister(host.data_ptr(), host.numel(), 0)
    rng = np.random.default_rng(0)
    src = (dev.data_ptr() + rng.permutation(n).astype(np.uint64) * PAGE).astype(np.uint64)
    dst = (host.data_ptr() + np.arange(n, dtype=np.uint64) * PAGE).astype(np.uint64)
    sizes = np.full(n, PAGE, np.uint64)
    stream = torch.cuda.ExternalStream(lib.create_stream(0))
    handle = int(stream.cuda_stream)
    # one stream per job, each after the previous job's end (as vLLM's native handler chains them)
    pool = [torch.cuda.ExternalStream(lib.create_stream(0)) for _ in range(a.jobs)]
    ends = [torch.cuda.Event() for _ in range(a.jobs)]
    # torch.cuda._sleep spins this many SM clock cycles (~1.98 GHz on an H100/H200 at its boost clock)
    cycles = int(a.block_ms * 1e-3 * 1.98e9) if a.block_ms else 0
    batch = lambda h: lib.copy(src, dst, sizes, h, True, src_order_any=False)  # noqa: E731

    def jobs_on(streams: list, call) -> None:
        for j in range(a.jobs):
            s = streams[j % len(streams)]
            if len(streams) > 1 and j:
                s.wait_event(ends[j - 1])
            call(int(s.cuda_stream))
            if len(streams) > 1:
                ends[j].record(s)

    if a.jobs > 1:  # the same batches, all on one stream or one stream per job
        ways = {"ours batch, 1 stream": lambda: jobs_on([stream], batch),
                f"ours batch, {a.jobs} streams": lambda: jobs_on(pool, batch)}
    else:  # one batch: our library's paths against the driver's entry points
        ways = {"ours batch": lambda: batch(handle),
                "ours loop": lambda: lib.copy(src, dst, sizes, handle, False, src_order_any=False)}
        for ver, flag, name in ((12080, 0, "v1 default"), (12080, 1, "v1 legacy"), (13000, 0, "v2 default"),
                                (13000, 1, "v2 legacy")):
            try:
                call = driver_batch(ver, flag)
                ways[f"driver {name}"] = (lambda c=call: c(src, dst, sizes, handle))
            except RuntimeError as e:
                print(e)
    rows = []
    for name, fn in ways.items():
        enq, tot = [], []
        for _ in range(a.reps):
            host.zero_()
            torch.cuda.synchronize()
            with torch.cuda.stream(stream):
                if cycles:
                    torch.cuda._sleep(cycles)
            for s in pool:
                s.wait_stream(stream)  # every job stream behind the kernel too
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            enq.append((t1 - t0) * 1e3)
            tot.append((t2 - t0) * 1e3)
        ok = bool(torch.equal(host.view(n, PAGE)[:64], dev.view(n, PAGE)[torch.from_numpy(
            ((src[:64] - dev.data_ptr()) // PAGE).astype(np.int64)).cuda()].cpu()))
        rows.append({"way": name, "enqueue_ms": statistics.median(enq), "total_ms": statistics.median(tot),
                     "us_per_page": statistics.median(enq) * 1e3 / (n * a.jobs), "bytes_ok": ok})
    print(f"{torch.cuda.get_device_name()}: {a.jobs} x {n} D2H copies of {PAGE // 1024} KiB (device pages in random order -> "
          f"registered host), stream order, queued behind a {a.block_ms:g} ms kernel; medians of {a.reps}")
    print(f"| way | enqueue ms | us per page | enqueue + copies ms | bytes |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['way']} | {r['enqueue_ms']:.2f} | {r['us_per_page']:.2f} | {r['total_ms']:.2f} | "
              f"{'ok' if r['bytes_ok'] else 'WRONG'} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"pages": n, "jobs": a.jobs, "block_ms": a.block_ms, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
