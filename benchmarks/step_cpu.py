"""Engine-step CPU per transfer: what one transfer costs vLLM's engine thread (issue #22).

vLLM calls the worker core on its engine thread every step: ``submit`` (split_groups + plan,
then the engine's enqueue) and ``poll``. With CUDA graphs a decode step is 6-9 ms, so this
CPU time sits on the step's critical path. Per transfer this times, with ``perf_counter``
(wall) and ``thread_time`` (this thread's CPU):

- ``plan``: ``OffloadWorkerCore.plan`` (split_groups, descriptors / staged plan);
- ``enqueue``: ``TransferEngine.submit`` (events, stream order, ``transfer.enqueue``);
- ``poll``: ``poll()`` returning the one finished job; ``idle``: ``poll()`` with nothing in flight;
- ``total`` = plan + enqueue + poll, the transfer's share of the step.

Staged transfers run on the Ascend code path against the ACL emulation (tests/support's
build and fake NPU platform; page-descriptor plans and the one native pipeline call), direct
transfers on the host copy path. Only the Python side is measured: the native calls that
would move bytes (``npu_offload_acl_staged_run``, the host path's memmove loop) are replaced by
no-ops, so device KV is never touched (no CUDA or ACL enqueue is in these numbers).
KV shapes come from ``core_bench.SHAPES`` and the GPU yardstick's models (per-layer pages of
16-token blocks); a transfer of N blocks moves N blocks of every KV group (a request's blocks),
each group from host chunks of its own, as vLLM hands them.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from vllm_npu_offload.copy.base import Direction
from vllm_npu_offload.copy.host import HostCopyPath
from vllm_npu_offload.device_kv import DeviceKVTensor, GroupRef
from vllm_npu_offload.offload_worker import OffloadWorkerCore
from .core_bench import SHAPES, KVShape
from .gpu_e2e.models import SHAPES as MODELS

ROOT = Path(__file__).resolve().parents[1]
TOKENS_PER_BLOCK = 16
METRICS = ("plan", "enqueue", "poll", "idle", "total")


@dataclass(frozen=True)
class StepShape:
    """A KV shape plus its KV-cache groups: tensors dealt round-robin, as Gemma-2's
    alternating sliding-window / global layers."""

    kv: KVShape
    groups: int = 1

    @property
    def name(self) -> str:
        return self.kv.name


def _per_layer(model: str) -> KVShape:
    """One page per layer and 16-token block of a GPU-yardstick model (K+V, or MLA's latent)."""
    m = MODELS[model]
    return KVShape(model, (m.kv_bytes_per_token(layers=1) * TOKENS_PER_BLOCK,) * m.layers)


STEP_SHAPES = {s.name: s for s in (
    StepShape(SHAPES["llama-8b"]),  # per layer, K and V apart: 64 x 32 KiB
    StepShape(SHAPES["qwen2.5-0.5b-fp8"]),  # 48 x 2 KiB
    StepShape(_per_layer("dsv2_lite")),  # MLA DeepSeek-V2-Lite: 27 x 18 KiB
    StepShape(SHAPES["llama-70b-tp8"]),  # 160 x 4 KiB
    StepShape(_per_layer("gemma2_9b"), groups=2),  # 42 x 128 KiB, two KV groups
)}
DEFAULT_BLOCKS = (16, 64, 256)
HOSTS = ("random", "seq")


# -- the rig -------------------------------------------------------------------------------------
def _support():
    """tests/support/_npu_build_support: the emulation build and the fake NPU platform the tests use."""
    path = str(ROOT / "tests" / "support")
    if path not in sys.path:
        sys.path.insert(0, path)
    import _npu_build_support

    return _npu_build_support


def build_emulation(out: Path) -> Path:
    """libnpu_offload_acl.so + the ACL emulation into ``out``; NPU_OFFLOAD_NATIVE_DIR and
    NPU_OFFLOAD_ACL_LIBRARY point at them. Returns ``out``."""
    sup = _support()
    if sup.INCLUDE is None:
        raise RuntimeError(sup.SKIP_REASON)
    lib = sup.build_into(out, sup.INCLUDE, None)
    emu = sup.build_mod.build_emulation(sup.CSRC, out, sup.INCLUDE)
    os.environ["NPU_OFFLOAD_NATIVE_DIR"] = str(lib.parent)
    os.environ["NPU_OFFLOAD_ACL_LIBRARY"] = str(emu)
    return out


@contextlib.contextmanager
def python_side_only() -> Iterator[None]:
    """The native calls that move bytes become no-ops: the Python side alone is timed."""
    from vllm_npu_offload._native import acl
    from vllm_npu_offload.copy import host

    saved = acl.staged_run, host.memmove_batch
    acl.staged_run = lambda job, lib: None
    host.memmove_batch = lambda src, dst, sizes: None
    try:
        yield
    finally:
        acl.staged_run, host.memmove_batch = saved


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class StepRig:
    """One worker core per shape on the emulated NPU: staged through the ACL pipeline (every
    transfer may be staged), direct on the host path in both directions. Device KV is allocated
    but never touched (the copies are no-ops), host KV as the product allocates it."""

    def __init__(self, shape: StepShape, max_blocks: int, bpc: int, staging_bytes: int | None = None):
        self.shape, self.bpc = shape, bpc
        pages = shape.kv.pages
        self.dev_blocks = 2 * max_blocks * shape.groups
        self.kv = [torch.empty(self.dev_blocks, p, dtype=torch.uint8) for p in pages]
        refs = [[GroupRef(i, pages[i]) for i in range(g, len(pages), shape.groups)] for g in range(shape.groups)]
        self.chunks_per_group = -(-max_blocks // bpc)
        self.num_chunks = -(-3 * shape.groups * self.chunks_per_group // 2)  # room for random chunks
        platform = _support().fake_npu_platform()
        type(platform).device = property(lambda self: torch.device("cpu"))
        with _env(NPU_OFFLOAD_STAGED="1", NPU_OFFLOAD_COPY_PATH="host"):
            self.core = OffloadWorkerCore([DeviceKVTensor.from_block_view(t) for t in self.kv], refs, bpc,
                                          self.num_chunks, platform, staging_bytes=staging_bytes)
        # staging sets direct stores on its link path (ACL); direct stays on the host path here
        self.core.backend.use_path(Direction.D2H, HostCopyPath())
        self._job = 0

    def args(self, blocks: int, host: str, seed: int) -> tuple:
        """(device block ids, group sizes, block indices, chunk ids) of a ``blocks``-block request."""
        rng = np.random.default_rng(seed)
        g, k = self.shape.groups, -(-blocks // self.bpc)
        dev = np.concatenate([rng.choice(self.dev_blocks, blocks, replace=False) for _ in range(g)])
        chunks = (np.arange(g * k) + int(rng.integers(0, self.num_chunks - g * k + 1)) if host == "seq"
                  else rng.choice(self.num_chunks, g * k, replace=False))
        return dev.astype(np.int64), [blocks] * g, [0] * g, chunks.astype(np.int64)

    def next_job(self) -> int:
        self._job += 1
        return self._job

    def close(self) -> None:
        self.core.shutdown()


# -- timing --------------------------------------------------------------------------------------
def _clock() -> tuple[float, float]:
    return time.perf_counter(), time.thread_time()


def one_transfer(rig: StepRig, direction: Direction, args: tuple, staged: bool) -> dict[str, tuple[float, float]]:
    """(wall, cpu) seconds of each step of one transfer, as vLLM's engine thread runs them."""
    core, job = rig.core, rig.next_job()
    t0 = _clock()
    transfer = core.plan(direction, *args, staged=staged)
    t1 = _clock()
    core.engine.submit(job, transfer)
    t2 = _clock()
    core.wait([job])
    t3 = _clock()
    done = core.poll()
    t4 = _clock()
    idle = core.poll()
    t5 = _clock()
    if len(done) != 1 or not done[0].success or idle:
        raise RuntimeError(f"job {job}: poll gave {done} then {idle}")
    d = lambda a, b: (b[0] - a[0], b[1] - a[1])  # noqa: E731
    out = {"plan": d(t0, t1), "enqueue": d(t1, t2), "poll": d(t3, t4), "idle": d(t4, t5)}
    out["total"] = tuple(out["plan"][i] + out["enqueue"][i] + out["poll"][i] for i in range(2))
    return out


def spread(xs: list[float]) -> dict[str, float]:
    """Median and p10/p90 in microseconds."""
    p10, p50, p90 = np.percentile(np.asarray(xs) * 1e6, [10, 50, 90])
    return {"median": float(p50), "p10": float(p10), "p90": float(p90)}


def time_row(rig: StepRig, direction: Direction, args: tuple, staged: bool, reps: int,
             warmup: int) -> dict[str, Any]:
    for _ in range(warmup):
        one_transfer(rig, direction, args, staged)
    runs = [one_transfer(rig, direction, args, staged) for _ in range(reps)]
    planned = rig.core.plan(direction, *args, staged=staged)
    shape = {"descriptors": len(planned)}
    if staged:
        shape["slices"] = planned.plan.num_slices
    rig.core.pool.release(planned.buffers)
    return {**shape, **{m: {clock: spread([r[m][i] for r in runs]) for i, clock in enumerate(("wall", "cpu"))}
                        for m in METRICS}}


def bench_shape(shape: StepShape, blocks: tuple[int, ...], bpc: int, reps: int, warmup: int,
                hosts: tuple[str, ...] = HOSTS, modes: tuple[str, ...] = ("staged", "direct"),
                printer: Callable[[str], None] = print) -> list[dict[str, Any]]:
    rig = StepRig(shape, max(blocks), bpc)
    rows = []
    try:
        for n in blocks:
            for host in hosts:
                args = rig.args(n, host, seed=n * 7 + len(host))
                for d in Direction:
                    for mode in modes:
                        row = {"shape": shape.name, "tensors": len(shape.kv.pages), "groups": shape.groups,
                               "page_bytes": sorted(set(shape.kv.pages)), "blocks": n, "bpc": bpc, "host": host,
                               "dir": d.name, "mode": mode,
                               **time_row(rig, d, args, mode == "staged", reps, warmup)}
                        rows.append(row)
                        printer(format_row(row))
    finally:
        rig.close()
        del rig
        gc.collect()
    return rows


# -- report --------------------------------------------------------------------------------------
HEADER = (f"{'shape':17s} {'blk':>4s} {'host':6s} {'dir':3s} {'mode':6s} "
          + " ".join(f"{m:>17s}" for m in METRICS) + f" {'cpu total':>9s}")


def format_row(row: dict[str, Any]) -> str:
    cells = [f"{row[m]['wall']['median']:6.1f} [{row[m]['wall']['p10']:4.0f}-{row[m]['wall']['p90']:4.0f}]"
             for m in METRICS]
    return (f"{row['shape']:17s} {row['blocks']:4d} {row['host']:6s} {row['dir']:3s} {row['mode']:6s} "
            + " ".join(f"{c:>17s}" for c in cells) + f" {row['total']['cpu']['median']:9.1f}")


def _key(row: dict[str, Any]) -> tuple:
    return row["shape"], row["blocks"], row["host"], row["dir"], row["mode"]


def compare(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """Per row: total median wall us before -> after and the ratio."""
    old = {_key(r): r for r in before["rows"]}
    lines = [f"{'shape':17s} {'blk':>4s} {'host':6s} {'dir':3s} {'mode':6s} {'before':>8s} {'after':>8s} {'x':>6s}"]
    for r in after["rows"]:
        b = old.get(_key(r))
        if b is None:
            continue
        x, y = b["total"]["wall"]["median"], r["total"]["wall"]["median"]
        lines.append(f"{r['shape']:17s} {r['blocks']:4d} {r['host']:6s} {r['dir']:3s} {r['mode']:6s} "
                     f"{x:8.1f} {y:8.1f} {y / x:6.2f}")
    return lines


def device_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def run(shapes: list[str] | None = None, blocks: tuple[int, ...] = DEFAULT_BLOCKS, bpc: int = 4, reps: int = 200,
        warmup: int = 20, hosts: tuple[str, ...] = HOSTS, modes: tuple[str, ...] = ("staged", "direct"),
        native_dir: str | None = None, json_path: str | None = None, baseline: str | None = None,
        printer: Callable[[str], None] = print) -> dict[str, Any]:
    names = list(STEP_SHAPES) if shapes is None else shapes
    bad = [n for n in names if n not in STEP_SHAPES]
    if bad:
        raise ValueError(f"unknown shape(s) {bad}; allowed: {list(STEP_SHAPES)}")
    report: dict[str, Any] = {"device": device_name(), "cpus": os.cpu_count(), "torch": torch.__version__,
                              "numpy": np.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                              "command": " ".join(sys.argv), "reps": reps, "warmup": warmup, "bpc": bpc,
                              "unit": "us per transfer", "rows": []}
    with contextlib.ExitStack() as stack:
        out = Path(native_dir) if native_dir else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        build_emulation(out)
        stack.enter_context(python_side_only())
        printer(f"device: {report['device']} ({report['cpus']} CPUs); us per transfer, wall median [p10-p90] "
                f"over {reps} reps; Python side only (native copies are no-ops)")
        printer(HEADER)
        for n in names:
            report["rows"] += bench_shape(STEP_SHAPES[n], blocks, bpc, reps, warmup, hosts, modes, printer)
    if baseline:
        with open(baseline) as f:
            for line in compare(json.load(f), report):
                printer(line)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=1)
    return report


__all__ = ["STEP_SHAPES", "StepRig", "StepShape", "bench_shape", "compare", "run"]
