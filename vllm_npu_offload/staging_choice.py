"""From how many blocks a staged transfer beats a direct one, measured on the device.

A staged transfer pays a fixed cost (a gather launch, events, the pipeline's first
slice not overlapped) that a direct one does not; a direct one pays per page. Where
they cross depends on the device, the link, the page sizes and the chunk geometry, so
it is measured once per (device, KV geometry) with the worker's own buffers at start-up
(before any KV is valid) and cached with the other calibrations (calibration.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import numpy as np

from . import calibration
from .copy.base import Direction

logger = logging.getLogger(__name__)

NEVER = 1 << 62  # "no transfer is large enough": stays direct
# CUDA stores of pages from this size go direct on the copy engines by default: staged, their SM
# gather left every later decode step ~0.15 ms longer on an H200, while direct batch DMA of 32 KiB
# pages costs what vLLM's native offload does (docs/benchmarks.md)
DIRECT_STORE_MIN_PAGE = 32 * 1024
HEURISTIC_MIN_BLOCKS = 4  # without a measurement (NPU_OFFLOAD_CALIBRATE=0)
SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
REPS = 5
VERSION = 3


@dataclass(frozen=True)
class CalibrationTarget:
    """What the measurement needs of a worker core: its geometry, a name for the cache, and a
    function that runs one transfer (device block ids, host chunk ids, staged?) and returns its
    wall seconds from submit to completion."""

    key: str  # device, pages, chunk and staging geometry, paths: a cached result is reused only for these
    device_blocks: int
    num_chunks: int
    blocks_per_chunk: int
    time_transfer: Callable[[Direction, np.ndarray, np.ndarray, bool], float]


def stores_direct(kind: str, page_sizes: list[int], staged_stores: bool | None, staged: bool | None) -> bool:
    """Whether every store goes direct, whatever its size. ``staged_stores``: NPU_OFFLOAD_STAGED_STORES
    (False: always; True: never, stores staged from the measured size); ``staged``: NPU_OFFLOAD_STAGED
    (True: everything staged). Unset, CUDA stores of pages >= DIRECT_STORE_MIN_PAGE go direct; Ascend
    keeps staged stores (the decode cost of a device gather beside the model is measured on CUDA only)."""
    if staged_stores is not None:
        return not staged_stores
    return staged is not True and kind == "cuda" and bool(page_sizes) and min(page_sizes) >= DIRECT_STORE_MIN_PAGE


def measure(target: CalibrationTarget, directions: tuple[Direction, ...] = tuple(Direction)) -> dict:
    """Best-of-``REPS`` seconds of direct and staged transfers per size, and the crossover, for
    ``directions``."""
    bpc = target.blocks_per_chunk
    sizes = [n for n in SIZES if n <= target.device_blocks and -(-n // bpc) <= target.num_chunks]
    rng = np.random.default_rng(0)
    out: dict = {"sizes": sizes, "direct": {}, "staged": {}, "min_blocks": {}}
    for d in directions:
        direct, staged = [], []
        for n in sizes:
            dev = rng.choice(target.device_blocks, n, replace=False).astype(np.int64)
            chunks = rng.choice(target.num_chunks, -(-n // bpc), replace=False).astype(np.int64)
            best = {False: float("inf"), True: float("inf")}
            for rep in range(REPS + 1):  # the first round warms up (JIT, first touch)
                for st in (False, True):
                    t = target.time_transfer(d, dev, chunks, st)
                    if rep:
                        best[st] = min(best[st], t)
            direct.append(best[False])
            staged.append(best[True])
        out["direct"][d.name] = direct
        out["staged"][d.name] = staged
        out["min_blocks"][d.name] = crossover(sizes, direct, staged)
    return out


def _robust_line(n: np.ndarray, t: np.ndarray) -> tuple[float, float]:
    """(slope, intercept) of t ~ a + b n, Theil-Sen: the median of the pairwise slopes, so one
    disturbed measurement (another process on the device, a page fault) does not tilt it."""
    i, j = np.triu_indices(len(n), 1)
    b = float(np.median((t[j] - t[i]) / (n[j] - n[i])))
    return b, float(np.median(t - b * n))


def crossover(sizes: list[int], direct: list[float], staged: list[float]) -> int:
    """Blocks from which staged transfers are used, from each path's cost line over every size
    measured: a staged transfer costs a fixed amount plus the link's time per block, a direct
    one about the same per block but more (per-page descriptors or SM copies), so staged wins
    from where the lines cross, also beyond the sizes measured (small pages' loads: staged
    at ~95% of the link, direct ~86%). Lines, not "the first size from which staged is never
    slower again": one disturbed point at a large size would otherwise send every transfer
    below it down the slower path (seen on the H200 with other engines starting beside it)."""
    if len(sizes) >= 2:
        n = np.asarray(sizes, float)
        bd, ad = _robust_line(n, np.asarray(direct, float))
        bs, as_ = _robust_line(n, np.asarray(staged, float))
        if bs < bd:
            return max(1, int(np.ceil((as_ - ad) / (bd - bs))))
    # staged no cheaper per block (or one size): staged only where it is never slower again
    wins = [s <= d for s, d in zip(staged, direct)]
    first = next((i for i in range(len(sizes)) if all(wins[i:])), None)
    return sizes[first] if first is not None else NEVER


def staged_thresholds(target: CalibrationTarget,
                      directions: tuple[Direction, ...] = tuple(Direction)) -> dict[Direction, int]:
    """Per direction, the smallest transfer (in blocks) that goes staged; only ``directions`` are
    measured (a direction that always stays direct, e.g. stores by ``stores_direct``, gets NEVER
    without start-up transfers)."""
    out = {d: NEVER for d in Direction}
    if not directions:
        return out
    if not calibration.enabled():
        return {**out, **{d: HEURISTIC_MIN_BLOCKS for d in directions}}
    only = "" if set(directions) == set(Direction) else "|" + ",".join(d.name for d in directions)
    try:
        entry = calibration.cached(f"staged-v{VERSION}{only}|{target.key}", lambda: measure(target, directions))
    except Exception as e:  # noqa: BLE001 - never fail start-up over a measurement
        logger.warning("staged-copy calibration failed (%s); staging from %d blocks", e, HEURISTIC_MIN_BLOCKS)
        return {**out, **{d: HEURISTIC_MIN_BLOCKS for d in directions}}
    return {**out, **{d: int(entry["min_blocks"][d.name]) for d in directions}}
