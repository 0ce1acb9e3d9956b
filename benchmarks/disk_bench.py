"""The disk tier's reads and writes against the disk's own O_DIRECT rate, on one path.

Writes ``--gib`` of records of ``--record-mib`` through a rank's ``DiskTierServer`` (ordered by the
scheduler-side ``DiskTier``, as in serving), drops the page cache's copy, reads them all back
into a host buffer, then reads them again while as many new records are written (serving does
both at once: reads go first), and times the same bytes as one large O_DIRECT file written and
read sequentially (the disk's rate). Per record size and per I/O thread count. Prints a table and
writes JSON. No accelerator, no vLLM.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import uuid

import numpy as np

from vllm_npu_offload.tiers.channel import socket_path
from vllm_npu_offload.tiers.contract import Op, RecordIdentity
from vllm_npu_offload.tiers.disk_io import page_buffer
from vllm_npu_offload.tiers.disk_tier import DiskTier, DiskTierConfig
from vllm_npu_offload.tiers.disk_worker import IO_THREADS, DiskTierServer


def raw_rate(path: str, nbytes: int, block: int = 16 << 20) -> tuple[float, float]:
    """(read, write) bytes/s of one file written and read sequentially with O_DIRECT in ``block`` I/Os."""
    buf = page_buffer(block)
    buf[:] = os.urandom(4096) * (block // 4096)
    name = os.path.join(path, f"raw-{uuid.uuid4().hex}")
    flags = getattr(os, "O_DIRECT", 0)
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | flags, 0o600)
    t0 = time.perf_counter()
    for off in range(0, nbytes, block):
        os.pwrite(fd, buf, off)
    os.fsync(fd)
    t1 = time.perf_counter()
    os.close(fd)
    fd = os.open(name, os.O_RDONLY | flags)
    t2 = time.perf_counter()
    for off in range(0, nbytes, block):
        os.preadv(fd, [buf], off)
    t3 = time.perf_counter()
    os.close(fd)
    os.unlink(name)
    return nbytes / (t3 - t2), nbytes / (t1 - t0)


def _drop_cache(d) -> None:
    os.sync()
    for f in d.rglob("*.r0"):  # the next reads must come from the device
        fd = os.open(f, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def tier_rate(path: str, nbytes: int, record: int, threads: int) -> dict:
    n = max(1, nbytes // record)
    host = np.zeros(2 * n * record, dtype=np.uint8)
    host[:] = np.frombuffer(os.urandom(1 << 20), dtype=np.uint8).repeat(max(1, host.size >> 20))[: host.size]
    ident = RecordIdentity("bench", "bfloat16", (record,), (0,), record, 1, 1)
    engine = uuid.uuid4().hex
    srv = DiskTierServer(memoryview(host), ident, 0, path, socket_path(engine, path, 0), probe_bytes=record,
                         io_threads=threads)
    tier = DiskTier(DiskTierConfig(path, 4 * n * (record + 4096), 1, engine, tokens_per_key=64,
                                   read_timeout_s=3600, max_write_backlog_bytes=1 << 62))
    while not tier.up:
        tier.poll()
        time.sleep(0.001)

    ends: dict = {}

    def run(*orders) -> float:
        t0 = time.perf_counter()
        for i in range(n):
            for start, prefix, base in orders:
                start(f"{prefix}{i}".encode(), base + i)
        while tier.in_flight():
            for c in tier.poll():
                ends[c.op] = time.perf_counter() - t0
            time.sleep(0.0005)
        return time.perf_counter() - t0

    wt = run((tier.start_write, "k", 0))
    _drop_cache(tier.files.dir)
    rt = run((tier.start_read, "k", 0))
    ok = tier.stats.hits
    _drop_cache(tier.files.dir)
    ends.clear()
    run((tier.start_write, "m", n), (tier.start_read, "k", 0))  # a write, then a read, n times
    mixed_read, mixed_write = ends.get(Op.READ, float("nan")), ends.get(Op.WRITE, float("nan"))
    tier.close()
    srv.shutdown()
    for f in tier.files.dir.rglob("*.r0"):
        f.unlink()
    b = n * record
    return {"record_bytes": record, "threads": threads, "read_Bps": b / rt, "write_Bps": b / wt, "reads_ok": ok,
            "mixed_read_Bps": b / mixed_read, "mixed_write_Bps": b / mixed_write}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--path", default=tempfile.gettempdir(), help="a directory on the disk to measure")
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--record-mib", type=float, nargs="+", default=[0.25, 2.0], help="record sizes (MiB)")
    ap.add_argument("--threads", type=int, nargs="+", default=[IO_THREADS], help="I/O threads per rank")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    nbytes = int(a.gib * (1 << 30)) // (16 << 20) * (16 << 20)
    raw_r, raw_w = raw_rate(a.path, nbytes)
    rows = []
    print(f"{'I/O':<36}{'read GB/s':>10}{'write GB/s':>11}{'read % raw':>11}"
          f"{'mixed: read':>13}{'write GB/s':>11}")
    print(f"{'O_DIRECT file, 16 MiB I/Os':<36}{raw_r / 1e9:>10.2f}{raw_w / 1e9:>11.2f}{100:>10.0f}%")
    for mib in a.record_mib:
        for threads in a.threads:
            rec = int(mib * (1 << 20)) // 4096 * 4096
            row = tier_rate(a.path, nbytes, rec, threads)
            rows.append(row)
            r = row["read_Bps"]
            print(f"{f'tier, {mib:g} MiB records, {threads} threads':<36}{r / 1e9:>10.2f}"
                  f"{row['write_Bps'] / 1e9:>11.2f}{100 * r / raw_r:>10.0f}%{row['mixed_read_Bps'] / 1e9:>13.2f}"
                  f"{row['mixed_write_Bps'] / 1e9:>11.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"path": a.path, "bytes": nbytes, "raw_read_Bps": raw_r, "raw_write_Bps": raw_w,
                       "tier": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
