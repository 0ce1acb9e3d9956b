"""SM copy path: a Triton kernel moves descriptor batches with loads/stores.

Why: the copy engines collapse to ~5-15 GB/s on the small (2-32 KiB) scattered pages
of KV offload, while a few SMs dereferencing pinned host memory through unified
addressing reach the link's ~50 GB/s. The kernel is a persistent grid of a few
programs (``DEFAULT_PROGRAMS``, at most 16 so model kernels keep the rest of the
GPU); each iteration moves a tile of several descriptors at once so
many bytes are in flight. Descriptors whose src and dst are 16-byte aligned move as
16-byte vectors, their remainder (and any unaligned descriptor) byte by byte.
"""

from __future__ import annotations

from typing import Any

from ..errors import CopyError
from ..platform import Platform
from .base import CopyPath, DescriptorRange, Direction, check_descriptors
from .device_descriptors import refuse_null, upload

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = tl = None
    HAS_TRITON = False

# A direct Triton copy's programs (SMs). The kernel, not the SM count, limits it: 8 and 16 SMs moved
# about the same GB/s on an H200 (docs/benchmarks.md), and every SM it holds is one a concurrent
# model kernel lacks for the whole PCIe time, so the smaller count.
DEFAULT_PROGRAMS = 8
MAX_PROGRAMS = 16
# Bytes one program moves per iteration (all its descriptors): other tile sizes changed little on an
# H200, and bigger ones spill registers (docs/benchmarks.md).
DEFAULT_TILE_BYTES = 32 * 1024
MAX_CHUNK_BYTES = 16 * 1024  # per descriptor per iteration


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def tile_shape(page_bytes: int, tile_bytes: int = DEFAULT_TILE_BYTES) -> tuple[int, int]:
    """(descriptors per iteration, 16-byte vectors per descriptor per iteration) for a page size."""
    chunk = min(_next_pow2(max(page_bytes, 16)), MAX_CHUNK_BYTES)
    jobs = 1 << (max(1, min(64, tile_bytes // chunk)).bit_length() - 1)  # a power of two, rounded down
    return jobs, chunk // 16


if HAS_TRITON:

    @triton.jit(do_not_specialize=["first", "width", "rows", "stride"])
    def _sm_copy_kernel(src_ptr, dst_ptr, size_ptr, first, width, rows, stride, JOBS: tl.constexpr,
                        VECS: tl.constexpr, BYTES: tl.constexpr):
        # Descriptors ``first + r * stride + c`` for r < rows, c < width: a contiguous range
        # (rows=1) or the same column range of every row of a tensor-major table (a staged slice).
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        lane2 = tl.arange(0, 2)  # the two 8-byte halves of one 16-byte vector
        n = rows * width
        for g in range(pid, tl.cdiv(n, JOBS), nprog):
            k = g * JOBS + tl.arange(0, JOBS)
            live = k < n
            job = first + (k // width) * stride + k % width
            s = tl.load(src_ptr + job, mask=live, other=0)
            d = tl.load(dst_ptr + job, mask=live, other=0)
            size = tl.load(size_ptr + job, mask=live, other=0)
            aligned = ((s | d) & 15) == 0
            nvec = tl.where(aligned, size >> 4, 0)
            # 16-byte part: [JOBS, VECS, 2] int64, contiguous pairs -> 128-bit accesses.
            s64 = tl.multiple_of(s.to(tl.pointer_type(tl.int64)), 16)
            d64 = tl.multiple_of(d.to(tl.pointer_type(tl.int64)), 16)
            for c in range(0, tl.max(nvec, 0), VECS):
                v = c + tl.arange(0, VECS)
                m = (v[None, :] < nvec[:, None])[:, :, None]
                word = (v * 2)[None, :, None] + lane2[None, None, :]
                x = tl.load(s64[:, None, None] + word, mask=m, eviction_policy="evict_first")
                tl.store(d64[:, None, None] + word, x, mask=m)
            # Byte part: the tail after the vectors, or all of an unaligned descriptor.
            start = nvec * 16
            nbytes = size - start
            s8 = s.to(tl.pointer_type(tl.uint8)) + start
            d8 = d.to(tl.pointer_type(tl.uint8)) + start
            for c in range(0, tl.max(nbytes, 0), BYTES):
                b = c + tl.arange(0, BYTES)
                m = b[None, :] < nbytes[:, None]
                x = tl.load(s8[:, None] + b[None, :], mask=m)
                tl.store(d8[:, None] + b[None, :], x, mask=m)


class SmCopyPath(CopyPath):
    """Triton copy on a few SMs, for loads and stores alike."""

    name = "sm"

    def __init__(self, platform: Platform, page_sizes: list[int] | None = None, programs: int | None = None,
                 tile_bytes: int | None = None, num_warps: int = 8):
        if not HAS_TRITON:
            raise ImportError("the SM copy path needs triton (pip install triton)")
        self.platform = platform
        self.programs = programs or DEFAULT_PROGRAMS
        if not 1 <= self.programs <= 1024:
            raise ValueError(f"programs={self.programs}; allowed: 1..1024")
        self.tile_bytes = tile_bytes or DEFAULT_TILE_BYTES
        self.num_warps = num_warps
        self.page = max(page_sizes) if page_sizes else 16 * 1024

    def copy(self, src, dst, sizes, direction: Direction, stream: Any, buffers=None) -> None:
        check_descriptors(src, dst, sizes)
        n = len(sizes)
        if n == 0:
            return
        refuse_null(src, dst, "sm copy")
        try:
            with self.platform.stream_context(stream):
                self._launch(upload(self.platform, src, dst, sizes, buffers), 0, n)
        except Exception as e:  # noqa: BLE001 - surface as the copy contract's error
            raise CopyError(f"sm copy of {n} descriptors failed to launch: {type(e).__name__}: {e}", "sm.launch") from e

    def _launch(self, t, first: int, width: int, rows: int = 1, stride: int = 0) -> None:
        jobs, vecs = tile_shape(self.page, self.tile_bytes)
        grid = (max(1, min(self.programs, -(-(rows * width) // jobs))),)
        _sm_copy_kernel[grid](t[0], t[1], t[2], first, width, rows, stride, JOBS=jobs, VECS=vecs, BYTES=256,
                              num_warps=self.num_warps)

    def prepare(self, descriptors):
        """Check and upload a whole transfer's descriptors in one copy, on the current stream."""
        src, dst, sizes = descriptors.src, descriptors.dst, descriptors.sizes
        check_descriptors(src, dst, sizes)
        refuse_null(src, dst, "sm copy")
        return upload(self.platform, src, dst, sizes, descriptors.buffers)

    def copy_range(self, prepared, rng: DescriptorRange, direction: Direction, stream: Any) -> None:
        if rng.count <= 0:
            return
        try:
            with self.platform.stream_context(stream):
                self._launch(prepared, rng.first, rng.width, rng.rows, rng.stride)
        except Exception as e:  # noqa: BLE001
            raise CopyError(f"sm copy of {rng.count} descriptors failed to launch: {type(e).__name__}: {e}",
                            "sm.launch") from e
