#!/usr/bin/env python3
"""Direct (per-page) copies between device pages and host split over several streams at once (CUDA).

Why: on CUDA, stores of KV whose pages are >= 32 KiB go direct (one ``cuMemcpyBatchAsync`` of every
page, on the copy engines: no SM beside the model; docs/benchmarks.md, sixth session), and a whole
direct store of 32 KiB pages reached only 37-54% of one contiguous copy on an H200 (twentieth session),
where a staged one (a gather kernel, then few large link copies) reaches 90-95% but costs the model's
decode steps. If one batch is bound by a per-copy cost of one copy engine, the same pages split over
several streams run on several engines. This probe times, per page size and direction, ``k`` streams
each taking a contiguous share of the pages (``k`` = 1 is today's direct path), all released by one
event and joined by another, against one contiguous copy of the same bytes (device time, CUDA events;
median of ``--reps``), and checks the bytes. No vLLM; our library's batch entry (``lib.copy``).

    python3 scripts/dev/probe_direct_streams.py --pages-kib 16,32,64,256 --mib 16,64 --streams 1,2,4,8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages-kib", default="16,32,64,256")
    ap.add_argument("--mib", default="16,64", help="bytes per transfer")
    ap.add_argument("--streams", default="1,2,4,8")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--any-order", action="store_true", help="CU_MEMCPY_SRC_ACCESS_ORDER_ANY (default: STREAM)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from vllm_npu_offload._native.cuda import load_library

    lib = load_library()
    total_max = max(ints(a.mib)) << 20
    dev = torch.empty(2 * total_max, dtype=torch.uint8, device="cuda")  # pages drawn from twice the bytes
    dev.random_(0, 255)
    host = torch.empty(total_max, dtype=torch.uint8)  # registered, as the offload host KV is
    rc = torch.cuda.cudart().cudaHostRegister(host.data_ptr(), host.numel(), 0)
    if int(rc) != 0:
        raise SystemExit(f"cudaHostRegister: {rc}")
    streams = [torch.cuda.ExternalStream(lib.create_stream(0)) for _ in range(max(ints(a.streams)))]
    root = streams[0]
    rows = []
    print(f"{torch.cuda.get_device_name()}: device pages (random order) <-> consecutive registered host; "
          f"device time (events), median of {a.reps}; {'any' if a.any_order else 'stream'} source order")
    ks = ints(a.streams)
    print(f"{'page':>8s} {'MiB':>4s} {'dir':3s} {'ref GB/s':>9s} " + " ".join(f"{f'k={k} %':>8s}" for k in ks) + "  bytes")
    for page_kib in ints(a.pages_kib):
        page = page_kib << 10
        for mib in ints(a.mib):
            n = (mib << 20) // page
            rng = np.random.default_rng(page_kib * 1000 + mib)
            dev_addr = (dev.data_ptr() + rng.choice(2 * n, n, replace=False).astype(np.uint64) * page).astype(np.uint64)
            host_addr = (host.data_ptr() + np.arange(n, dtype=np.uint64) * page).astype(np.uint64)
            sizes = np.full(n, page, np.uint64)
            for load in (False, True):
                src, dst = (host_addr, dev_addr) if load else (dev_addr, host_addr)
                ref_dev, ref_host = dev[: n * page], host[: n * page]
                row = {"page": page, "bytes": n * page, "dir": "H2D" if load else "D2H", "k": {}}

                def timed(fn) -> float:
                    out = []
                    for _ in range(a.reps + 2):
                        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        torch.cuda.synchronize()
                        start.record(root)
                        fn(start)
                        end.record(root)
                        end.synchronize()
                        out.append(start.elapsed_time(end) * 1e-3)
                    return statistics.median(out[2:])

                def ref(start) -> None:
                    with torch.cuda.stream(root):
                        if load:
                            ref_dev.copy_(ref_host, non_blocking=True)
                        else:
                            ref_host.copy_(ref_dev, non_blocking=True)

                ref_s = timed(ref)
                row["ref_gbps"] = n * page / ref_s / 1e9
                ok = True
                for k in ks:
                    edges = np.linspace(0, n, k + 1).astype(np.int64)

                    def split(start, k=k, edges=edges) -> None:
                        joins = []
                        for i in range(k):
                            s = streams[i]
                            if i:
                                s.wait_event(start)
                            lo, hi = edges[i], edges[i + 1]
                            lib.copy(src[lo:hi], dst[lo:hi], sizes[lo:hi], int(s.cuda_stream), True,
                                     src_order_any=a.any_order)
                            if i:
                                ev = torch.cuda.Event()
                                ev.record(s)
                                joins.append(ev)
                        for ev in joins:
                            root.wait_event(ev)

                    if not load:
                        host.zero_()
                    t = timed(split)
                    row["k"][k] = 100 * ref_s / t
                    if not load:  # every page where it belongs (stores: the host copy of each device page)
                        idx = torch.from_numpy(((dev_addr - dev.data_ptr()) // page).astype(np.int64)).cuda()
                        ok &= bool(torch.equal(host[: n * page].view(n, page),
                                               dev.view(-1, page)[idx].cpu()))
                row["bytes_ok"] = ok
                rows.append(row)
                print(f"{page_kib:6d}Ki {mib:4d} {row['dir']:3s} {row['ref_gbps']:9.1f} "
                      + " ".join(f"{row['k'][k]:8.1f}" for k in ks) + f"  {'ok' if ok else 'WRONG'}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "any_order": a.any_order, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
