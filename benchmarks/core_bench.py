"""Whole-transfer benchmark through the worker core: direct vs staged vs the link's limit.

Why a second benchmark beside transfer.py: staged copies are a property of the worker
core (block-first host records, device staging, the slice pipeline), not of one copy
path, so they are timed the way vLLM drives them: ``OffloadWorkerCore.submit`` + wait,
planning included, on KV shaped like real models (per-layer K and V tensors, fp8,
single-head tensor-parallel pages, MLA, Ascend's split MLA), random device block ids,
host chunks either random (a long-running cache) or consecutive (a fresh one). Each
number is compared with one contiguous copy of the same bytes between the same pinned
host buffer and device memory, in the same run. Four times per transfer: wall clock of
``submit`` + wait (planning and Python included), the device time between the engine's
start and end events ("dev"), the copies alone with descriptors planned beforehand
("exec", how transfer.py times the single paths), and those copies on the device alone
("gpu": the stream is held busy while the CPU enqueues them, and so is the contiguous
reference's; with "cpu", the enqueue's CPU time, it splits exec's loss into device and CPU). The
fixed cost of a whole transfer, split: "outside" its device span (planning, submit, the poll that sees
the end) and "inside" it beyond the link time (the device waiting for the enqueue, copies under the rate).
"""

from __future__ import annotations

import json
import time
import zlib
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
import torch

from vllm_npu_offload.copy.base import Direction
from vllm_npu_offload.device_kv import DeviceKVTensor, GroupRef
from vllm_npu_offload.offload_worker import OffloadWorkerCore
from vllm_npu_offload.platform import Platform, get_platform
from .gemm_load import GemmLoad
from .transfer import contiguous_copy_fn, median_seconds


@dataclass(frozen=True)
class KVShape:
    name: str
    pages: tuple[int, ...]  # bytes per block of each KV tensor
    blocks: int = 64  # device blocks per transfer
    blocks_per_chunk: int = 1
    stride: int = 0  # bytes between a tensor's blocks on the device, when more than its page (padded blocks)

    @property
    def record_bytes(self) -> int:
        return sum(self.pages)

    @property
    def rig_blocks(self) -> int:
        """Device blocks a benchmark allocates: room for 4 transfers' ids drawn at random."""
        return max(256, 4 * self.blocks)

    @property
    def rig_chunks(self) -> int:
        """Host chunks holding ``rig_blocks`` blocks."""
        return -(-self.rig_blocks // self.blocks_per_chunk)

    @property
    def transfer_chunks(self) -> int:
        """Host chunks of one transfer from a chunk's start (the last partial where blocks_per_chunk
        does not divide the blocks)."""
        return -(-self.blocks // self.blocks_per_chunk)

    def device_kv(self, blocks: int, device) -> list[torch.Tensor]:
        """Per tensor, ``(blocks, page)`` uint8 views on ``device``, ``stride`` bytes apart where set."""
        return [torch.empty(blocks, max(p, self.stride), dtype=torch.uint8, device=device)[:, :p] for p in self.pages]


def _kv(layers: int, heads: int, dim: int, tokens: int = 16, dtype_bytes: int = 2) -> tuple[int, ...]:
    return (tokens * heads * dim * dtype_bytes,) * (2 * layers)


SHAPES = {s.name: s for s in (
    KVShape("llama-8b", _kv(32, 8, 128)),
    KVShape("llama-8b-fp8", _kv(32, 8, 128, dtype_bytes=1)),
    KVShape("llama-8b-b64x4", _kv(32, 8, 128), 64, 4),
    KVShape("llama-8b-b64x3", _kv(32, 8, 128), 64, 3),  # 3 blocks per chunk: 64 blocks end in a partial chunk
    KVShape("llama-70b-tp8", _kv(80, 1, 128), 32),
    KVShape("qwen2.5-0.5b", _kv(24, 2, 64), 128),
    KVShape("qwen2.5-0.5b-fp8", _kv(24, 2, 64, dtype_bytes=1), 128),
    KVShape("tiny-1k", _kv(16, 1, 32), 128),
    KVShape("qwen2.5-0.5b-b128", _kv(24, 2, 64, tokens=128), 32),
    KVShape("llama-8b-b128", _kv(32, 8, 128, tokens=128), 32),
    KVShape("mla-deepseek", (16 * 576 * 2,) * 61, 64),
    KVShape("mla-ascend-split", (16 * 512 * 2, 16 * 64 * 2) * 61, 64),
    # issue #22's shapes beyond the 2 / 4 KiB rows (whole transfers >= 16 MiB at NAME@N: fp8 MLA@30,
    # 2.5k@103, 3.5k-stride@74, mixed@29): fp8 MLA latent pages (9 KiB), head dim 80 (2.5 KiB pages),
    # head dim 112 in a 4 KiB block stride (3.5 KiB pages, padded), and 16 KiB + 2 KiB pages in one group
    KVShape("mla-deepseek-fp8", (16 * 576,) * 61, 32),
    KVShape("hd80-2.5k", _kv(32, 1, 80), 64),
    KVShape("hd112-3.5k-stride4k", _kv(32, 1, 112), 64, stride=4096),
    KVShape("mixed-16k-2k", (16 * 8 * 64 * 2, 16 * 1 * 64 * 2) * 32, 32),
)}
DEFAULT_SHAPES = tuple(SHAPES)


HOSTS = ("random", "seq", "rev")


def host_chunks(rng: np.random.Generator, host: str, k: int, num_chunks: int) -> np.ndarray:
    """``k`` host chunk ids: ``random`` (a long-running cache), ``seq`` (consecutive: a fresh one) or
    ``rev`` (consecutive, descending: how vLLM's CPU manager hands out chunks it evicted)."""
    if host == "random":
        return rng.choice(num_chunks, k, replace=False).astype(np.int64)
    if host not in ("seq", "rev"):
        raise ValueError(f"host chunk order {host!r}: one of {', '.join(HOSTS)}")
    run = np.arange(k, dtype=np.int64) + int(rng.integers(0, num_chunks - k + 1))
    return run if host == "seq" else run[::-1].copy()


class CoreRig:
    """A worker core over freshly allocated device KV of ``shape``."""

    def __init__(self, platform: Platform, shape: KVShape, staging_bytes: int | None = None):
        self.platform, self.shape = platform, shape
        self.dev_blocks = shape.rig_blocks
        self.kv = shape.device_kv(self.dev_blocks, platform.device)
        for t in self.kv:
            t.random_(0, 256)
        dev = [DeviceKVTensor.from_block_view(t) for t in self.kv]
        refs = [[GroupRef(i, p) for i, p in enumerate(shape.pages)]]
        self.num_chunks = shape.rig_chunks
        self.core = OffloadWorkerCore(dev, refs, shape.blocks_per_chunk, self.num_chunks, platform,
                                      staging_bytes=staging_bytes)
        self._job = 0

    def ids(self, host: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng(seed)
        n = self.shape.blocks
        dev = rng.choice(self.dev_blocks, n, replace=False).astype(np.int64)
        return dev, host_chunks(rng, host, self.shape.transfer_chunks, self.num_chunks)

    def transfer(self, direction: Direction, dev, chunks, staged: bool) -> None:
        self._job += 1
        self.core.submit(self._job, direction, dev, [len(dev)], [0], chunks, staged=staged)

    def finish(self) -> list[float]:
        """Wait for every transfer; their device-side seconds (engine start/end events)."""
        self.core.engine.drain()
        res = self.core.poll()
        bad = [r for r in res if not r.success]
        if bad:
            raise RuntimeError(f"transfer failed: {bad[0].error}")
        return [r.seconds for r in res]

    def executor(self, direction: Direction, dev, chunks, staged: bool, stream):
        """(a function that enqueues the transfer's copies only, the transfer): planned once, here."""
        transfer = self.core.plan(direction, dev, [len(dev)], [0], chunks, staged=staged)
        return (lambda: transfer.enqueue(stream)), transfer

    def close(self) -> None:
        self.core.shutdown()


def device_only_seconds(platform: Platform, fn, stream, reps: int, hold_s: float = 2e-3) -> tuple[float, float]:
    """(median device seconds of ``fn``'s work, median CPU seconds of the ``fn()`` call) with the
    stream held busy while ``fn`` enqueues: the device time it would take if enqueueing were free.
    (nan, cpu) where the platform cannot hold a stream."""
    start, end = platform.new_event(), platform.new_event()
    dev, cpu = [], []
    for i in range(reps + 1):
        held = platform.hold(stream, hold_s)
        start.record(stream)
        t0 = time.perf_counter()
        fn()
        cpu.append(time.perf_counter() - t0)
        end.record(stream)
        stream.synchronize()
        if held and i:
            dev.append(start.elapsed_time(end) * 1e-3)
    return (float(np.median(dev)) if dev else float("nan")), float(np.median(cpu[1:]))


def bench_shape(platform: Platform, shape: KVShape, reps: int = 10, staging_bytes: int | None = None,
                hosts: tuple[str, ...] = HOSTS) -> dict[str, Any]:
    rig = CoreRig(platform, shape, staging_bytes)
    core = rig.core
    out: dict[str, Any] = {"shape": asdict(shape), "record_bytes": core.layout.record_bytes,
                           "staged_min_blocks": {d.name: core.staged_from(d) for d in Direction},
                           "staging": None if core.stager is None else asdict(core.stager.geometry), "rows": []}
    nbytes = shape.blocks * sum(shape.pages)
    host_t = core.host.tensor[:nbytes]
    dev_t = torch.empty(nbytes, dtype=torch.uint8, device=platform.device)
    stream = platform.new_stream()
    for d in Direction:
        ref = contiguous_copy_fn(platform, dev_t, host_t, d, stream)
        limit = nbytes / median_seconds(ref, stream.synchronize, reps) / 1e9
        ref_dev_s = device_only_seconds(platform, ref, stream, reps)[0]
        for host in hosts:
            dev, chunks = rig.ids(host, seed=zlib.crc32(f"{shape.name}/{host}".encode()))
            row = {"dir": d.name, "host": host, "bytes": nbytes, "contiguous_gbps": limit}
            for mode in (("direct", "staged") if core.stager is not None else ("direct",)):
                staged = mode == "staged"
                dev_s: list[float] = []
                sec = median_seconds(lambda: rig.transfer(d, dev, chunks, staged),
                                     lambda: dev_s.extend(rig.finish()), reps)
                fn, planned = rig.executor(d, dev, chunks, staged, stream)
                exec_s = median_seconds(fn, stream.synchronize, reps)
                gpu_s, cpu_s = device_only_seconds(platform, fn, stream, reps)
                row[f"{mode}_gpu_pct"] = 100.0 * ref_dev_s / gpu_s  # both device-only: CPU cost hidden
                row[f"{mode}_enqueue_us"] = cpu_s * 1e6
                if staged:  # the device-local half alone (gather or scatter of every slice)
                    local_only = lambda: planned.enqueue(stream, link=False)  # noqa: E731
                    row["gather_gbps"] = nbytes / median_seconds(local_only, stream.synchronize, reps) / 1e9
                    row["gather_gpu_gbps"] = nbytes / device_only_seconds(platform, local_only, stream, reps)[0] / 1e9
                dev_med = float(np.median(dev_s[-reps:]))
                for what, t in (("", sec), ("_dev", dev_med), ("_exec", exec_s)):
                    row[f"{mode}{what}_gbps"] = nbytes / t / 1e9
                    row[f"{mode}{what}_pct"] = 100.0 * nbytes / t / 1e9 / limit
                # the fixed cost, split: outside the engine's device span (planning, submit, the poll that
                # sees the end) and inside it beyond the link time (waiting for the enqueue, the copies' loss)
                row[f"{mode}_outside_us"] = (sec - dev_med) * 1e6
                row[f"{mode}_inside_us"] = (dev_med - nbytes / (limit * 1e9)) * 1e6
                core.pool.release(planned.buffers)
            row["auto"] = "staged" if core.uses_staging(d, shape.blocks) else "direct"
            out["rows"].append(row)
    rig.close()
    return out


def interference(platform: Platform, shape: KVShape, gemm_n: int = 8192, gemms: int = 40,
                 staging_bytes: int | None = None) -> dict[str, Any]:
    """Slowdown of a bf16 GEMM loop while the core moves KV back to back (direct and staged)."""
    rig = CoreRig(platform, shape, staging_bytes)
    load = GemmLoad(platform, gemm_n, gemms)
    base = load.alone_ms(3)
    res: dict[str, Any] = {"shape": shape.name, "gemm_n": gemm_n, "gemm_ms_alone": base, "rows": []}
    nbytes = shape.blocks * sum(shape.pages)
    for mode in (("direct", "staged") if rig.core.stager is not None else ("direct",)):
        for d in Direction:
            dev, chunks = rig.ids("random", 1)

            def move_once():
                rig.transfer(d, dev, chunks, mode == "staged")
                rig.finish()

            move_once()  # warm-up
            slow, copies, wall = [], 0, 0.0
            for _ in range(2):
                ms, n, w = load.while_running(move_once)
                slow.append(ms)
                copies, wall = copies + n, wall + w
            res["rows"].append({"mode": mode, "dir": d.name, "gemm_ms": float(np.median(slow)),
                                "slowdown_pct": 100.0 * (float(np.median(slow)) / base - 1.0),
                                "copy_gbps": copies * nbytes / wall / 1e9})
    rig.close()
    return res


def format_shape(res: dict[str, Any]) -> str:
    s = res["shape"]
    pages = sorted(set(s["pages"]))
    lines = [f"{s['name']}: {len(s['pages'])} tensors x {'/'.join(str(p // 1024 or p) for p in pages)}"
             f"{' KiB' if pages[0] >= 1024 else ' B'} x {s['blocks']} blocks, bpc {s['blocks_per_chunk']}, "
             f"record {res['record_bytes'] // 1024} KiB, staged from {res['staged_min_blocks']}"]
    for r in res["rows"]:
        cells = [f"{m} {r[m + '_gbps']:5.1f} GB/s {r[m + '_pct']:3.0f}% (dev {r[m + '_dev_pct']:3.0f}%, "
                 f"exec {r[m + '_exec_pct']:3.0f}%, gpu {r[m + '_gpu_pct']:3.0f}%, cpu {r[m + '_enqueue_us']:4.0f} us, "
                 f"outside {r[m + '_outside_us']:4.0f} us, inside {r[m + '_inside_us']:4.0f} us)"
                 for m in ("direct", "staged") if m + "_gbps" in r]
        gather = (f" | gather {r['gather_gbps']:5.0f} GB/s (gpu {r['gather_gpu_gbps']:5.0f})"
                  if "gather_gbps" in r else "")
        lines.append(f"  {r['dir']} host={r['host']:6s} limit {r['contiguous_gbps']:6.2f} GB/s | "
                     + " | ".join(cells) + gather + f" | auto={r['auto']}")
    return "\n".join(lines)


def format_interference(res: dict[str, Any]) -> str:
    lines = [f"interference ({res['shape']}, bf16 GEMM {res['gemm_n']}^3, alone {res['gemm_ms_alone']:.1f} ms)"]
    for r in res["rows"]:
        lines.append(f"  {r['mode']:6s} {r['dir']}: GEMM {r['slowdown_pct']:+5.1f}% while moving "
                     f"{r['copy_gbps']:5.1f} GB/s")
    return "\n".join(lines)


def shape_named(name: str) -> KVShape:
    """``SHAPES[name]``; ``NAME@N``: that shape with N device blocks per transfer (e.g. ``qwen2.5-0.5b@82``,
    a 15.4 MiB transfer: issue #22's smallest whole-transfer size)."""
    base, _, blocks = name.partition("@")
    if base not in SHAPES or (blocks and not blocks.isdigit()):
        raise ValueError(f"unknown KV shape {name!r}; allowed: {sorted(SHAPES)}, each optionally @BLOCKS")
    return replace(SHAPES[base], name=name, blocks=int(blocks)) if blocks else SHAPES[base]


def run(kind: str | None = None, shapes: list[str] | None = None, reps: int = 10, do_interference: bool = False,
        interference_shapes: list[str] | None = None, staging_bytes: int | None = None,
        json_path: str | None = None, printer=print) -> dict[str, Any]:
    platform = get_platform(kind)
    names = list(DEFAULT_SHAPES) if shapes is None else shapes
    for n in names + list(interference_shapes or []):
        shape_named(n)  # every name valid before anything runs
    report: dict[str, Any] = {"device": platform.device_name(), "kind": platform.kind, "torch": torch.__version__,
                              "shapes": [], "interference": []}
    printer(f"device: {report['device']} ({platform.kind})")
    for n in names:
        res = bench_shape(platform, shape_named(n), reps, staging_bytes)
        report["shapes"].append(res)
        printer(format_shape(res))
    if do_interference and platform.kind != "cpu":
        for n in interference_shapes or ["llama-8b", "qwen2.5-0.5b"]:
            res = interference(platform, shape_named(n), staging_bytes=staging_bytes)
            report["interference"].append(res)
            printer(format_interference(res))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=1)
    return report
