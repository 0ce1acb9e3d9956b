#!/usr/bin/env python3
"""Whole staged transfers of two package trees, interleaved transfer by transfer in one process
(issue #22). ``ab_whole.py`` runs one probe process per tree and round; on the GPU hosts the
Python slowed by up to 2.6x for whole probes at a time (docs/benchmarks.md), so
a 1-2 us change drowned. Here both trees' worker cores live in one process over the same device KV,
and every rep runs one transfer through each (the order alternating), then one contiguous copy of the
same bytes (by default between a device tensor and the very host bytes the transfers moved): each
pair is measured within a millisecond, and the per-rep difference is the measure.

A transfer is timed as ``probe_whole_split.py``'s ``whole`` (submit, the end event's synchronize, the
poll that reports it) and, with ``--spin``, as its ``spin`` too (submit, then polls until one reports
it: what a connector that polls sees). This tree's package is ``new``; ``--base TREE`` is imported
beside it under another name (the package imports itself relatively), each with its own library
built into its own ``_native`` (``NPU_OFFLOAD_NATIVE_DIR`` must be unset: it would give both the same).

    python3 scripts/dev/ab_whole_paired.py --base .gpu/prev --reps 300 --json $OUT/paired.json
    ... --shapes mla-deepseek-fp8@30,hd80-2.5k@103,hd112-3.5k-stride4k@74,mixed-16k-2k@29  # issue #22's others

Prints per shape and direction: medians of whole us (base, new), of ref, whole % of each, the per-rep
difference new - base (us and points, median and its 95% interval) and how often new was faster.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics as st
import sys
import time
from pathlib import Path
from types import ModuleType

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.core_bench import shape_named  # noqa: E402
from benchmarks.gpu_e2e.tables import median_ci  # noqa: E402
from benchmarks.step_cpu import load_baseline  # noqa: E402
from benchmarks.transfer import contiguous_copy_fn  # noqa: E402
import vllm_npu_offload  # noqa: E402

sys.path.insert(0, str(ROOT / "scripts" / "dev"))
from ab_whole import SHAPES, TARGET, at_target as rows_at_target  # noqa: E402
from bench_front_end_cuda import build  # noqa: E402
from probe_whole_split import _spin, whole_seconds  # noqa: E402


def modules(pkg: ModuleType) -> dict[str, ModuleType]:
    """The submodules of ``pkg`` (this tree's package or the baseline's) that the probe uses."""
    return {name: importlib.import_module(f"{pkg.__name__}.{name}")
            for name in ("platform", "device_kv", "offload_worker", "copy.base")}


class Side:
    """One package's worker core over the shared device KV, and its transfer timed whole."""

    def __init__(self, pkg: ModuleType, kv: list[torch.Tensor], pages: tuple[int, ...], blocks_per_chunk: int,
                 num_chunks: int):
        sub = modules(pkg)
        self.platform = sub["platform"].get_platform()
        self.direction = sub["copy.base"].Direction
        dk = sub["device_kv"]
        dev = [dk.DeviceKVTensor.from_block_view(t) for t in kv]
        refs = [[dk.GroupRef(i, p) for i, p in enumerate(pages)]]
        self.core = sub["offload_worker"].OffloadWorkerCore(dev, refs, blocks_per_chunk, num_chunks, self.platform)
        self.job = 0

    def whole(self, load: bool, dev: np.ndarray, host: np.ndarray, spin: bool, staged: bool | None) -> float:
        """Seconds from submit until a poll reports the transfer (``probe_whole_split.whole_seconds``)."""
        self.job += 1
        return whole_seconds(self.core, self.job, self.direction.H2D if load else self.direction.D2H, dev, host, spin,
                             staged)


def interval(values: list[float]) -> tuple[float, float, float]:
    """(low, median, high): the median and its 95% interval (``median_ci``: n >= 6)."""
    lo, hi = median_ci(values)
    return lo, st.median(values), hi


def pair_rows(base: list[float], new: list[float], ref: list[float]) -> dict:
    """Per-rep seconds of each side and of the contiguous copy -> the row the table prints (us, %)."""
    diff_us = [1e6 * (n - b) for b, n in zip(base, new)]
    points = [100 * r / n - 100 * r / b for b, n, r in zip(base, new, ref)]
    return {"base_us": 1e6 * st.median(base), "new_us": 1e6 * st.median(new), "ref_us": 1e6 * st.median(ref),
            "base%": 100 * st.median(ref) / st.median(base), "new%": 100 * st.median(ref) / st.median(new),
            "diff_us": interval(diff_us), "points": interval(points),
            "new_faster": sum(d < 0 for d in diff_us) / len(diff_us), "reps": len(diff_us)}


def at_target(shapes: dict[str, dict[str, dict]], target: float = TARGET) -> dict[str, dict]:
    """Per side (base, new): how many rows (shape, direction) reach ``target`` % of the copy, of how many,
    and the lowest row (``ab_whole.at_target`` on these rows)."""
    return rows_at_target({f"{name} {d}": {label: {"whole%": r[f"{label}%"]} for label in ("base", "new")}
                           for name, rows in shapes.items() for d, r in rows.items()}, target)


def run_shape(sides: dict[str, Side], shape_name: str, reps: int, warmup: int, spin: bool,
              evict_mb: int = 0, ref: str = "pool", auto: bool = False) -> dict[str, dict]:
    """Both sides' rows of one shape. The copy (``ref``) moves the same bytes: between one device
    tensor and, by default, the very host bytes the rep's transfers moved (``pool``: the same
    registered host memory), or a pinned buffer of torch's own (``pinned``, calls 14-15 and the
    probes: its pages can be backed otherwise than the pool's, which moved the copy by up to 19%
    between shapes on one host, docs/benchmarks.md). ``auto``: each core picks
    staged or direct as it does under a connector (its calibrated size threshold, stores of large
    pages direct); else every transfer is staged."""
    shape = shape_named(shape_name)
    mods = modules(sides["new"])
    plat, direction = mods["platform"].get_platform(), mods["copy.base"].Direction
    dev_blocks, num_chunks, chunks = shape.rig_blocks, shape.rig_chunks, shape.transfer_chunks
    kv = [t.random_(0, 256) for t in shape.device_kv(dev_blocks, plat.device)]
    built = {label: Side(pkg, kv, shape.pages, shape.blocks_per_chunk, num_chunks) for label, pkg in sides.items()}
    nbytes = shape.blocks * sum(shape.pages)
    pool = built["new"].core  # its host KV: the chunks a transfer moved are one run of bytes there
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=plat.pin_memory_available) if ref == "pinned" else None
    dev_t = torch.empty(nbytes, dtype=torch.uint8, device=plat.device)
    stream = plat.new_stream()
    rng = np.random.default_rng(0)
    evict = np.zeros(evict_mb << 20, np.uint8)  # touched before each timed piece: caches as a model step leaves them
    out = {}
    try:
        for load in (True, False):
            d = direction.H2D if load else direction.D2H
            times: dict[str, list[float]] = {"base": [], "new": [], "ref": []}
            for rep in range(warmup + reps):
                dev = rng.choice(dev_blocks, shape.blocks, replace=False).astype(np.int64)
                c0 = int(rng.integers(0, num_chunks - chunks))
                host = np.arange(c0, c0 + chunks, dtype=np.int64)
                at = c0 * pool.layout.chunk_bytes
                ref_fn = contiguous_copy_fn(plat, dev_t, pinned if pinned is not None
                                            else pool.host.tensor[at:at + nbytes], d, stream)
                order = ("base", "new") if rep % 2 == 0 else ("new", "base")
                got = {}
                for label in order:
                    if evict.size:
                        evict += 1
                    got[label] = built[label].whole(load, dev, host, spin, None if auto else True)
                if evict.size:
                    evict += 1
                t = time.perf_counter()
                ref_fn()
                _spin(stream.query) if spin else stream.synchronize()
                got["ref"] = time.perf_counter() - t
                if rep >= warmup:
                    for k, v in got.items():
                        times[k].append(v)
            out["H2D" if load else "D2H"] = dict(
                pair_rows(times["base"], times["new"], times["ref"]), chunks=chunks,
                blocks_per_chunk=built["new"].core.blocks_per_chunk,
                mode={label: "staged" if not auto or side.core.uses_staging(d, shape.blocks) else "direct"
                      for label, side in built.items()})
    finally:
        for side in built.values():
            side.core.shutdown()
    return out


def require_libraries(sides: dict[str, ModuleType], device_type: str) -> None:
    """Each side's own copy library must load on CUDA: without it a side falls back to direct copies and
    the pair compares that fallback with the other's library (a ``--no-build`` run whose base tree had
    been replaced did)."""
    if device_type != "cuda":
        return
    for label, pkg in sides.items():
        try:
            importlib.import_module(f"{pkg.__name__}._native.cuda").load_library()
        except ImportError as e:
            raise SystemExit(f"{label} ({Path(pkg.__file__).parent}): its copy library does not load ({e}); "
                             "run without --no-build") from None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the other checkout (its vllm_npu_offload and csrc_cuda)")
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--spin", action="store_true", help="wait by polling, as a connector does, not by synchronize")
    ap.add_argument("--evict-mb", type=int, default=0,
                    help="touch this many MiB before every transfer and every copy, as a model step between "
                         "transfers leaves the host's caches (both sides and the copy alike)")
    ap.add_argument("--ref", choices=("pool", "pinned"), default="pool",
                    help="the contiguous copy's host side: the bytes the transfers moved in the pool (default) "
                         "or a pinned buffer of torch's (calls 14-15)")
    ap.add_argument("--auto", action="store_true",
                    help="staged or direct as each core picks it under a connector (calibrated: the first "
                         "transfers of a shape measure both), not every transfer staged")
    ap.add_argument("--no-build", action="store_true", help="use the libraries already in both packages")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if os.environ.get("NPU_OFFLOAD_NATIVE_DIR"):
        raise SystemExit("NPU_OFFLOAD_NATIVE_DIR is set: both packages would load that one library; unset it")
    base_tree = Path(a.base).resolve()
    if not (base_tree / "vllm_npu_offload" / "__init__.py").is_file():
        raise SystemExit(f"--base {a.base!r}: no vllm_npu_offload package there")
    if a.reps < 6:
        raise SystemExit(f"--reps {a.reps}: at least 6 (the 95% interval of a median needs them)")
    if not a.auto:  # every transfer staged; no start-up measurement of the crossover
        os.environ.setdefault("NPU_OFFLOAD_STAGED", "1")
        os.environ.setdefault("NPU_OFFLOAD_CALIBRATE", "0")
    if not a.no_build:
        for tree in (ROOT, base_tree):
            build(tree, tree / "vllm_npu_offload" / "_native")
    sides = {"base": load_baseline(base_tree), "new": vllm_npu_offload}
    require_libraries(sides, "cuda" if torch.cuda.is_available() else "cpu")
    res = {"base": str(base_tree), "reps": a.reps, "spin": a.spin, "evict_mb": a.evict_mb, "ref": a.ref, "auto": a.auto,
           "shapes": {}}
    print(f"{a.reps} pairs per row after {a.warmup} warm-up, interleaved transfer by transfer; "
          f"{'polled' if a.spin else 'synchronized'}" + (f"; {a.evict_mb} MiB touched before each" if a.evict_mb else "")
          + f"; us and % of one contiguous copy (timed in the same loop; host side: {a.ref})"
          + ("; staged or direct as each core picks (mode)" if a.auto else "; every transfer staged"))
    for label, pkg in sides.items():
        res[f"{label}_package"] = str(Path(pkg.__file__).parent)
        print(f"{label}: {pkg.__name__} from {res[f'{label}_package']}")
    print(f"{'shape dir':28s} {'base us':>8s} {'new us':>8s} {'ref us':>8s} {'base %':>7s} {'new %':>7s} "
          f"{'new-base us (95%)':>26s} {'points (95%)':>24s} {'new faster':>10s} mode")
    for name in filter(None, a.shapes.split(",")):
        res["shapes"][name] = rows = run_shape(sides, name, a.reps, a.warmup, a.spin, a.evict_mb, a.ref, a.auto)
        for d, r in rows.items():
            lo, med, hi = r["diff_us"]
            plo, pmed, phi = r["points"]
            print(f"{name + ' ' + d:28s} {r['base_us']:8.1f} {r['new_us']:8.1f} {r['ref_us']:8.1f} {r['base%']:7.1f} "
                  f"{r['new%']:7.1f} {f'{med:+.1f} ({lo:+.1f}..{hi:+.1f})':>26s} "
                  f"{f'{pmed:+.2f} ({plo:+.2f}..{phi:+.2f})':>24s} {100 * r['new_faster']:9.0f}% "
                  f"{'/'.join(sorted(set(r['mode'].values())))}")
    res["at_target"] = targets = at_target(res["shapes"])
    for label, t in targets.items():
        print(f"{label}: {t['at']} of {t['rows']} rows at {TARGET:.0f}% or more; lowest {t['lowest'][0]} "
              f"{t['lowest'][1]:.1f}%")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
