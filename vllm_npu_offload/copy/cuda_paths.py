"""CUDA copy paths and the calibrated per-direction choice.

``PATHS`` offers ``dma`` (cuMemcpyBatchAsync), ``dma_loop`` (cuMemcpyAsync per descriptor),
``sm`` (Triton), ``gather_native`` (the library's own kernel), the chooser and staged paths.
Which path wins depends on the page size, the GPU and the link (batch DMA collapses
below ~28 KiB host->device; SM copies do not), so the chooser measures them on the real GPU with the real page sizes at first
use, for a few ms, and caches the winner per (GPU, direction, page sizes) in
``~/.cache/vllm_npu_offload/copy_calibration.json``. ``NPU_OFFLOAD_CALIBRATE=0`` uses
the size heuristic instead; ``NPU_OFFLOAD_COPY_PATH`` (backend.py) forces a path.

A "split" path (part of a batch on the copy engines, the rest on SMs, concurrently)
was measured on an H200 and lost to ``sm`` alone on every config (docs/benchmarks.md):
the SM kernel, not the link, is the limit, and the slow DMA half decides when a job
ends. So it is not offered.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from .. import calibration
from ..platform import Platform
from . import sm_triton
from .base import BackendChoice, Direction, PlatformPaths

logger = logging.getLogger(__name__)

CALIBRATION_VERSION = 5  # 5: the native direct path on NATIVE_DIRECT_PROGRAMS SMs
SM_MAX_PAGE = 64 * 1024  # heuristic: above this, copy engines are at the link limit already
CAL_BYTES = 16 * 1024 * 1024  # bytes per calibration transfer
CAL_REPS = 5


def _dma(platform: Platform, pages, batch: bool):
    from .cuda_dma import CudaDmaCopyPath

    return CudaDmaCopyPath(platform, batch=batch)




# The native kernel keeps 64 KiB in flight per SM, so two SMs nearly fill the host link; and a
# direct copy holds its SMs whole (512 threads x 128 registers fill an SM's register file) for
# the whole PCIe time, so a concurrent GEMM loses about one SM's share per program. H200,
# 2026-11-23 (docs/benchmarks.md): direct loads on 8 / 4 / 2 SMs moved about the same GB/s while
# a concurrent GEMM ran +4.4..+6.3% / up to +4.1% / -0.5..+2.6% slower.
NATIVE_DIRECT_PROGRAMS = 2


def _gather_native(platform: Platform, pages):
    """The native kernel as a direct SM path (pinned host memory through unified addressing), on
    NATIVE_DIRECT_PROGRAMS SMs."""
    from .cuda_gather import NativeGatherPath

    return NativeGatherPath(platform, pages, programs=NATIVE_DIRECT_PROGRAMS)




def native_gather_built() -> bool:
    try:
        from .._native.cuda import load_library

        return load_library().built_gather
    except (ImportError, OSError):
        return False


def dma_available() -> str | None:
    """None when the native library loads and the driver resolves, else why not."""
    try:
        from .._native.cuda import load_library

        mode, _, err = load_library().runtime_mode()
        return (err or f"driver mode {mode}") if mode < 0 else None
    except (ImportError, OSError) as e:
        return str(e)


def heuristic_choice(page_sizes: list[int], have_dma: bool, have_sm: bool) -> BackendChoice:
    """Without a measurement: SM copies for KV-sized pages, the copy engines for big ones."""
    if not have_dma and not have_sm:
        raise RuntimeError(
            "no CUDA copy path is usable: libnpu_offload_cuda.so is missing (build it with "
            "`python csrc_cuda/build.py`) and triton is not installed"
        )
    big = bool(page_sizes) and max(page_sizes) > SM_MAX_PAGE
    name = "sm" if have_sm and (not have_dma or not big) else "dma"
    return BackendChoice(name, name)


def _synthetic_batch(page_sizes: list[int], host: torch.Tensor, dev: torch.Tensor, direction: Direction, seed: int = 0):
    """Scattered descriptors cycling through the distinct page sizes, ~CAL_BYTES in all."""
    pages = np.array(sorted(set(page_sizes)), dtype=np.int64)
    stride = int((pages.max() + 255) // 256 * 256)
    slots = min(host.numel(), dev.numel()) // stride
    n = int(max(16, min(slots // 2, 8192, CAL_BYTES // int(pages.mean()))))
    rng = np.random.default_rng(seed)
    hs = rng.choice(slots, n, replace=False).astype(np.int64) * stride + host.data_ptr()
    ds = rng.choice(slots, n, replace=False).astype(np.int64) * stride + dev.data_ptr()
    sizes = pages[np.arange(n) % len(pages)]
    return (hs, ds, sizes) if direction.is_load else (ds, hs, sizes)


def time_paths(paths: dict, stream, src, dst, sizes, direction: Direction, reps: int) -> dict[str, float]:
    """Best wall seconds (copy + synchronisation) per path, runs interleaved so that
    clock ramps and other transient noise hit every candidate alike."""
    for path in paths.values():  # warm-up: JIT compile, first touch
        for _ in range(2):
            path.copy(src, dst, sizes, direction, stream)
            stream.synchronize()
    best = {name: float("inf") for name in paths}
    for _ in range(reps):
        for name, path in paths.items():
            t0 = time.perf_counter()
            path.copy(src, dst, sizes, direction, stream)
            stream.synchronize()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def calibrate(platform: Platform, page_sizes: list[int], direction: Direction, names: list[str]) -> dict:
    """Measure each candidate on this GPU; returns {"choice", "gbps": {name: GB/s}}."""
    span = 2 * CAL_BYTES + 2 * max(page_sizes) * 64
    host = platform.empty_pinned(span, torch.uint8)
    dev = torch.empty(span, dtype=torch.uint8, device=platform.device)
    stream = platform.new_stream()
    src, dst, sizes = _synthetic_batch(page_sizes, host, dev, direction)
    nbytes = float(sizes.sum())
    paths = {name: PATHS.paths[name](platform, page_sizes) for name in names}
    best = time_paths(paths, stream, src, dst, sizes, direction, CAL_REPS)
    gbps = {name: nbytes / sec / 1e9 for name, sec in best.items()}
    del host, dev
    return {"choice": max(gbps, key=gbps.get), "gbps": gbps, "descriptors": len(sizes), "time": time.time()}


def choose_cuda(platform: Platform, page_sizes: list[int], measure: tuple[Direction, ...] = tuple(Direction)
                ) -> BackendChoice:
    """The faster of ``dma`` and ``sm`` per direction in ``measure``, measured once per GPU and
    page sizes; the other directions take the heuristic's path."""
    why_no_dma = dma_available()
    have_dma, have_sm = why_no_dma is None, sm_triton.HAS_TRITON
    if not have_dma:
        logger.warning("CUDA DMA path unavailable (%s); using the SM copy path", why_no_dma)
    fallback = heuristic_choice(page_sizes, have_dma, have_sm)
    if not (have_dma and have_sm) or not page_sizes or not calibration.enabled():
        return fallback
    pages = sorted(set(int(p) for p in page_sizes))
    names = ["dma", "sm"] + (["gather_native"] if native_gather_built() else [])
    picks = {Direction.H2D: fallback.load, Direction.D2H: fallback.store}
    for d in measure:
        key = (f"v{CALIBRATION_VERSION}|{platform.device_name()}|{d.name}|{','.join(map(str, pages))}"
               f"|sm{sm_triton.DEFAULT_PROGRAMS}|{'+'.join(names)}")
        try:
            picks[d] = calibration.cached(key, lambda: calibrate(platform, pages, d, names))["choice"]
        except Exception as e:  # noqa: BLE001 - never fail startup over a measurement
            logger.warning("copy path calibration failed (%s); using the heuristic", e)
            return fallback
    return BackendChoice(load=picks[Direction.H2D], store=picks[Direction.D2H])



# SMs of a staged gather/scatter (both directions): a short device-local burst, which must finish
# while the slice before it is on the link. On 2 SMs it fell behind (llama-8b loads 86% -> 81% of one
# contiguous copy on an H200, small pages 54% -> 40%), and 4, 8 or 16 SMs cost a concurrent prefill
# the same (+0.23..+0.26%), so the most a copy takes (docs/benchmarks.md).
STAGE_PROGRAMS = 16


def staged_cuda(platform: Platform, page_sizes: list[int]):
    """Gather/scatter as a short burst on at most 16 SMs (device <-> device), link on the copy engines.

    The gather is the library's native kernel when it was built with nvcc, else Triton.
    """
    why = dma_available()
    if why is not None:
        raise RuntimeError(f"the copy-engine library is unavailable: {why}")
    if native_gather_built():
        from .cuda_gather import NativeGatherPath

        local = NativeGatherPath(platform, page_sizes, programs=STAGE_PROGRAMS)
    else:
        if not sm_triton.HAS_TRITON:
            raise ImportError("staged copies on CUDA need the native gather kernel (build csrc_cuda with nvcc) "
                              "or triton")
        local = sm_triton.SmCopyPath(platform, page_sizes, programs=STAGE_PROGRAMS, tile_bytes=64 * 1024)
        local.name = "sm_local"
    return local, _dma(platform, [], True)


PATHS = PlatformPaths(
    paths={
        "dma": lambda platform, pages: _dma(platform, pages, True),
        "dma_loop": lambda platform, pages: _dma(platform, pages, False),
        "sm": lambda platform, pages: sm_triton.SmCopyPath(platform, pages),
        "gather_native": _gather_native,
    },
    choose=choose_cuda,
    staged=staged_cuda,
)
