"""Device KV tensors <-> exact-size host chunks, independent of any vLLM version.

vLLM (every API generation we support) hands the worker: a list of device KV tensors
viewed as ``(num_blocks, page)`` bytes, per KV-cache group a list of references
``(tensor index, un-padded page bytes)``, and per transfer the device block ids of each
group, where the group's first block sits in the request (``block_indices``), and the
host chunk ids. A host chunk holds ``blocks_per_chunk`` device blocks of every tensor.
This module turns that into descriptors and runs them on the transfer engine; the
adapters in ``integration`` only translate vLLM's types into these.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from .copy.backend import NPUDmaCopyBackend
from .copy.base import Direction
from .engine import TransferEngine, TransferResult
from .errors import OffloadConfigError
from .memory import HostKVBuffer
from .plan import BlockLayout, CopyPlanner, DescriptorPool, Descriptors, TensorPair
from .platform import Platform, platform_for_tensor

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeviceKVTensor:
    """One device KV allocation seen as blocks: block ``i`` at ``base + i * block_stride``."""

    base: int
    block_stride: int
    num_blocks: int
    page_bytes: int  # padded page; the host mirrors this many bytes per block

    @classmethod
    def from_block_view(cls, t: torch.Tensor, page_bytes: int | None = None) -> "DeviceKVTensor":
        """From a ``(num_blocks, ...)`` tensor whose per-block payload is contiguous."""
        if t.dim() < 1 or t.shape[0] == 0:
            raise OffloadConfigError(f"KV tensor must have a leading num_blocks dimension, got shape {tuple(t.shape)}")
        stride = t.stride(0) * t.element_size()
        page = page_bytes if page_bytes is not None else t[0].numel() * t.element_size()
        if page > stride:
            raise OffloadConfigError(f"KV page of {page} bytes exceeds the block stride {stride} of {tuple(t.shape)}")
        return cls(t.data_ptr(), stride, t.shape[0], page)


@dataclass(frozen=True)
class GroupRef:
    tensor_idx: int
    page_bytes: int  # un-padded bytes actually copied per block


_LIVE: "weakref.WeakSet[OffloadWorkerCore]" = weakref.WeakSet()


def live_workers() -> list["OffloadWorkerCore"]:
    """Worker cores alive in this process (diagnostics and tests, e.g. to inspect host KV)."""
    return list(_LIVE)


class OffloadWorkerCore:
    """Owns the host buffer, the planners per (group, direction) and the transfer engine."""

    def __init__(
        self,
        device_tensors: Sequence[DeviceKVTensor],
        group_refs: Sequence[Sequence[GroupRef]],
        blocks_per_chunk: int,
        num_chunks: int,
        platform: Platform,
        backend: NPUDmaCopyBackend | None = None,
    ):
        if num_chunks <= 0:
            raise OffloadConfigError(f"num_chunks must be > 0 (host memory too small for one block?), got {num_chunks}")
        if blocks_per_chunk <= 0:
            raise OffloadConfigError(f"blocks_per_chunk must be > 0, got {blocks_per_chunk}")
        self.platform = platform
        self.blocks_per_chunk = blocks_per_chunk
        self.num_chunks = num_chunks
        self.device_tensors = list(device_tensors)
        self.host = HostKVBuffer(platform, [t.page_bytes for t in self.device_tensors], num_chunks * blocks_per_chunk)
        page_sizes = [r.page_bytes for refs in group_refs for r in refs]
        self.backend = backend or NPUDmaCopyBackend(platform, page_sizes)
        self.pool = DescriptorPool(platform)
        self.engine = TransferEngine(platform, self.backend, self.pool)
        self._planners: dict[tuple[int, Direction], CopyPlanner | None] = {}
        for g, refs in enumerate(group_refs):
            for direction in Direction:
                pairs = []
                for ref in refs:
                    dev = self.device_tensors[ref.tensor_idx]
                    hreg = self.host.regions[ref.tensor_idx]
                    d = BlockLayout(dev.base, dev.block_stride, dev.num_blocks)
                    h = BlockLayout(self.host.base + hreg.offset, hreg.block_stride, hreg.num_blocks)
                    src, dst = (d, h) if direction is Direction.D2H else (h, d)
                    pairs.append(TensorPair(src, dst, ref.page_bytes))
                self._planners[(g, direction)] = CopyPlanner(pairs) if pairs else None
        self.num_groups = len(group_refs)
        _LIVE.add(self)
        logger.info(
            "offload worker: %d tensors, %d groups, %d host chunks x %d blocks, %.1f MiB host (%s)",
            len(self.device_tensors), self.num_groups, num_chunks, blocks_per_chunk,
            self.host.nbytes / 2**20, "pinned" if self.host.pinned else "pageable",
        )

    # -- id mapping ---------------------------------------------------------------------
    def _host_blocks(self, chunk_ids: np.ndarray, skip: int, count: int) -> np.ndarray:
        """Host block ids of ``count`` device blocks, starting ``skip`` blocks into the first chunk."""
        bpc = self.blocks_per_chunk
        if bpc == 1:
            return chunk_ids[:count]
        expanded = (chunk_ids[:, None] * bpc + np.arange(bpc, dtype=np.int64)[None, :]).ravel()
        return expanded[skip : skip + count]

    def build_descriptors(
        self,
        direction: Direction,
        device_block_ids: np.ndarray,
        group_sizes: Sequence[int],
        block_indices: Sequence[int],
        chunk_ids: np.ndarray,
    ) -> Descriptors:
        device_block_ids = np.asarray(device_block_ids, dtype=np.int64)
        chunk_ids = np.asarray(chunk_ids, dtype=np.int64)
        if len(group_sizes) != self.num_groups or len(block_indices) != self.num_groups:
            raise ValueError(
                f"transfer names {len(group_sizes)} group sizes / {len(block_indices)} block indices "
                f"for {self.num_groups} KV groups"
            )
        if sum(group_sizes) != len(device_block_ids):
            raise ValueError(f"group sizes {list(group_sizes)} do not add up to {len(device_block_ids)} device blocks")
        if chunk_ids.size and (chunk_ids.min() < 0 or chunk_ids.max() >= self.num_chunks):
            raise ValueError(f"host chunk id out of range [0, {self.num_chunks}): {chunk_ids.tolist()[:8]}")
        work = []
        dev_off = chunk_off = 0
        for g, (size, idx) in enumerate(zip(group_sizes, block_indices)):
            if size == 0:
                continue
            skip = idx % self.blocks_per_chunk
            n_chunks = -(-(size + skip) // self.blocks_per_chunk)
            dev = device_block_ids[dev_off : dev_off + size]
            chunks = chunk_ids[chunk_off : chunk_off + n_chunks]
            if len(chunks) != n_chunks:
                raise ValueError(f"group {g} needs {n_chunks} host chunks, transfer gives {len(chunks)}")
            host = self._host_blocks(chunks, skip, size)
            dev_off += size
            chunk_off += n_chunks
            planner = self._planners[(g, direction)]
            if planner is None:
                continue
            src, dst = (dev, host) if direction is Direction.D2H else (host, dev)
            work.append((planner, src, dst, planner.count(src, dst)))
        if chunk_off != len(chunk_ids):
            raise ValueError(f"transfer gives {len(chunk_ids)} host chunks but its groups use {chunk_off}")
        total = sum(w[3] for w in work)
        bufs = self.pool.acquire(total)
        pos = nbytes = 0
        try:
            for planner, src, dst, cnt in work:
                end = pos + cnt
                n, b = planner.plan_into(src, dst, bufs.src_np[pos:end], bufs.dst_np[pos:end], bufs.sizes_np[pos:end])
                pos += n
                nbytes += b
        except BaseException:
            self.pool.release(bufs)
            raise
        return Descriptors(bufs.src_np[:pos], bufs.dst_np[:pos], bufs.sizes_np[:pos], nbytes, bufs)

    # -- transfers ----------------------------------------------------------------------
    def submit(self, job_id: int, direction: Direction, device_block_ids, group_sizes, block_indices, chunk_ids) -> None:
        descs = self.build_descriptors(direction, device_block_ids, group_sizes, block_indices, chunk_ids)
        try:
            self.engine.submit(job_id, direction, descs)
        except BaseException:
            self.pool.release(descs.buffers)
            raise

    def poll(self) -> list[TransferResult]:
        return self.engine.poll()

    def wait(self, job_ids) -> None:
        self.engine.wait(job_ids)

    def shutdown(self) -> None:
        self.engine.shutdown()
        self.host.release()

    def host_view(self, tensor_idx: int) -> torch.Tensor:
        """``(host blocks, page)`` bytes mirroring device tensor ``tensor_idx`` (tests, diagnostics)."""
        return self.host.region_view(tensor_idx)


def device_platform(tensors: Sequence[torch.Tensor]) -> Platform:
    kinds = {t.device.type for t in tensors}
    if len(kinds) != 1:
        raise OffloadConfigError(f"KV tensors are on several device kinds {sorted(kinds)}")
    return platform_for_tensor(tensors[0])
