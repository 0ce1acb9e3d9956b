"""Do transfers delay model work that is enqueued *after* them?

Why: in real vLLM (docs/benchmarks.md) the first decode forward after a prefill ran
~30 ms longer with our stores on, about the link time of the stores submitted just before it.
The cause: vLLM computes on a stream from torch's pool (32 per priority, handed out
round-robin), and our transfer streams came from the same pool, so after enough draws a
transfer stream was the compute stream itself. The GEMM interference benchmark cannot see
this (its GEMMs are enqueued before the copies). Here the start event of a decode-sized burst
(small pinned H2D input, small GEMMs, small D2H output per step) is recorded, the transfers
are submitted (as vLLM submits deferred stores inside ``execute_model``), then the burst is
enqueued; its device time is compared with the burst alone, on the default stream and on all
32 pool streams. ``torch_pool`` re-creates the previous design (pooled transfer streams).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from typing import Any, Callable

import torch

from vllm_npu_offload.copy.base import Direction
from vllm_npu_offload.platform import get_platform
from .core_bench import SHAPES, CoreRig

ENV_TORCH_POOL = "STALL_PROBE_TORCH_POOL"  # 1: this probe draws transfer streams from torch's pool


class Burst:
    """Decode-sized model work on one stream: ``steps`` x (a small pinned H2D input copy, ``gemms``
    small GEMMs, a small D2H output copy), like vLLM's eager forward + sampled-token readback.
    ``copies=False`` leaves the copies out (kernels only)."""

    def __init__(self, platform, steps: int = 10, gemms: int = 20, copies: bool = True):
        dev = platform.device
        self.platform, self.steps, self.gemms, self.copies = platform, steps, gemms, copies
        self.x = torch.randn(48, 4096, device=dev, dtype=torch.bfloat16)
        self.w = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
        self.y = torch.empty(48, 4096, device=dev, dtype=torch.bfloat16)
        self.h_in = torch.zeros(256 * 1024, dtype=torch.uint8).pin_memory()
        self.d_in = torch.empty(256 * 1024, dtype=torch.uint8, device=dev)
        self.h_out = torch.zeros(4096, dtype=torch.uint8).pin_memory()
        self.d_out = torch.zeros(4096, dtype=torch.uint8, device=dev)

    def describe(self) -> str:
        copies = ("H2D 256 KiB, ", ", D2H 4 KiB") if self.copies else ("", "")
        return f"{self.steps} x ({copies[0]}{self.gemms} GEMMs 48x4096x4096{copies[1]})"

    def run_ms(self, stream, submit: Callable[[], None] | None = None, start_first: bool = True) -> tuple[float, float]:
        """(device ms of the burst, CPU ms of ``submit()``). With ``start_first`` the burst's start
        event is recorded before ``submit()`` runs, the way vLLM submits deferred stores inside
        ``execute_model``; then the device time also counts the CPU time of the submit."""
        p = self.platform
        a, b = p.new_event(), p.new_event()
        if start_first:
            a.record(stream)
        t0 = time.perf_counter()
        if submit is not None:
            submit()
        submit_ms = (time.perf_counter() - t0) * 1e3
        if not start_first:
            a.record(stream)
        with p.stream_context(stream):
            for _ in range(self.steps):
                if self.copies:
                    self.d_in.copy_(self.h_in, non_blocking=True)
                for _ in range(self.gemms):
                    torch.matmul(self.x, self.w, out=self.y)
                if self.copies:
                    self.h_out.copy_(self.d_out, non_blocking=True)
            b.record(stream)
        b.synchronize()
        return a.elapsed_time(b), submit_ms


def _use_torch_pool() -> None:
    """The previous design, for comparison: transfer streams drawn from torch's stream pool."""
    from vllm_npu_offload.platform import CudaPlatform

    CudaPlatform.new_stream = lambda self: torch.cuda.Stream()


def measure(shape: str = "llama-8b", blocks: int = 512, jobs: int = 1, steps: int = 10, copies: bool = True,
            direction: str = "D2H", reps: int = 3, pool_streams: int = 32, start_first: bool = True,
            modes: tuple[str, ...] = ("direct", "staged")) -> dict[str, Any]:
    """Burst device ms alone and right after ``jobs`` transfers of ``blocks`` blocks in all, on
    the default stream and on ``pool_streams`` streams drawn from torch's pool (the way vLLM gets
    its compute stream). 32 draws cover the whole pool, so a pooled transfer stream is one of them."""
    platform = get_platform()
    if platform.kind != "cuda":
        raise RuntimeError(f"the stall probe needs a CUDA device, found {platform.kind}")
    if os.environ.get(ENV_TORCH_POOL) == "1":
        _use_torch_pool()
    d = Direction[direction]
    per_job = max(1, blocks // jobs)
    computes = [("default", torch.cuda.default_stream())] + [(f"pool{i}", torch.cuda.Stream())
                                                             for i in range(pool_streams)]
    rig = CoreRig(platform, replace(SHAPES[shape], blocks=per_job))
    if rig.core.stager is None:
        modes = tuple(m for m in modes if m != "staged")
    burst = Burst(platform, steps=steps, copies=copies)
    ids = [rig.ids("random", 10 + j) for j in range(jobs)]
    res: dict[str, Any] = {"shape": shape, "blocks": per_job * jobs, "jobs": jobs, "direction": d.name,
                           "start": "before the submit" if start_first else "after the submit",
                           "burst": burst.describe(),
                           "bytes": per_job * jobs * rig.shape.record_bytes, "rows": [],
                           "paths": {"direct": rig.core.backend.path(d).name},
                           "env": {k: v for k, v in os.environ.items()
                                   if k.startswith(("NPU_OFFLOAD_", "CUDA_DEVICE_MAX")) or k == ENV_TORCH_POOL}}
    for name, cs in computes:
        alone = [burst.run_ms(cs)[0] for _ in range(reps + 1)][1:]
        row: dict[str, Any] = {"compute": name, "alone_ms": statistics.median(alone)}
        for mode in modes:
            after, xfer, cpu = [], [], []
            for _ in range(reps + 1):
                torch.cuda.synchronize()

                def submit():
                    with platform.stream_context(cs):  # the engine orders its jobs after this stream
                        for dev, chunks in ids:
                            rig.transfer(d, dev, chunks, staged=mode == "staged")

                dev_ms, cpu_ms = burst.run_ms(cs, submit, start_first)
                after.append(dev_ms)
                cpu.append(cpu_ms)
                xfer.append(sum(rig.finish()) * 1e3)
            row[f"{mode}_ms"] = statistics.median(after[1:])
            row[f"{mode}_xfer_ms"] = statistics.median(xfer[1:])
            row[f"{mode}_submit_cpu_ms"] = statistics.median(cpu[1:])
        res["rows"].append(row)
    mine = {platform.raw_stream_handle(s) for s in rig.core.streams()}
    res["aliased"] = [name for name, cs in computes if platform.raw_stream_handle(cs) in mine]
    rig.close()
    return res


MATRIX = {  # label: environment of one child process
    "default": {},  # direct = copy-engine DMA (the store path whenever staging exists)
    "sm": {"NPU_OFFLOAD_COPY_PATH": "gather_native", "NPU_OFFLOAD_STAGED": "0"},  # direct = SM kernel
    "conn32": {"CUDA_DEVICE_MAX_CONNECTIONS": "32"},  # more hardware work queues than streams in use
    "torch_pool": {ENV_TORCH_POOL: "1"},  # the previous design: transfer streams from torch's pool
    "dma": {"NPU_OFFLOAD_COPY_PATH": "dma"},  # direct = copy-engine DMA in both directions
}


def matrix(labels: list[str], argv: list[str]) -> list[dict[str, Any]]:
    """Run ``measure`` in one child process per environment (connection counts are per process)."""
    out = []
    for label in labels:
        env = {**os.environ, **MATRIX[label], "NPU_OFFLOAD_CALIBRATE": "0"}
        p = subprocess.run([sys.executable, "-m", "benchmarks.stall", "--child", *argv],
                           env=env, capture_output=True, text=True, timeout=300)
        if p.returncode:
            out.append({"label": label, "error": (p.stderr or p.stdout)[-3000:]})
            continue
        out.append({"label": label, **json.loads(p.stdout.strip().splitlines()[-1])})
    return out


def format_results(results: list[dict[str, Any]]) -> str:
    """Per environment and mode: the burst's device time alone and after the transfer (median and
    worst over the compute streams), and which compute streams were a transfer stream."""
    lines = []
    for r in results:
        if "error" in r:
            lines.append(f"[{r['label']}] error: {r['error'].splitlines()[-1] if r['error'] else '?'}")
            continue
        rows = r["rows"]
        lines.append(f"[{r['label']}] {r['shape']}: {r['jobs']} {r['direction']} transfer(s), "
                     f"{r['bytes'] / 2**20:.0f} MiB, then {r['burst']} on {len(rows)} compute streams; "
                     f"direct path {r['paths']['direct']}; transfer streams that are compute streams: "
                     f"{r.get('aliased') or 'none'}")
        alone = statistics.median(x["alone_ms"] for x in rows)
        lines.append(f"  burst start event recorded {r.get('start', 'before the submit')}")
        for m in [k[:-8] for k in rows[0] if k.endswith("_xfer_ms")]:
            worst = max(rows, key=lambda x: x[m + "_ms"])
            lines.append(f"  after {m:6s}: burst median {statistics.median(x[m + '_ms'] for x in rows):6.2f} ms "
                         f"(alone {alone:.2f}), worst {worst[m + '_ms']:6.2f} ms on {worst['compute']}; "
                         f"transfer {statistics.median(x[m + '_xfer_ms'] for x in rows):.1f} ms, its submit "
                         f"{statistics.median(x.get(m + '_submit_cpu_ms', float('nan')) for x in rows):.2f} ms CPU")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="probe_stall", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--labels", default=",".join(MATRIX), help=f"environments to run, of {list(MATRIX)}")
    ap.add_argument("--shape", default="llama-8b", choices=sorted(SHAPES))
    ap.add_argument("--blocks", type=int, default=512)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--steps", type=int, default=10, help="burst steps of 20 small GEMMs each")
    ap.add_argument("--no-copies", action="store_true", help="burst of kernels only (no H2D/D2H copies)")
    ap.add_argument("--direction", default="D2H", choices=["D2H", "H2D"])
    ap.add_argument("--start-after", action="store_true",
                    help="record the burst's start event after the submit (device-side effects only)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json")
    a, _ = ap.parse_known_args(argv)
    kw = dict(shape=a.shape, blocks=a.blocks, jobs=a.jobs, steps=a.steps, copies=not a.no_copies,
              direction=a.direction, reps=a.reps, start_first=not a.start_after)
    if a.child:
        print(json.dumps(measure(**kw)))
        return 0
    labels = [x for x in a.labels.split(",") if x]
    bad = [x for x in labels if x not in MATRIX]
    if bad:
        ap.error(f"--labels {bad}: choose from {list(MATRIX)}")
    child_argv = ([f"--{k}={v}" for k, v in kw.items() if k not in ("copies", "start_first")]
                  + ([] if kw["copies"] else ["--no-copies"]) + (["--start-after"] if a.start_after else []))
    results = matrix(labels, child_argv)
    print(format_results(results))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
