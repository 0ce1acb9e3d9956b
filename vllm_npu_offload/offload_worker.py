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

import itertools
import logging
import time
import weakref
from typing import Callable, Sequence

import numpy as np
import torch

from . import env
from .copy.backend import NPUDmaCopyBackend, staged_paths
from .copy.base import Direction, as_direction
from .device_kv import DeviceKVTensor, GroupRef
from .engine import TransferEngine, TransferResult
from .errors import OffloadConfigError
from .host_layout import HostLayout
from .memory import HostKVBuffer
from .plan import (BlockLayout, CopyPlanner, DescriptorPool, Descriptors, TensorPair, check_range, host_ordered,
                   max_unsigned)
from .platform import Platform
from .staging import DEFAULT_STAGING_BYTES, GroupBlocks, StagedPlan, Stager
from .transfer import DirectTransfer, NativeStagedTransfer, StagedTransfer, Transfer
from .staging_choice import NEVER, CalibrationTarget, staged_thresholds, stores_direct

logger = logging.getLogger(__name__)


_LIVE: "weakref.WeakSet[OffloadWorkerCore]" = weakref.WeakSet()


def live_workers() -> list["OffloadWorkerCore"]:
    """Worker cores alive in this process (diagnostics and tests, e.g. to inspect host KV)."""
    return list(_LIVE)


ENV_STAGED = "NPU_OFFLOAD_STAGED"  # 1: every transfer staged, 0: never, unset: calibrated
ENV_STAGED_STORES = "NPU_OFFLOAD_STAGED_STORES"  # 0 / 1: stores direct / staged from the measured size


class OffloadWorkerCore:
    """Owns the host buffer (block-first records), the planners, the staging and the engine.

    One core serves every connector: NPUOffloadingSpec's worker (host chunks of
    ``blocks_per_chunk`` blocks) and the Simple connector's (``blocks_per_chunk=1``).
    A transfer goes *direct* (one descriptor per page and tensor, device <-> host) or
    *staged* (gather/scatter on the device, a few large host copies; staging.py), chosen
    per transfer by its block count against a threshold measured on the device.
    """

    def __init__(
        self,
        device_tensors: Sequence[DeviceKVTensor],
        group_refs: Sequence[Sequence[GroupRef]],
        blocks_per_chunk: int,
        num_chunks: int,
        platform: Platform,
        backend: NPUDmaCopyBackend | None = None,
        staging_bytes: int | None = None,
    ):
        self.platform = platform
        self.device_tensors = list(device_tensors)
        self.group_refs = [list(refs) for refs in group_refs]
        # group-major records: each group's pages are one span holding nothing of another group's
        first_group = {}
        for g, refs in enumerate(self.group_refs):
            for r in refs:
                first_group.setdefault(r.tensor_idx, g)
        order = sorted(range(len(self.device_tensors)), key=lambda t: (first_group.get(t, len(self.group_refs)), t))
        self.layout = HostLayout.build([t.page_bytes for t in self.device_tensors], blocks_per_chunk, num_chunks,
                                       order)
        self.blocks_per_chunk = blocks_per_chunk
        self.num_chunks = num_chunks
        self._sub_blocks = np.arange(blocks_per_chunk, dtype=np.int64)[None, :]  # a chunk's blocks, as a row
        for refs in self.group_refs:
            for r in refs:
                if not 0 < r.page_bytes <= self.device_tensors[r.tensor_idx].page_bytes:
                    raise OffloadConfigError(
                        f"KV group page of {r.page_bytes} bytes does not fit tensor {r.tensor_idx}'s "
                        f"{self.device_tensors[r.tensor_idx].page_bytes}-byte page"
                    )
        self.host = HostKVBuffer(platform, self.layout.nbytes)
        page_sizes = [r.page_bytes for refs in self.group_refs for r in refs]
        mode = env.get(ENV_STAGED)  # True: staged only, False: direct only, None: calibrated
        staged = self._staged_paths(page_sizes, mode)
        # with staging, direct stores take the staging link path: measure only the load's direct path
        self.backend = backend or NPUDmaCopyBackend(
            platform, page_sizes, measure=(Direction.H2D,) if staged else tuple(Direction))
        self.pool = DescriptorPool(platform)
        self.engine = TransferEngine(platform, self.pool)
        # ``poll(direction=None)``: finished transfers (of ``direction`` only, when given), each reported
        # once. The engine's own method, bound here: a frame less on the poll that makes a completion visible.
        self.poll: Callable[..., list[TransferResult]] = self.engine.poll
        self._closed = False
        self.num_groups = len(self.group_refs)
        # device block ids must fit every tensor of their group (one limit when the groups agree)
        self._group_limits = [min((self.device_tensors[r.tensor_idx].num_blocks for r in refs), default=0)
                              for refs in self.group_refs]
        limits = set(self._group_limits)
        self._device_limit = limits.pop() if len(limits) == 1 and all(self.group_refs) else None
        self._direct = {(g, d): self._planner(g, d, None) for g in range(self.num_groups) for d in Direction}
        self.stager: Stager | None = None
        self._one_native = False  # see _setup_staging
        self._staged: dict[tuple[int, Direction], CopyPlanner | None] = {}
        self.staged_min_blocks = {d: NEVER for d in Direction}
        if staged is not None:
            self._setup_staging(staged, staging_bytes, mode)
        _LIVE.add(self)
        logger.info(
            "offload worker: %d tensors, %d groups, %d host chunks x %d blocks x %d-byte records, %.1f MiB host "
            "(%s, %s); staged from %s blocks (load) / %s (store)",
            len(self.device_tensors), self.num_groups, num_chunks, blocks_per_chunk, self.layout.record_bytes,
            self.host.nbytes / 2**20, "pinned" if self.host.pinned else "pageable", self.host.numa.describe(),
            *(self.staged_from(d) for d in (Direction.H2D, Direction.D2H)),
        )

    # -- set-up -----------------------------------------------------------------------------
    def _planner(self, g: int, direction: Direction, staging: Stager | None) -> CopyPlanner | None:
        """Device <-> host (direct) or device <-> staging planner of group ``g``."""
        refs = self.group_refs[g]
        if not refs:
            return None
        far = (staging.staging_layouts(direction, [r.tensor_idx for r in refs]) if staging else
               [self.layout.tensor_layout(self.host.base, r.tensor_idx) for r in refs])
        pairs = []
        for ref, other in zip(refs, far):
            dev = self.device_tensors[ref.tensor_idx]
            d = BlockLayout(dev.base, dev.block_stride, dev.num_blocks)
            src, dst = (d, other) if direction is Direction.D2H else (other, d)
            pairs.append(TensorPair(src, dst, ref.page_bytes))
        # staged: one gather descriptor per page; ``plan`` checks the ids (``_split``)
        return CopyPlanner(pairs, merge=staging is None, check=())

    def _staged_paths(self, page_sizes: list[int], mode: bool | None):
        """(local, link) paths of staged transfers, None when this core stays direct."""
        if mode is False or (self.platform.kind == "cpu" and mode is not True):
            return None  # on CPU the "device" is host memory: a staging copy would only add a memmove
        return staged_paths(self.platform, page_sizes)

    def _setup_staging(self, paths, staging_bytes: int | None, mode: bool | None) -> None:
        self.stager = Stager(self.platform, self.layout, self.host.base,
                             DEFAULT_STAGING_BYTES if staging_bytes is None else staging_bytes,
                             paths[0], paths[1], self.pool)
        # Stores run while the model computes: a direct store must not hold SMs for the whole
        # PCIe time (an SM store slowed a concurrent GEMM by ~20%, docs/benchmarks.md), so small
        # stores go direct on the copy engines and the rest staged. Loads keep the faster path.
        self.backend.use_path(Direction.D2H, paths[1])
        self._staged = {(g, d): self._planner(g, d, self.stager) for g in range(self.num_groups) for d in Direction}
        self.stager.prepare_tables(self._staged.values())
        self._spans = [self.layout.group_span([r.tensor_idx for r in refs]) if refs else (0, 0)
                       for refs in self.group_refs]
        # per direction and group, what a natively planned transfer takes of it (None: no tensors):
        # (planner, record span, bytes per block, pages per block), looked up once per transfer
        self._native_groups = {d: [None if p is None else (p, self._spans[g], p.bytes_per_block, len(p.pairs))
                                   for g, p in ((g, self._staged[(g, d)]) for g in range(self.num_groups))]
                               for d in Direction}
        # one KV group with tensors, the library planning and checking the
        # transfer (CUDA, and Ascend's page form): ``submit`` then plans it inline (what vLLM runs on a
        # uniform model); where the library also takes the engine's order (CUDA), the transfer says so
        st = self.stager
        self._one_native = (self.num_groups == 1 and bool(self.group_refs[0]) and st.plans_natively
                            and st.checks_ids)
        self._room_by_ids = st.table_form  # ``Stager.native_room``'s two forms, read inline by ``submit``
        pages = [r.page_bytes for refs in self.group_refs for r in refs]
        # stores direct on the copy engines, no gather: only loads are measured
        staged = tuple(d for d in Direction if d is Direction.H2D or not stores_direct(
            self.platform.kind, pages, env.get(ENV_STAGED_STORES), mode))
        if mode is True:
            self.staged_min_blocks = {d: 1 if d in staged else NEVER for d in Direction}
        else:
            self.staged_min_blocks = staged_thresholds(self.calibration_target(), staged)

    def calibration_target(self) -> CalibrationTarget:
        """This core as the staged/direct crossover measurement sees it (the first KV group's
        tensors stand for all; jobs use negative ids, never a connector's)."""
        lay, g = self.layout, self.stager.geometry
        key = (f"{self.platform.device_name()}|pages={','.join(map(str, lay.page_bytes))}"
               f"|bpc={lay.blocks_per_chunk}|slots={g.slots}x{g.slot_blocks}|local={self.stager.local_path.name}"
               f"|link={self.stager.link_path.name}|direct={self.backend.choice.load},{self.backend.choice.store}"
               f"|plan={'native' if self.stager.plans_natively else 'python'}")
        rest = [0] * (self.num_groups - 1)
        jobs = itertools.count(-1, -1)

        def time_transfer(direction: Direction, dev: np.ndarray, chunks: np.ndarray, staged: bool) -> float:
            job = next(jobs)
            t0 = time.perf_counter()
            self.submit(job, direction, dev, [len(dev)] + rest, [0] + rest, chunks, staged=staged)
            self.wait([job])
            dt = time.perf_counter() - t0
            for r in self.poll():
                if not r.success:
                    raise RuntimeError(f"calibration transfer failed: {r.error}")
            return dt

        return CalibrationTarget(key, min(t.num_blocks for t in self.device_tensors), self.num_chunks,
                                 self.blocks_per_chunk, time_transfer)

    # -- id mapping ---------------------------------------------------------------------
    def _host_blocks(self, chunk_ids: np.ndarray, skip: int, count: int) -> np.ndarray:
        """Host block ids of ``count`` device blocks, starting ``skip`` blocks into the first chunk."""
        bpc = self.blocks_per_chunk
        if bpc == 1:
            return chunk_ids[:count]
        expanded = (chunk_ids[:, None] * bpc + self._sub_blocks).ravel()
        return expanded[skip : skip + count]

    def split_groups(self, device_block_ids, group_sizes, block_indices,
                     chunk_ids) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """Per non-empty group: (group, device block ids, host block ids); validates the transfer
        (``plan`` also checks the device block ids against the device tensors)."""
        return self._split(None, device_block_ids, group_sizes, block_indices, chunk_ids)

    def _split(self, side: str | None, device_block_ids, group_sizes, block_indices,
               chunk_ids, checked: bool = False) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """``split_groups``; with ``side`` ("src" for stores, "dst" for loads), the device block ids
        are range-checked too: the planners check nothing (host blocks of checked chunks and
        staging positions are in range by construction). ``checked``: the native CUDA planner checks
        both sides' ids itself (``NPO_ERR_RANGE``, raised as ValueError before anything is enqueued),
        so neither range is checked here; the chunk ids are, when a chunk holds several blocks (their
        expansion could wrap past int64)."""
        # contiguous int64 from here on (slices of them stay contiguous): native planners take them by address
        device_block_ids = np.ascontiguousarray(device_block_ids, dtype=np.int64)
        chunk_ids = np.ascontiguousarray(chunk_ids, dtype=np.int64)
        if len(group_sizes) != self.num_groups or len(block_indices) != self.num_groups:
            raise ValueError(
                f"transfer names {len(group_sizes)} group sizes / {len(block_indices)} block indices "
                f"for {self.num_groups} KV groups"
            )
        if sum(group_sizes) != len(device_block_ids):
            raise ValueError(f"group sizes {list(group_sizes)} do not add up to {len(device_block_ids)} device blocks")
        bpc = self.blocks_per_chunk
        if (not checked or bpc > 1) and chunk_ids.size and max_unsigned(chunk_ids) >= self.num_chunks:
            raise ValueError(f"host chunk id out of range [0, {self.num_chunks}): {chunk_ids.tolist()[:8]}")
        if checked:
            side = None
        if side is not None and self._device_limit is not None:  # one limit for every group: one check
            check_range(side, device_block_ids, self._device_limit)
        if (bpc == 1 and self.num_groups == 1 and len(chunk_ids) == len(device_block_ids)
                and (side is None or self._device_limit is not None)):
            # one group, a block per chunk (the common case): the ids as given (a count that does not
            # match goes on to the loop below, which names it)
            return [(0, device_block_ids, chunk_ids)] if len(chunk_ids) else []
        host_ids = chunk_ids if bpc == 1 else (chunk_ids[:, None] * bpc + self._sub_blocks).ravel()
        out = []
        dev_off = chunk_off = 0
        for g, (size, idx) in enumerate(zip(group_sizes, block_indices)):
            if size == 0:
                continue
            skip = idx % bpc
            n_chunks = -(-(size + skip) // bpc)
            if chunk_off + n_chunks > len(chunk_ids):
                raise ValueError(f"group {g} needs {n_chunks} host chunks, transfer gives "
                                 f"{max(0, len(chunk_ids) - chunk_off)}")
            dev = device_block_ids[dev_off : dev_off + size]
            if side is not None and self._device_limit is None and self.group_refs[g]:
                check_range(side, dev, self._group_limits[g])
            first = chunk_off * bpc + skip
            out.append((g, dev, host_ids[first : first + size]))
            dev_off += size
            chunk_off += n_chunks
        if chunk_off != len(chunk_ids):
            raise ValueError(f"transfer gives {len(chunk_ids)} host chunks but its groups use {chunk_off}")
        return out

    def _direct_descriptors(self, direction: Direction, parts) -> Descriptors:
        """Every group's descriptors in one pooled set, sized for no merging (counting the merged
        runs first would find them twice)."""
        work = []
        for g, dev, host in parts:
            planner = self._direct[(g, direction)]
            if planner is not None:
                work.append((planner, *((dev, host) if direction is Direction.D2H else (host, dev))))
        bufs = self.pool.acquire(sum(planner.max_count(len(src)) for planner, src, _ in work))
        pos = nbytes = 0
        try:
            for planner, src, dst in work:
                n, b = planner.plan_into(src, dst, bufs.src_np[pos:], bufs.dst_np[pos:], bufs.sizes_np[pos:])
                pos += n
                nbytes += b
        except BaseException:
            self.pool.release([bufs])
            raise
        return bufs.head(pos, nbytes)

    def _staged_plan(self, direction: Direction, parts) -> StagedPlan:
        groups = []
        for g, dev, host in parts:
            planner = self._staged[(g, direction)]
            if planner is not None:
                groups.append(GroupBlocks(planner, self._spans[g], *host_ordered(dev, host)))
        return self.stager.plan(direction, groups)

    def _native_staged(self, direction: Direction, parts, n: int) -> NativeStagedTransfer:
        """A staged transfer the native pipeline plans when it enqueues it: each group's planner,
        record span and ids (any host order), and pinned room for what the plan writes."""
        groups, nbytes, pages = [], 0, 0
        native = self._native_groups[direction]
        for g, dev, host in parts:
            hit = native[g]
            if hit is not None:
                planner, span, per_block, pairs = hit
                groups.append((planner, span, dev, host))  # contiguous int64: see _split
                k = len(dev)
                nbytes += per_block * k
                pages += pairs * k
        if not groups:
            raise ValueError("a staged transfer needs at least one block of a group with tensors")
        stager = self.stager
        room = self.pool.acquire(stager.native_room(n, pages))
        return NativeStagedTransfer(direction, groups, room, stager, nbytes, pages, 0, stager.orders_natively)

    def staged_from(self, direction: Direction) -> str:
        """The staging threshold in words: a block count, or 'never'."""
        n = self.staged_min_blocks[as_direction(direction)]
        return "never" if self.stager is None or n >= NEVER else str(n)

    def uses_staging(self, direction: Direction, num_blocks: int) -> bool:
        return self.stager is not None and num_blocks >= self.staged_min_blocks[as_direction(direction)]

    # -- transfers ----------------------------------------------------------------------
    def plan(self, direction: Direction, device_block_ids, group_sizes, block_indices, chunk_ids,
             staged: bool | None = None) -> Transfer:
        """One transfer, planned: staged or direct by its size against the calibrated threshold
        (``staged`` overrides it: benchmarks, tests). Its buffers are pooled: hand it to the
        engine (``submit``), or return them with ``pool.release(transfer.buffers)``."""
        if direction.__class__ is not Direction:  # ``as_direction`` inline: a frame less per transfer
            direction = Direction(direction)
        side = "src" if direction is Direction.D2H else "dst"  # the device's side of the copies
        n = sum(group_sizes)
        if staged is None:
            staged = self.uses_staging(direction, n)
        if staged and self.stager is None:
            raise ValueError("staged transfer asked for, but this worker has no staging (CPU, or paths unavailable)")
        native = bool(staged and n) and self.stager.plans_natively
        parts = self._split(side, device_block_ids, group_sizes, block_indices, chunk_ids,
                            checked=native and self.stager.checks_ids)
        if native:
            return self._native_staged(direction, parts, n)
        if staged and n:
            return StagedTransfer(direction, self._staged_plan(direction, parts), self.stager)
        return DirectTransfer(direction, self._direct_descriptors(direction, parts), self.backend)

    def submit(self, job_id: int, direction: Direction, device_block_ids, group_sizes, block_indices, chunk_ids,
               staged: bool | None = None) -> None:
        """Plan one transfer and enqueue it on the engine; its result comes from ``poll``."""
        transfer = None
        if self._one_native and staged is not False:
            # ``plan``'s steps for the common natively planned transfer, without its frame and its
            # staging decision's (the split and checks as ``plan``'s; the library checks both sides'
            # ids). This runs on the engine thread before any copy starts, after the model's step left
            # the host's caches cold, where each frame and lookup costs several times what it does in a
            # loop (measured on the H200's host).
            if direction.__class__ is not Direction:
                direction = Direction(direction)
            n = group_sizes[0] if len(group_sizes) == 1 else 0
            if n > 0 and (staged or n >= self.staged_min_blocks[direction]) and len(block_indices) == 1:
                # the ids as given (a block per host chunk) or expanded to host blocks, when the counts
                # match (else ``plan`` names it). ``_split``'s frame and ``_native_staged``'s cost the H200
                # host 3-10 us more here, on every transfer's critical path
                dev = np.ascontiguousarray(device_block_ids, dtype=np.int64)
                host = np.ascontiguousarray(chunk_ids, dtype=np.int64)
                bpc = self.blocks_per_chunk
                if bpc > 1:
                    # chunks -> their blocks, from the group's first block's place in its chunk; the chunk
                    # ids are checked first (the library checks host blocks, which an expansion of a
                    # huge or negative chunk id could wrap into range)
                    skip = block_indices[0] % bpc
                    ok = len(host) == -(-(n + skip) // bpc) and max_unsigned(host) < self.num_chunks
                    host = self._host_blocks(host, skip, n) if ok else None
                if host is not None and n == len(dev) == len(host):
                    planner, span, per_block, pairs = self._native_groups[direction][0]
                    stager = self.stager
                    # ``stager.native_room(n, pairs * n)`` without its frame (the library checks the room)
                    rows = -(-2 * n // 3) if self._room_by_ids else (pairs + 1) * n
                    transfer = NativeStagedTransfer(direction, [(planner, span, dev, host)], self.pool.acquire(rows),
                                                    stager, per_block * n, pairs * n, 0, stager.orders_natively)
        if transfer is None:  # anything else (several groups, direct, counts that do not match)
            transfer = self.plan(direction, device_block_ids, group_sizes, block_indices, chunk_ids, staged)
        try:
            self.engine.submit(job_id, transfer)
        except BaseException:
            self.pool.release(transfer.buffers)
            raise

    def streams(self) -> list:
        """Every stream this core enqueues copies on (the engine's per direction, the staging
        aux streams): none may be the model's compute stream (diagnostics, benchmarks)."""
        out = [s for d in Direction for s in self.engine.streams(d)]
        if self.stager is not None:
            out += self.stager.aux_streams()
        return out

    def wait(self, job_ids) -> None:
        self.engine.wait(job_ids)

    @property
    def closed(self) -> bool:
        return self._closed

    def shutdown(self) -> None:
        """Wait for every transfer and free host and staging memory; a second call does nothing
        (vLLM 0.21-0.24 shuts down both handlers of one core)."""
        if self._closed:
            return
        self._closed = True
        self.engine.shutdown()
        self.host.release()
        if self.stager is not None:
            self.stager.release()

    def host_view(self, tensor_idx: int) -> torch.Tensor:
        """``(host blocks, page)`` bytes mirroring device tensor ``tensor_idx`` (tests, diagnostics)."""
        lay = self.layout
        return self.host.strided_view(lay.page_offsets[tensor_idx], lay.num_blocks, lay.page_bytes[tensor_idx],
                                      lay.record_bytes)
