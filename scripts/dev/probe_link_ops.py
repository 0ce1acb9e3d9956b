#!/usr/bin/env python3
"""Device cost of the link operations a staged transfer is made of (CUDA; a probe, not a test).

A staged transfer spends a fixed 15-45 us of device time more than one contiguous copy of the
same bytes, whatever its size (docs/benchmarks.md). This splits that cost: one copy through
cudaMemcpyAsync (torch), through our library's cuMemcpyBatchAsync and its cuMemcpyAsync loop,
the same bytes as K back-to-back copies, and a cross-stream event hop before a copy. Every
row is device time with the stream held busy while the CPU enqueues. Prints a table; --json.

  python3 scripts/dev/probe_link_ops.py [--sizes 512K,4M,32M] [--reps 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def _size(s: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(s[:-1]) * mult[s[-1]]) if s[-1] in mult else int(s)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="512K,4M,32M")
    ap.add_argument("--pieces", type=int, default=3, help="K: back-to-back copies of the same bytes")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)

    import torch

    from benchmarks.core_bench import device_only_seconds
    from vllm_npu_offload._native.cuda import load_library
    from vllm_npu_offload.platform import get_platform

    if not torch.cuda.is_available():
        print("no CUDA device: nothing to probe")
        return 0
    plat = get_platform()
    lib = load_library()
    stream, aux = plat.new_stream(), plat.new_stream()
    sh, ah = stream.cuda_stream, aux.cuda_stream
    sizes = [_size(s) for s in a.sizes.split(",")]
    top = max(sizes)
    host = torch.empty(top, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(top, dtype=torch.uint8, device="cuda")
    host.random_(0, 255)
    rows = []
    for d in ("H2D", "D2H"):
        for n in sizes:
            hp, dp = host.data_ptr(), dev.data_ptr()
            src, dst = (hp, dp) if d == "H2D" else (dp, hp)
            k = a.pieces
            cuts = np.linspace(0, n, k + 1).astype(np.int64)
            ksrc, kdst, ksz = src + cuts[:-1], dst + cuts[:-1], np.diff(cuts)
            one = (np.array([src]), np.array([dst]), np.array([n]))
            h_, d_ = host[:n], dev[:n]
            e1, e2 = torch.cuda.Event(), torch.cuda.Event()

            def torch_copy():
                with torch.cuda.stream(stream):
                    (d_.copy_(h_, non_blocking=True) if d == "H2D" else h_.copy_(d_, non_blocking=True))

            def hop_then_batch():  # stream -> aux -> stream, then the copy: two event hops
                e1.record(stream)
                aux.wait_event(e1)
                e2.record(aux)
                stream.wait_event(e2)
                lib.copy(*one, sh, batch=True, src_order_any=d == "H2D")

            cases = {
                "cudaMemcpyAsync (torch), 1 copy": torch_copy,
                "cuMemcpyBatchAsync, 1 descriptor": lambda: lib.copy(*one, sh, batch=True, src_order_any=d == "H2D"),
                "cuMemcpyAsync loop, 1 copy": lambda: lib.copy(*one, sh, batch=False),
                f"cuMemcpyBatchAsync, {k} calls of 1": lambda: [
                    lib.copy(ksrc[i:i + 1], kdst[i:i + 1], ksz[i:i + 1], sh, batch=True, src_order_any=d == "H2D")
                    for i in range(k)],
                f"cuMemcpyBatchAsync, 1 call of {k}": lambda: lib.copy(ksrc, kdst, ksz, sh, batch=True,
                                                                       src_order_any=d == "H2D"),
                f"cuMemcpyAsync loop, {k} copies": lambda: lib.copy(ksrc, kdst, ksz, sh, batch=False),
                "2 event hops + batch, 1 descriptor": hop_then_batch,
            }
            base = None
            for name, fn in cases.items():
                dev_s, cpu_s = device_only_seconds(plat, fn, stream, a.reps)
                base = dev_s if base is None else base
                rows.append({"dir": d, "bytes": n, "case": name, "device_us": dev_s * 1e6, "enqueue_us": cpu_s * 1e6,
                             "gbps": n / dev_s / 1e9, "extra_us": (dev_s - base) * 1e6})
    print(f"device: {torch.cuda.get_device_name()}; device time, stream held while enqueueing; median of {a.reps}")
    print(f"| dir | bytes | case | device us | vs torch copy us | GB/s | enqueue us |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['dir']} | {r['bytes'] >> 10} KiB | {r['case']} | {r['device_us']:.1f} | {r['extra_us']:+.1f} | "
              f"{r['gbps']:.1f} | {r['enqueue_us']:.1f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "reps": a.reps, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
