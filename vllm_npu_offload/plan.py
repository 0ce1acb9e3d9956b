"""Block ids -> (src, dst, size) copy descriptors, vectorised with numpy.

A transfer moves the same block ids for every KV tensor (layer, K/V part). Each
tensor is described on both sides by a ``BlockLayout`` (base address, block stride,
number of blocks); a ``TensorPair`` adds how many bytes of each block to copy. Runs of
block ids that are consecutive on both sides become one descriptor when both sides
use the same block stride, which is the common case after a prefix is stored in order.

Descriptors are written straight into pooled (pinned) int64 buffers; a buffer set is
returned to the pool only after the copy that reads it has finished.
"""

from __future__ import annotations

import bisect
import ctypes
import operator
import threading
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
import torch

from .platform import Platform


@dataclass(frozen=True)
class BlockLayout:
    """Where the blocks of one tensor live: block ``i`` starts at ``base + i * block_stride``."""

    base: int
    block_stride: int
    num_blocks: int


@dataclass(frozen=True)
class TensorPair:
    """One tensor's source and destination layouts and the bytes copied per block."""

    src: BlockLayout
    dst: BlockLayout
    page_bytes: int

    def __post_init__(self):
        if self.page_bytes <= 0:
            raise ValueError(f"page_bytes must be > 0, got {self.page_bytes}")
        for side, lay in (("src", self.src), ("dst", self.dst)):
            if lay.block_stride < self.page_bytes:
                raise ValueError(
                    f"{side} block_stride {lay.block_stride} is smaller than page_bytes {self.page_bytes}"
                )

    @property
    def mergeable(self) -> bool:
        # Equal strides: a run of k consecutive blocks is one span of
        # (k-1)*stride + page bytes on both sides (padding between pages is copied too).
        return self.src.block_stride == self.dst.block_stride


@dataclass
class Descriptors:
    """Three equally long int64 arrays, views into a pooled buffer set (or plain arrays)."""

    src: np.ndarray
    dst: np.ndarray
    sizes: np.ndarray
    total_bytes: int
    buffers: "DescriptorBuffers | None" = None
    addrs: tuple[int, int, int] | None = None  # data pointers of src, dst, sizes, when known

    def __len__(self) -> int:
        return len(self.sizes)

    def pointers(self) -> tuple[int, int, int]:
        """Data pointers of src, dst and sizes for a native call (reading ``.ctypes`` costs ~2 us
        an array on a slow host: a pooled set's are taken once, when it is made)."""
        if self.addrs is None:
            self.addrs = (address(self.src), address(self.dst), address(self.sizes))
        return self.addrs


def address(a: np.ndarray) -> int:
    """Data pointer of an array: ``ctypes.c_char.from_buffer`` costs ~0.8 us where ``a.ctypes.data``
    costs ~2.7 us on a slow host; it takes only writable, C-contiguous, non-empty arrays (and says
    so by raising: cheaper than reading ``a.flags`` first, on the transfer's critical path)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(a))
    except (TypeError, ValueError, BufferError):
        return a.ctypes.data


def max_unsigned(ids: np.ndarray) -> int:
    """The largest id, negatives counting as huge (viewed as unsigned): one range check is one
    reduction; a few ids go through Python's max, which costs less than a numpy reduction then."""
    unsigned = ids.view(np.uint64)
    return max(unsigned.tolist()) if len(unsigned) <= 32 else int(np.maximum.reduce(unsigned))


def check_range(name: str, ids: np.ndarray, limit: int) -> None:
    """ValueError naming the first id of ``ids`` (``name`` block ids) outside ``[0, limit)``."""
    if ids.size and max_unsigned(ids) >= limit:
        bad = ids[(ids < 0) | (ids >= limit)][0]
        raise ValueError(f"{name} block id {int(bad)} out of range [0, {limit})")


def host_ordered(device_ids: np.ndarray, host_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A staged transfer's (device, host) block pairs in ascending host order: the same copies, but
    consecutive host blocks become one link copy whatever order they came in. vLLM's CPU manager
    hands reused host blocks out in reverse (it frees evicted ones in LRU order and pops the free
    list from its end), so once its cache is full every transfer would otherwise be one link copy
    per block. The device side does not care: gathers and scatters take any order. (Direct plans
    merge only where both sides run on, so they keep the order they were given.)"""
    if len(host_ids) < 2 or not (host_ids[1:] < host_ids[:-1]).any():
        return device_ids, host_ids
    order = np.argsort(host_ids, kind="stable")
    return device_ids[order], host_ids[order]


def _run_starts(src_ids: np.ndarray, dst_ids: np.ndarray) -> np.ndarray | None:
    """Indices where a new run of consecutive ids starts; None if every run is one block."""
    brk = (src_ids[1:] - src_ids[:-1]) != 1
    brk |= (dst_ids[1:] - dst_ids[:-1]) != 1
    if brk.all():
        return None
    starts = np.empty(int(np.count_nonzero(brk)) + 1, np.int64)
    starts[0] = 0
    starts[1:] = np.flatnonzero(brk) + 1
    return starts


def _affine(base: np.ndarray, stride: np.ndarray, uniform: int | None, ids: np.ndarray, out: np.ndarray) -> None:
    """out = base + ids * stride, broadcast: ``ids`` a row and ``base``/``stride`` columns
    (tensor-major, out[i, j] for tensor i, block j) or the reverse (block-major)."""
    if uniform is not None:
        np.add(base, ids * uniform, out=out)
    else:
        np.multiply(ids, stride, out=out)
        out += base


class _PairGroup:
    """Pairs that share a strategy, as (m, 1) columns (and their (1, m) row views) ready for
    broadcasting."""

    def __init__(self, pairs: Sequence[TensorPair]):
        m = len(pairs)
        col = lambda xs: np.fromiter(xs, np.int64, m)[:, None]  # noqa: E731
        self.m = m
        self.src_base = col(p.src.base for p in pairs)
        self.src_stride = col(p.src.block_stride for p in pairs)
        self.dst_base = col(p.dst.base for p in pairs)
        self.dst_stride = col(p.dst.block_stride for p in pairs)
        self.page = col(p.page_bytes for p in pairs)
        self.page_sum = int(self.page.sum())
        # One stride for every tensor (the usual case) lets each output be a single pass.
        self._src_uniform = int(self.src_stride[0, 0]) if (self.src_stride == self.src_stride[0, 0]).all() else None
        self._dst_uniform = int(self.dst_stride[0, 0]) if (self.dst_stride == self.dst_stride[0, 0]).all() else None
        self._rows = tuple(a.T for a in (self.src_base, self.src_stride, self.dst_base, self.dst_stride, self.page))

    def fill(self, s_ids, d_ids, run_lens, o_src, o_dst, o_sz) -> None:
        """Tensor-major: row i = pair i, column j = block j (or run j, ``run_lens`` long)."""
        m, k = self.m, len(s_ids)
        o_src, o_dst, o_sz = o_src.reshape(m, k), o_dst.reshape(m, k), o_sz.reshape(m, k)
        _affine(self.src_base, self.src_stride, self._src_uniform, s_ids[None, :], o_src)
        _affine(self.dst_base, self.dst_stride, self._dst_uniform, d_ids[None, :], o_dst)
        if run_lens is None:
            o_sz[:] = self.page
        else:  # src stride == dst stride for mergeable pairs
            np.multiply((run_lens - 1)[None, :], self.src_stride, out=o_sz)
            o_sz += self.page

    def fill_blocks(self, s_ids, d_ids, o_src, o_dst, o_sz) -> None:
        """Block-major: row j = block j, column i = pair i (every page of a block together)."""
        k, m = len(s_ids), self.m
        src_base, src_stride, dst_base, dst_stride, page = self._rows
        o_src, o_dst, o_sz = o_src.reshape(k, m), o_dst.reshape(k, m), o_sz.reshape(k, m)
        _affine(src_base, src_stride, self._src_uniform, s_ids[:, None], o_src)
        _affine(dst_base, dst_stride, self._dst_uniform, d_ids[:, None], o_dst)
        o_sz[:] = page


class CopyPlanner:
    """Precomputed per-tensor layouts; turns block id lists into descriptors.

    Descriptors are tensor-major (all blocks of pair 0, then pair 1, ...); ``plan_blocks_into``
    writes them block-major.
    """

    def __init__(self, pairs: Sequence[TensorPair], merge: bool = True, check: Sequence[str] = ("src", "dst")):
        """``check``: the sides whose block ids are range-checked here; the worker core checks its
        device ids once per transfer itself (host blocks of checked chunks and staging positions
        are in range by construction) and passes none."""
        if not pairs:
            raise ValueError("CopyPlanner needs at least one tensor pair")
        if not set(check) <= {"src", "dst"}:
            raise ValueError(f"check names sides 'src' / 'dst', got {tuple(check)}")
        self.pairs = list(pairs)
        self.merge = merge
        self._check = ("src" in check, "dst" in check)
        self.src_limit = min(p.src.num_blocks for p in pairs)
        self.dst_limit = min(p.dst.num_blocks for p in pairs)
        mergeable = [p for p in pairs if merge and p.mergeable]
        plain = [p for p in pairs if not (merge and p.mergeable)]
        self._plain = _PairGroup(plain) if plain else None
        self._runs = _PairGroup(mergeable) if mergeable else None
        self._all = _PairGroup(self.pairs)
        self.bytes_per_block = self._all.page_sum

    def _ids(self, src_ids, dst_ids) -> tuple[np.ndarray, np.ndarray]:
        src_ids = np.asarray(src_ids, dtype=np.int64)
        dst_ids = np.asarray(dst_ids, dtype=np.int64)
        if src_ids.ndim != 1 or src_ids.shape != dst_ids.shape:
            raise ValueError(
                f"src and dst block ids must be 1-D of equal length, got {src_ids.shape} and {dst_ids.shape}"
            )
        if self._check[0]:
            check_range("src", src_ids, self.src_limit)
        if self._check[1]:
            check_range("dst", dst_ids, self.dst_limit)
        return src_ids, dst_ids

    def check_ids(self, src_ids, dst_ids) -> tuple[np.ndarray, np.ndarray]:
        """The ids as int64 arrays, or ValueError naming the first out-of-range id (of the sides
        this planner checks)."""
        return self._ids(src_ids, dst_ids)

    def pair_table(self) -> np.ndarray:
        """(5, m) int64 rows: src base, src block stride, dst base, dst block stride, bytes per
        pair: what a device kernel needs to address any (pair, block) page itself."""
        a = self._all
        return np.concatenate([a.src_base, a.src_stride, a.dst_base, a.dst_stride, a.page], axis=1).T.copy()

    def _runs_of(self, src_ids, dst_ids):
        if self._runs is None or len(src_ids) < 2:
            return None
        return _run_starts(src_ids, dst_ids)

    def max_count(self, n: int) -> int:
        """Descriptors of ``n`` blocks at most (none merged): enough room for ``plan_into``."""
        return self._all.m * n

    def count(self, src_ids, dst_ids) -> int:
        src_ids, dst_ids = self._ids(src_ids, dst_ids)
        n = len(src_ids)
        starts = self._runs_of(src_ids, dst_ids)
        if starts is None:
            return self._all.m * n
        return (self._plain.m if self._plain else 0) * n + self._runs.m * len(starts)

    def plan_into(self, src_ids, dst_ids, out_src, out_dst, out_sizes) -> tuple[int, int]:
        """Write descriptors into ``out_*``; returns (descriptors written, page bytes covered)."""
        src_ids, dst_ids = self._ids(src_ids, dst_ids)
        n = len(src_ids)
        if n == 0:
            return 0, 0
        starts = self._runs_of(src_ids, dst_ids)
        if starts is None:
            k = self._all.m * n
            self._all.fill(src_ids, dst_ids, None, out_src[:k], out_dst[:k], out_sizes[:k])
            return k, self.bytes_per_block * n
        pos = 0
        if self._plain is not None:
            k = self._plain.m * n
            self._plain.fill(src_ids, dst_ids, None, out_src[:k], out_dst[:k], out_sizes[:k])
            pos = k
        lens = np.empty(len(starts), np.int64)
        np.subtract(starts[1:], starts[:-1], out=lens[:-1])
        lens[-1] = n - starts[-1]
        k = self._runs.m * len(starts)
        sl = slice(pos, pos + k)
        self._runs.fill(src_ids[starts], dst_ids[starts], lens, out_src[sl], out_dst[sl], out_sizes[sl])
        return pos + k, self.bytes_per_block * n

    def plan_blocks_into(self, src_ids, dst_ids, out_src, out_dst, out_sizes) -> tuple[int, int]:
        """Like ``plan_into``, block-major and never merged (staged gathers): block j's pages are
        descriptors ``[j * m, (j + 1) * m)``, so any range of blocks is one range of descriptors."""
        src_ids, dst_ids = self._ids(src_ids, dst_ids)
        k = self._all.m * len(src_ids)
        if k:
            self._all.fill_blocks(src_ids, dst_ids, out_src[:k], out_dst[:k], out_sizes[:k])
        return k, self.bytes_per_block * len(src_ids)

    def plan(self, src_ids, dst_ids, pool: "DescriptorPool | None" = None) -> Descriptors:
        """Descriptors for one transfer, in pooled buffers when ``pool`` is given."""
        cap = self.count(src_ids, dst_ids)
        bufs = pool.acquire(cap) if pool is not None else None
        arrs = [bufs.src_np, bufs.dst_np, bufs.sizes_np] if bufs else [np.empty(cap, np.int64) for _ in range(3)]
        n, nbytes = self.plan_into(src_ids, dst_ids, *arrs)
        return Descriptors(arrs[0][:n], arrs[1][:n], arrs[2][:n], nbytes, bufs)


class DescriptorBuffers:
    """Three pinned int64 rows (src, dst, sizes) plus numpy views of them."""

    def __init__(self, platform: Platform, capacity: int):
        self.capacity = capacity
        # One (3, capacity) allocation: a device-side path uploads all three rows in one copy.
        self.packed = platform.empty_pinned((3, capacity), torch.int64)
        self.src, self.dst, self.sizes = self.packed[0], self.packed[1], self.packed[2]
        self.src_np = self.src.numpy()
        self.dst_np = self.dst.numpy()
        self.sizes_np = self.sizes.numpy()
        self.flat_np = self.packed.view(-1).numpy()  # all three rows back to back
        self.addrs = tuple(int(a.ctypes.data) for a in (self.src_np, self.dst_np, self.sizes_np))
        self.device_cols = None  # a device mirror for paths that upload the rows (kept with the set)
        self.device_addr = 0  # its address, once made

    def head(self, n: int, total_bytes: int) -> Descriptors:
        """The first ``n`` descriptors of the set (its rows' heads: their pointers are known)."""
        return Descriptors(self.src_np[:n], self.dst_np[:n], self.sizes_np[:n], total_bytes, self, self.addrs)


_CAPACITY = operator.attrgetter("capacity")


class DescriptorPool:
    """Reuses pinned descriptor buffers; a set goes back only when its copy has finished."""

    def __init__(self, platform: Platform, min_capacity: int = 1024):
        self._platform = platform
        self._free: list[DescriptorBuffers] = []
        self._min = min_capacity
        self._lock = threading.Lock()

    def acquire(self, n: int) -> DescriptorBuffers:
        with self._lock:
            for i, b in enumerate(self._free):
                if b.capacity >= n:
                    return self._free.pop(i)
            if self._free:
                self._free.pop(0)  # too small: drop the smallest and grow
        cap = max(self._min, 1 << max(0, (n - 1).bit_length()))
        return DescriptorBuffers(self._platform, cap)

    def release(self, bufs: "Iterable[DescriptorBuffers]") -> None:
        with self._lock:
            for b in bufs:  # kept sorted by capacity; of equal ones the last to come back is taken first:
                # a set in use stays in use (its device mirror made once, its rows warm in the caches),
                # where taking the oldest first rotated through every set the pool ever made
                bisect.insort_left(self._free, b, key=_CAPACITY)

    @property
    def num_free(self) -> int:
        return len(self._free)
