"""Engine-step CPU per transfer: what one transfer costs vLLM's engine thread (issue #22).

vLLM calls the worker core on its engine thread every step: ``submit`` (split_groups + plan,
then the engine's enqueue) and ``poll``. With CUDA graphs a decode step is 6-9 ms, so this
CPU time sits on the step's critical path. Per transfer this times, with ``perf_counter``
(wall) and ``thread_time`` (this thread's CPU):

- ``plan``: ``OffloadWorkerCore.plan`` (split_groups, descriptors / staged plan);
- ``enqueue``: ``TransferEngine.submit`` (events, stream order, ``transfer.enqueue``);
- ``poll``: ``poll()`` returning the one finished job; ``idle``: ``poll()`` with nothing in flight;
- ``total`` = plan + enqueue + poll, the transfer's share of the step.

Staged transfers run on the Ascend code path against the ACL emulation (the tests' build;
page-descriptor plans and the one native pipeline call), direct transfers on the host copy
path. Only the planning and the Python side are measured: the native calls that would move bytes
(``npu_offload_acl_staged_run``, the host path's memmove loop) are replaced by no-ops, so device
KV is never touched (no CUDA or ACL enqueue is in these numbers). The library plans staged transfers
itself: its plan-and-enqueue call ``npu_offload_acl_staged_submit`` is replaced by its plan-only entry
``npu_offload_acl_staged_plan``, so the same native planner runs in full (inside ``enqueue``) and only
the enqueue is left out (a baseline tree that plans them in Python times ``Stager.plan`` inside
``plan``, its enqueue left out the same way). KV shapes come from
``core_bench.SHAPES`` and the GPU yardstick's models (per-layer pages of 16-token blocks); a
transfer of N blocks moves N blocks of every KV group (a request's blocks), each group from
host chunks of its own, as vLLM hands them.

``baseline_tree`` loads the package of another checkout (e.g. ``git worktree add /tmp/base
<commit>``) beside this one and times both on the same transfers, rep by rep in turn: on a
shared host whose speed drifts by 1.5x within minutes, only such pairs give a trustworthy ratio.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import importlib.util
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterator
from unittest import mock

import numpy as np
import torch

import vllm_npu_offload
from vllm_npu_offload.copy.base import Direction
from .core_bench import HOSTS, SHAPES, KVShape, host_chunks
from .gpu_e2e.models import SHAPES as MODELS

ROOT = Path(__file__).resolve().parents[1]
TOKENS_PER_BLOCK = 16
METRICS = ("plan", "enqueue", "poll", "idle", "total")
BASELINE_NAME = "vllm_npu_offload_baseline"
STREAM = 0x5EED  # the raw stream handle of the emulated NPU (the emulation only records it)


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
MODES = ("staged", "direct")


# -- the packages and the emulation ----------------------------------------------------------------
def build_emulation(out: Path) -> Path:
    """libnpu_offload_acl.so + the ACL emulation into ``out``, as the tests build them
    (tests/support/_npu_build_support.py); NPU_OFFLOAD_NATIVE_DIR and NPU_OFFLOAD_ACL_LIBRARY
    point at them. Returns ``out``."""
    support = str(ROOT / "tests" / "support")
    if support not in sys.path:
        sys.path.insert(0, support)
    import _npu_build_support as sup

    if sup.INCLUDE is None:
        raise RuntimeError(sup.SKIP_REASON)
    lib = sup.build_into(out, sup.INCLUDE, None)
    emu = sup.build_mod.build_emulation(sup.CSRC, out, sup.INCLUDE)
    os.environ["NPU_OFFLOAD_NATIVE_DIR"] = str(lib.parent)
    os.environ["NPU_OFFLOAD_ACL_LIBRARY"] = str(emu)
    return out


def load_baseline(tree: str | Path) -> ModuleType:
    """The ``vllm_npu_offload`` package of checkout ``tree``, imported as ``BASELINE_NAME`` (the
    core imports itself only relatively, so both versions live side by side)."""
    pkg = Path(tree) / "vllm_npu_offload"
    spec = importlib.util.spec_from_file_location(BASELINE_NAME, pkg / "__init__.py",
                                                  submodule_search_locations=[str(pkg)])
    if spec is None or not (pkg / "__init__.py").exists():
        raise ValueError(f"baseline tree {str(tree)!r} has no vllm_npu_offload package")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[BASELINE_NAME] = mod
    spec.loader.exec_module(mod)
    return mod


def _module(pkg: ModuleType, name: str) -> ModuleType:
    return importlib.import_module(f"{pkg.__name__}.{name}")


def plan_without_enqueue(acl: ModuleType) -> Callable[[Any, Any], tuple[int, int]]:
    """A stand-in for ``acl.staged_submit`` that plans in full with the plan-only entry
    (``npu_offload_acl_staged_plan``) and enqueues nothing: (slices, link copies), as submit gives."""
    held: dict[str, Any] = {"cap": -1}  # the bounds arrays and the output naming them, grown as needed

    def submit(req: Any, lib: Any) -> tuple[int, int]:
        if held["cap"] < req.capacity:  # the room holds >= 1 descriptor per block >= 1 block per slice
            bounds = np.zeros((2, req.capacity + 1), np.int64)
            held.update(cap=req.capacity, bounds=bounds,
                        out=acl.StagedPlanOut(bounds[0].ctypes.data, bounds[1].ctypes.data, req.capacity))
        out = held["out"]
        acl.staged_plan(req, out, lib)
        return out.n_slices, out.n_links

    return submit


@contextlib.contextmanager
def python_side_only(pkg: ModuleType = vllm_npu_offload) -> Iterator[None]:
    """``pkg``'s native calls that move bytes become no-ops: the Python side (and the native planner,
    where it plans) alone is timed."""
    acl, host = _module(pkg, "_native.acl"), _module(pkg, "copy.host")
    saved = acl.staged_run, host.memmove_batch, getattr(acl, "staged_submit", None)
    acl.staged_run = lambda job, lib: None
    host.memmove_batch = lambda src, dst, sizes: None
    if saved[2] is not None:  # a package whose library plans staged transfers itself
        acl.staged_submit = plan_without_enqueue(acl)
    try:
        yield
    finally:
        acl.staged_run, host.memmove_batch = saved[:2]
        if saved[2] is not None:
            acl.staged_submit = saved[2]


def emulated_npu(pkg: ModuleType):
    """A CPU platform posing as 'npu' (the tests' fake_npu_platform), of ``pkg``'s own classes."""

    class EmulatedNpu(_module(pkg, "platform").CpuPlatform):
        kind = "npu"
        device = property(lambda self: torch.device("cpu"))

        def raw_stream_handle(self, stream) -> int:
            return STREAM

    return EmulatedNpu()


# -- the rig ---------------------------------------------------------------------------------------
class StepRig:
    """One worker core of ``pkg`` per shape on the emulated NPU: staged through the ACL pipeline
    (every transfer may be staged), direct on the host path in both directions. Device KV is
    allocated but never touched (the copies are no-ops), host KV as the product allocates it."""

    def __init__(self, shape: StepShape, max_blocks: int, bpc: int, pkg: ModuleType = vllm_npu_offload,
                 staging_bytes: int | None = None):
        self.shape, self.bpc = shape, bpc
        kv_mod, host = _module(pkg, "device_kv"), _module(pkg, "copy.host")
        pages = shape.kv.pages
        self.dev_blocks = 2 * max_blocks * shape.groups
        self.kv = [torch.empty(self.dev_blocks, p, dtype=torch.uint8) for p in pages]
        refs = [[kv_mod.GroupRef(i, pages[i]) for i in range(g, len(pages), shape.groups)]
                for g in range(shape.groups)]
        self.num_chunks = -(-3 * shape.groups * -(-max_blocks // bpc) // 2)  # room for random chunks
        with mock.patch.dict(os.environ, NPU_OFFLOAD_STAGED="1", NPU_OFFLOAD_COPY_PATH="host"):
            self.core = _module(pkg, "offload_worker").OffloadWorkerCore(
                [kv_mod.DeviceKVTensor.from_block_view(t) for t in self.kv], refs, bpc, self.num_chunks,
                emulated_npu(pkg), staging_bytes=staging_bytes)
        # staging sets direct stores on its link path (ACL); direct stays on the host path here
        self.core.backend.use_path(Direction.D2H, host.HostCopyPath())
        self._job = 0

    def args(self, blocks: int, host: str, seed: int) -> tuple:
        """(device block ids, group sizes, block indices, chunk ids) of a ``blocks``-block request."""
        rng = np.random.default_rng(seed)
        g, k = self.shape.groups, -(-blocks // self.bpc)
        dev = np.concatenate([rng.choice(self.dev_blocks, blocks, replace=False) for _ in range(g)])
        return dev.astype(np.int64), [blocks] * g, [0] * g, host_chunks(rng, host, g * k, self.num_chunks)

    def next_job(self) -> int:
        self._job += 1
        return self._job

    def close(self) -> None:
        self.core.shutdown()


# -- timing ----------------------------------------------------------------------------------------
def _clock() -> tuple[float, float]:
    return time.perf_counter(), time.thread_time()


def one_transfer(rig: StepRig, direction: Direction, args: tuple, staged: bool,
                 fused: bool = False) -> dict[str, tuple[float, float]]:
    """(wall, cpu) seconds of each step of one transfer, as vLLM's engine thread runs them (``fused``:
    ``OffloadWorkerCore.submit`` as the connectors call it, which plans the common transfer inline, all
    of it in ``enqueue`` and ``plan`` 0)."""
    core, job = rig.core, rig.next_job()
    t0 = _clock()
    if fused:
        t1 = t0
        core.submit(job, direction, *args, staged=staged)
    else:
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


def summary(runs: list[dict[str, tuple[float, float]]]) -> dict[str, Any]:
    return {m: {clock: spread([r[m][i] for r in runs]) for i, clock in enumerate(("wall", "cpu"))} for m in METRICS}


def time_row(rigs: dict[str, StepRig], direction: Direction, args: tuple, staged: bool, reps: int,
             warmup: int, fused: bool = False) -> dict[str, Any]:
    """Each rig's timings of the same transfer; with two rigs their reps alternate (who goes
    first too), so both see the same machine."""
    for rig in rigs.values():
        for _ in range(warmup):
            one_transfer(rig, direction, args, staged, fused)
    runs: dict[str, list] = {tag: [] for tag in rigs}
    order = list(rigs)
    for i in range(reps):
        for tag in order if i % 2 == 0 else order[::-1]:
            runs[tag].append(one_transfer(rigs[tag], direction, args, staged, fused))
    core = rigs["after"].core
    planned = core.plan(direction, *args, staged=staged)
    out = plan_size(core, planned, staged)
    core.pool.release(planned.buffers)
    out.update(summary(runs["after"]))
    if "before" in rigs:
        out["before"] = summary(runs["before"])
    return out


def plan_size(core: Any, planned: Any, staged: bool) -> dict[str, int]:
    """A planned transfer's descriptors (and slices, staged): a natively planned one is planned here."""
    if not staged:
        return {"descriptors": len(planned)}
    if hasattr(planned, "plan"):  # Stager.plan's
        return {"descriptors": len(planned), "slices": planned.plan.num_slices}
    p = core.stager._fused.plan_only(core.stager, planned)
    return {"descriptors": len(p["local_src"]) + len(p["link_src"]), "slices": len(p["link_bounds"]) - 1}


def bench_shape(shape: StepShape, blocks: tuple[int, ...], bpc: int, reps: int, warmup: int,
                hosts: tuple[str, ...] = HOSTS, modes: tuple[str, ...] = MODES, baseline: ModuleType | None = None,
                printer: Callable[[str], None] = print, fused: bool = False) -> list[dict[str, Any]]:
    rigs = {"after": StepRig(shape, max(blocks), bpc)}
    if baseline is not None:
        rigs["before"] = StepRig(shape, max(blocks), bpc, baseline)
    rows = []
    try:
        for n in blocks:
            for host in hosts:
                args = rigs["after"].args(n, host, seed=n * 7 + len(host))
                for d in Direction:
                    for mode in modes:
                        row = {"shape": shape.name, "tensors": len(shape.kv.pages), "groups": shape.groups,
                               "page_bytes": sorted(set(shape.kv.pages)), "blocks": n, "bpc": bpc, "host": host,
                               "dir": d.name, "mode": mode,
                               **time_row(rigs, d, args, mode == "staged", reps, warmup, fused)}
                        rows.append(row)
                        printer(format_row(row))
    finally:
        for rig in rigs.values():
            rig.close()
        del rigs
        gc.collect()
    return rows


# -- report ----------------------------------------------------------------------------------------
def _cells(metrics: dict[str, Any]) -> str:
    return " ".join(f"{metrics[m]['wall']['median']:6.1f} [{metrics[m]['wall']['p10']:4.0f}-"
                    f"{metrics[m]['wall']['p90']:4.0f}]" for m in METRICS)


HEADER = (f"{'shape':17s} {'blk':>4s} {'host':6s} {'dir':3s} {'mode':6s} "
          + " ".join(f"{m:>17s}" for m in METRICS) + f" {'cpu total':>9s}")


def format_row(row: dict[str, Any]) -> str:
    line = (f"{row['shape']:17s} {row['blocks']:4d} {row['host']:6s} {row['dir']:3s} {row['mode']:6s} "
            + _cells(row) + f" {row['total']['cpu']['median']:9.1f}")
    if "before" in row:
        b = row["before"]
        line += (f"\n{'  before':41s}" + _cells(b) + f" {b['total']['cpu']['median']:9.1f}"
                 f"  after/before {row['total']['wall']['median'] / b['total']['wall']['median']:.2f}")
    return line


def device_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def run(shapes: list[str] | None = None, blocks: tuple[int, ...] = DEFAULT_BLOCKS, bpc: int = 4, reps: int = 200,
        warmup: int = 20, hosts: tuple[str, ...] = HOSTS, modes: tuple[str, ...] = MODES,
        native_dir: str | None = None, json_path: str | None = None, baseline_tree: str | None = None,
        printer: Callable[[str], None] = print, fused: bool = False) -> dict[str, Any]:
    names = list(STEP_SHAPES) if shapes is None else shapes
    bad = [n for n in names if n not in STEP_SHAPES]
    if bad:
        raise ValueError(f"unknown shape(s) {bad}; allowed: {list(STEP_SHAPES)}")
    report: dict[str, Any] = {"device": device_name(), "cpus": os.cpu_count(), "torch": torch.__version__,
                              "numpy": np.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                              "command": " ".join(sys.argv), "reps": reps, "warmup": warmup, "bpc": bpc,
                              "baseline_tree": baseline_tree, "fused": fused, "unit": "us per transfer",
                              "rows": []}
    with contextlib.ExitStack() as stack:
        out = Path(native_dir) if native_dir else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        build_emulation(out)
        baseline = load_baseline(baseline_tree) if baseline_tree else None
        for pkg in (vllm_npu_offload, baseline):
            if pkg is not None:
                stack.enter_context(python_side_only(pkg))
        printer(f"device: {report['device']} ({report['cpus']} CPUs); us per transfer, wall median [p10-p90] "
                f"over {reps} reps; Python side and planning only (native copies are no-ops); staged planner: "
                f"native (npu_offload_acl_staged_plan in enqueue)")
        printer(HEADER)
        for n in names:
            report["rows"] += bench_shape(STEP_SHAPES[n], blocks, bpc, reps, warmup, hosts, modes, baseline, printer,
                                          fused)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=1)
    return report


__all__ = ["STEP_SHAPES", "StepRig", "StepShape", "bench_shape", "load_baseline", "run"]
