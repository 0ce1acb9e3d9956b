"""Staged transfers: scatter/gather on the device, a few large copies over the link.

Copying page by page between scattered device pages and scattered host pages cannot
reach the link: copy engines pay a fixed price per descriptor and an SM copy holds SMs
for the whole PCIe time. A staged store instead (1) gathers the transfer's pages into a
device staging buffer, laid out exactly like the host records (device-local copies,
where bandwidth is plentiful: a short SM burst on CUDA, ACL device-to-device copies on
Ascend, memmove on CPU), then (2) moves staging -> host with one DMA descriptor per run
of consecutive host blocks (adjacent chunks merge). A staged load is the mirror image.

The transfer is cut into slices that each fit one staging slot; with several slots the
gather of slice i+1 overlaps the DMA of slice i, so the link never waits for the gather.
The link copies run on the job's stream (ordered after compute and earlier jobs by the
engine); the device-local copies run on one auxiliary stream per direction; events
hand each slot back and forth. Staging memory is allocated once, per direction.

Where the native library is built (CUDA with its gather kernel, Ascend), one call into it plans
and enqueues a whole transfer (``run_native``). The Python planner (``plan``) and slice loop
(``run``) serve the rest (CPU, CUDA with Triton's gather), and ``plan`` is the reference the
native planners are tested against.
"""

from __future__ import annotations

import bisect
import functools
import logging
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from .copy.base import CopyPath, DescriptorRange, Direction, SliceRanges, as_direction
from .errors import OffloadConfigError
from .host_layout import HostLayout
from .plan import CopyPlanner, DescriptorBuffers, DescriptorPool, Descriptors
from .platform import Platform

logger = logging.getLogger(__name__)

DEFAULT_STAGING_BYTES = 256 * 1024 * 1024  # both directions together: 4 slots x 32 MiB each way
MAX_SLOTS = 4
MIN_SLOT_BYTES = 4 * 1024 * 1024  # smaller DMA copies lose link bandwidth (docs/benchmarks.md)
# The first slice (stores) / last slice (loads) is the part whose device-local copy the link
# does not hide, so it is small: 1/RAMP of the transfer, at least MIN_SLICE_BYTES (smaller
# DMA copies lose link bandwidth to their start-up). Later slices grow GROWTH-fold up to the
# slot size: slice i+1's gather (device memory, >= 4x the link's speed with the native kernel)
# then finishes while slice i is still on the link, and few slices keep per-slice costs low.
RAMP = 16
MIN_SLICE_BYTES = 512 * 1024
GROWTH = 4
SLICE_LAYOUTS = 128  # slice layouts kept per Stager, by (blocks, direction): about 17 bytes a block each


@dataclass(frozen=True)
class StagingGeometry:
    """How one direction's staging area is cut: ``slots`` slots of ``slot_blocks`` host records."""

    slots: int
    slot_blocks: int
    record_bytes: int

    @classmethod
    def for_area(cls, area_bytes: int, layout: HostLayout, key: str = "staging_bytes") -> "StagingGeometry":
        if area_bytes < layout.chunk_bytes:
            raise OffloadConfigError(
                f"kv_connector_extra_config[{key!r}] gives {area_bytes} bytes of device staging per direction "
                f"(half of the total), less than one host chunk ({layout.chunk_bytes} bytes = "
                f"{layout.blocks_per_chunk} blocks x {layout.record_bytes} bytes); use at least "
                f"{2 * layout.chunk_bytes}"
            )
        slot_min = max(layout.chunk_bytes, MIN_SLOT_BYTES)
        slots = max(1, min(MAX_SLOTS, area_bytes // slot_min))
        return cls(slots, area_bytes // slots // layout.record_bytes, layout.record_bytes)

    @property
    def area_bytes(self) -> int:
        return self.slots * self.slot_blocks * self.record_bytes


@dataclass(frozen=True)
class TableRange:
    """Pages of one slice in table form: every tensor pair of ``planner``'s table for blocks
    ``[block0, block0 + blocks)`` of the transfer's id arrays."""

    planner: CopyPlanner
    block0: int
    blocks: int


@dataclass(frozen=True)
class SliceLayout:
    """Where the blocks of an ``n``-block transfer go: slice ``i`` is blocks
    ``[edges[i], edges[i + 1])`` and fills slot ``i % slots`` from its start; ``pos`` is each
    block's staging record. A pure function of (n, direction), so the Stager keeps the last
    ``SLICE_LAYOUTS`` (transfer sizes repeat from step to step); the arrays are read-only."""

    edges: tuple[int, ...]
    edge_array: np.ndarray  # edges as int64
    first_of_slice: np.ndarray  # per block: whether a slice starts there (a link run must)
    pos: np.ndarray
    staging_addr: np.ndarray  # per block: where its staging record starts

    @property
    def n(self) -> int:
        return self.edges[-1]


@dataclass
class StagedPlan:
    """One transfer's copies; slice i copies its local part, then links ``link_bounds[i]:[i+1]``.

    The local part comes in one of two forms: per-page descriptors (``local`` and
    ``local_ranges``; any local path) or, for paths that address pages themselves from
    per-group pair tables, the transfer's block ids (``ids``: src ids then dst ids, ``n_ids``
    each, in one pinned buffer) and ``table_ranges``, which plans nothing per page.
    ``Stager.plan`` lays page descriptors block-major, slice after slice (``local_ranges`` is
    then a ``SliceRanges``: one contiguous range per slice); any ranges are accepted.
    """

    local: Descriptors | None  # device pages <-> staging positions
    local_ranges: Sequence[list[DescriptorRange]]  # per slice, the descriptors its gather/scatter copies
    link: Descriptors  # staging runs <-> host runs
    link_bounds: np.ndarray
    ids: DescriptorBuffers | None = None
    n_ids: int = 0
    table_ranges: list[list[TableRange]] | None = None
    local_bytes: int = 0
    pages: int = 0

    @property
    def num_slices(self) -> int:
        return len(self.link_bounds) - 1

    @property
    def total_bytes(self) -> int:
        return self.local.total_bytes if self.local is not None else self.local_bytes

    def __len__(self) -> int:
        return (len(self.local) if self.local is not None else self.pages) + len(self.link)

    @property
    def buffers(self) -> list[DescriptorBuffers]:
        return [b for b in (self.local.buffers if self.local is not None else self.ids, self.link.buffers)
                if b is not None]


@dataclass
class GroupBlocks:
    """One KV group's part of a transfer: its planner (device <-> staging) and block ids."""

    planner: CopyPlanner  # src/dst as the transfer goes: device->staging for stores
    span: tuple[int, int]  # [lo, hi) of a record that the group's tensors occupy
    device_ids: np.ndarray
    host_ids: np.ndarray


class Stager:
    """Device staging memory plus the slice pipeline, for one worker core."""

    def __init__(self, platform: Platform, layout: HostLayout, host_base: int, staging_bytes: int,
                 local_path: CopyPath, link_path: CopyPath, pool: DescriptorPool):
        self.platform = platform
        self.layout = layout
        self.host_base = host_base
        self.geometry = StagingGeometry.for_area(staging_bytes // 2, layout)
        self.local_path = local_path
        self.link_path = link_path
        self.pool = pool
        g = self.geometry
        self.buffer = torch.empty(2 * g.area_bytes, dtype=torch.uint8, device=platform.device)
        self.base = {Direction.D2H: self.buffer.data_ptr(), Direction.H2D: self.buffer.data_ptr() + g.area_bytes}
        self._aux = {d: platform.new_stream() for d in Direction}
        self._filled = {d: [platform.new_event() for _ in range(g.slots)] for d in Direction}
        self._drained = {d: [platform.new_event() for _ in range(g.slots)] for d in Direction}
        # the whole pipeline in one native call, where the local and link paths have one (else the loop)
        self._fused = local_path.fused_pipeline(link_path, g.slots)
        # the reference plan's form: block ids + pair tables (the CUDA pipeline's), else page descriptors
        self.table_form = bool(getattr(self._fused, "table_form", False))
        # the native pipeline plans transfers itself (host order, slices, ids or page descriptors, link runs)
        self.plans_natively = self._fused is not None
        # ... and checks both sides' block ids there, raising ValueError before anything is enqueued
        self.checks_ids = self.plans_natively and bool(getattr(self._fused, "checks_ids", False))
        # ... and takes the engine's stream order in the same call, where events have driver handles
        self.orders_natively = (self.plans_natively and bool(getattr(self._fused, "orders_natively", False))
                                and platform.raw_events)
        # the engine's ordered submit straight into the pipeline, no frame of the stager's between:
        # (transfer, stream, order) -> link copy count, where orders_natively (else None)
        self.submit_ordered = functools.partial(self._fused.submit_ordered, self) if self.orders_natively else None
        self.slice_layout = functools.lru_cache(maxsize=SLICE_LAYOUTS)(self._slice_layout)
        self._whole_record = (0, layout.pages_end)
        logger.info("staging: %.1f MiB on %s, %d slots x %d blocks per direction (local=%s, link=%s, pipeline=%s)",
                    self.buffer.numel() / 2**20, platform.kind, g.slots, g.slot_blocks,
                    local_path.name, link_path.name, "native" if self._fused is not None else "python")

    def prepare_tables(self, planners) -> None:
        """The native pipeline's pair tables of ``planners``, made before the first transfer."""
        if self._fused is not None:
            self._fused.prepare_tables(planners)

    def aux_streams(self) -> list:
        """The streams the gather/scatter runs on (one per direction)."""
        return list(self._aux.values())

    def staging_layouts(self, direction: Direction, tensor_ids: Sequence[int]):
        """Per tensor: where its pages sit in ``direction``'s staging area (record-strided)."""
        g = self.geometry
        return [self.layout.tensor_layout(self.base[direction], t, g.slots * g.slot_blocks) for t in tensor_ids]

    # -- planning ---------------------------------------------------------------------------
    def slice_sizes(self, n: int, direction: Direction) -> list[int]:
        """Blocks per slice for an ``n``-block transfer: a small unhidden slice (first for
        stores, last for loads), then slices growing GROWTH-fold up to the slot size; a
        remainder smaller than the first slice joins the slice before it when that fits."""
        g = self.geometry
        first = max(1, -(-MIN_SLICE_BYTES // g.record_bytes), -(-n // RAMP))
        sizes, cur, left = [], first, n
        while left > 0:
            take = min(cur, g.slot_blocks, left)
            if 0 < left - take < first and left <= g.slot_blocks:
                take = left
            sizes.append(take)
            left -= take
            cur *= GROWTH
        return sizes if as_direction(direction) is Direction.D2H else sizes[::-1]

    def _slice_layout(self, n: int, direction: Direction) -> SliceLayout:
        """The uncached ``slice_layout`` (memoised per (n, direction) in ``__init__``)."""
        g, edges, shift = self.geometry, [0], []
        sizes = self.slice_sizes(n, direction)
        for i, size in enumerate(sizes):
            shift.append((i % g.slots) * g.slot_blocks - edges[-1])
            edges.append(edges[-1] + size)
        pos = np.repeat(np.array(shift, np.int64), sizes)
        pos += np.arange(n, dtype=np.int64)
        edge_array = np.array(edges, np.int64)
        first = np.zeros(n, bool)
        first[edge_array[:-1]] = True
        addr = pos * self.layout.record_bytes + self.base[as_direction(direction)]
        for a in (edge_array, first, pos, addr):
            a.flags.writeable = False
        return SliceLayout(tuple(edges), edge_array, first, pos, addr)

    def plan(self, direction: Direction, groups: Sequence[GroupBlocks]) -> StagedPlan:
        direction = as_direction(direction)
        groups = [gb for gb in groups if len(gb.device_ids)]
        if not groups:
            raise ValueError("a staged transfer needs at least one block")
        firsts = [0]  # each group's first block in the transfer (then the total)
        for gb in groups:
            firsts.append(firsts[-1] + len(gb.device_ids))
        lay = self.slice_layout(firsts[-1], direction)
        local, ranges, ids, tables, nbytes, pages = None, [], None, None, 0, 0
        if self.table_form:
            ids, tables, nbytes, pages = self._plan_tables(direction, groups, lay)
        else:
            local, ranges = self._plan_pages(direction, groups, firsts, lay)
        try:
            link, link_bounds = self._plan_link(direction, groups, firsts, lay)
        except BaseException:
            self.pool.release([local.buffers if local is not None else ids])
            raise
        return StagedPlan(local, ranges, link, link_bounds, ids, lay.n, tables, nbytes, pages)

    def _group_slices(self, blk: int, k_g: int, edges: tuple[int, ...]):
        """(slice, first column, columns) of each slice that blocks [blk, blk + k_g) fall in."""
        for s_i in range(bisect.bisect_right(edges, blk) - 1, bisect.bisect_right(edges, blk + k_g - 1)):
            c0, c1 = max(edges[s_i], blk) - blk, min(edges[s_i + 1], blk + k_g) - blk
            yield s_i, c0, c1 - c0

    def _sides(self, direction: Direction, gb: GroupBlocks, p_ids: np.ndarray):
        return (gb.device_ids, p_ids) if direction is Direction.D2H else (p_ids, gb.device_ids)

    def _plan_pages(self, direction: Direction, groups: Sequence[GroupBlocks], firsts: list[int],
                    lay: SliceLayout) -> tuple[Descriptors, SliceRanges]:
        """Per-page descriptors, block-major within each group: a slice (a range of blocks) is one
        contiguous range of descriptors, handed to the pipeline as it lies (no reordering)."""
        widths = [len(gb.planner.pairs) for gb in groups]
        bufs = self.pool.acquire(sum(w * (b - a) for w, a, b in zip(widths, firsts, firsts[1:])))  # one per page
        at, nbytes, starts = 0, 0, []  # starts: each group's first descriptor
        try:
            for gb, a, b in zip(groups, firsts, firsts[1:]):
                starts.append(at)
                w, nb = gb.planner.plan_blocks_into(*self._sides(direction, gb, lay.pos[a:b]), bufs.src_np[at:],
                                                    bufs.dst_np[at:], bufs.sizes_np[at:])
                at += w
                nbytes += nb
        except BaseException:
            self.pool.release([bufs])
            raise
        if len(set(widths)) == 1:  # descriptors per block alike: an edge's first is edge x width
            bounds = lay.edge_array * widths[0]
        else:  # an edge in group g: g's first descriptor plus its blocks before the edge
            g = np.asarray(firsts[1:-1]).searchsorted(lay.edge_array, "right")
            bounds = np.asarray(starts)[g] + (lay.edge_array - np.asarray(firsts)[g]) * np.asarray(widths)[g]
        return bufs.head(at, nbytes), SliceRanges(bounds)

    def _plan_tables(self, direction: Direction, groups: Sequence[GroupBlocks], lay: SliceLayout):
        """Table form: the block ids of both sides, checked, in one pinned buffer; per slice, one
        range per group. Nothing per page: the kernel forms the addresses."""
        n = lay.n
        bufs = self.pool.acquire(-(-2 * n // 3))  # the (3, cap) rows hold [src ids | dst ids] flat
        flat = bufs.flat_np
        tables: list[list[TableRange]] = [[] for _ in range(len(lay.edges) - 1)]
        blk = nbytes = pages = 0
        try:
            for gb in groups:
                k_g = len(gb.device_ids)
                src, dst = gb.planner.check_ids(*self._sides(direction, gb, lay.pos[blk:blk + k_g]))
                flat[blk:blk + k_g], flat[n + blk:n + blk + k_g] = src, dst
                for s_i, c0, cols in self._group_slices(blk, k_g, lay.edges):
                    tables[s_i].append(TableRange(gb.planner, blk + c0, cols))
                nbytes += gb.planner.bytes_per_block * k_g
                pages += len(gb.planner.pairs) * k_g
                blk += k_g
        except BaseException:
            self.pool.release([bufs])
            raise
        return bufs, tables, nbytes, pages

    def _plan_link(self, direction: Direction, groups: Sequence[GroupBlocks], firsts: list[int],
                   lay: SliceLayout) -> tuple[Descriptors, np.ndarray]:
        """Link descriptors: runs of consecutive host blocks inside one slice and one group, and
        where each slice's runs start. A run of several records copies the records between its
        ends whole, so blocks merge only for a group whose span is the whole record. A store must
        not (where groups share chunks, layer groups, another group's pages in between hold its
        data on the host, not in this staging), and a load should not: it would move every other
        group's bytes too (G times the bytes for G layer groups); a partial span is one copy per
        block instead."""
        n, rec = lay.n, self.layout.record_bytes
        host = groups[0].host_ids if len(groups) == 1 else np.concatenate([gb.host_ids for gb in groups])
        brk = lay.first_of_slice.copy()  # a run ends with its slice
        brk[1:] |= host[1:] != host[:-1] + 1
        for a in firsts[1:-1]:
            brk[a] = True  # and with its group
        for gb, a, b in zip(groups, firsts, firsts[1:]):
            if gb.span != self._whole_record and gb.span[0] != gb.span[1]:
                brk[a:b] = True  # part of a record: every block is a copy of its own
        starts = brk.nonzero()[0]
        m = len(starts)
        lo, width = self._run_spans(groups, firsts, starts)
        bufs = self.pool.acquire(m)
        stg, hst = (bufs.src_np, bufs.dst_np) if direction is Direction.D2H else (bufs.dst_np, bufs.src_np)
        size = bufs.sizes_np[:m]
        lay.staging_addr.take(starts, out=stg[:m])
        if len(groups) > 1 or lo:
            stg[:m] += lo
        np.multiply(host[starts], rec, out=hst[:m])
        hst[:m] += lo + self.host_base
        np.subtract(starts[1:], starts[:-1], out=size[:-1])  # records per run
        size[-1] = n - starts[-1]
        size *= rec
        size += width - rec  # the last record of a run copies only the span
        nbytes = (n - m) * rec + (m * width if isinstance(width, int) else int(width.sum()))
        return bufs.head(m, nbytes), starts.searchsorted(lay.edge_array)

    @staticmethod
    def _run_spans(groups: Sequence[GroupBlocks], firsts: list[int], starts: np.ndarray):
        """(start, width) of the record span each run copies: its group's; ints when one fits all."""
        if len(groups) == 1:
            lo, hi = groups[0].span
            return lo, hi - lo
        g = np.asarray(firsts[1:-1]).searchsorted(starts, "right")  # each run's group
        lo = np.array([gb.span[0] for gb in groups], np.int64)[g]
        widths = {gb.span[1] - gb.span[0] for gb in groups}
        if len(widths) == 1:
            return lo, widths.pop()
        return lo, np.array([gb.span[1] - gb.span[0] for gb in groups], np.int64)[g]

    # -- execution ------------------------------------------------------------------------------
    def run(self, plan: StagedPlan, direction: Direction, stream: Any, link: bool = True) -> None:
        """Enqueue the whole pipeline of a page-form ``plan`` (the Python slice loop, where no native
        pipeline is); ``stream`` (the job's) ends after its last copy.

        Device-local copies are issued under the aux stream's context (one upload of the
        transfer's page descriptors, then one launch per slice); link copies and events
        name their stream explicitly, so no per-slice context switch is needed.
        ``link=False`` enqueues only the gather/scatter of every slice (benchmarks).
        """
        direction = as_direction(direction)
        aux = self._aux[direction]
        if not link:
            with self.platform.stream_context(stream):
                prepared = self.local_path.prepare(plan.local)
                for rngs in plan.local_ranges:
                    for rng in rngs:
                        self.local_path.copy_range(prepared, rng, direction, stream)
            return
        filled, drained = self._filled[direction], self._drained[direction]
        slots, lr, kb = self.geometry.slots, plan.local_ranges, plan.link_bounds.tolist()
        lk, local, link = plan.link, self.local_path, self.link_path
        store = direction is Direction.D2H
        with self.platform.stream_context(aux):
            # compute and earlier jobs first (the engine ordered ``stream``), loads too: ``prepare`` may
            # upload descriptors on aux (CUDA's gather path), which the library's pipelines keep behind the
            # model's mark as well (a load with inline ids uploads nothing, and skips this there)
            aux.wait_stream(stream)
            prepared = local.prepare(plan.local)
            for i in range(plan.num_slices):
                s = i % slots
                if i >= slots:  # the slot's previous slice must be through both copies
                    (aux if store else stream).wait_event(drained[s])
                if store:  # gather on aux, then DMA on the job stream
                    for rng in lr[i]:
                        local.copy_range(prepared, rng, direction, aux)
                    filled[s].record(aux)
                    stream.wait_event(filled[s])
                    link.copy(lk.src[kb[i]:kb[i + 1]], lk.dst[kb[i]:kb[i + 1]], lk.sizes[kb[i]:kb[i + 1]],
                              direction, stream, lk.buffers)
                    drained[s].record(stream)
                else:  # DMA on the job stream, then scatter on aux
                    link.copy(lk.src[kb[i]:kb[i + 1]], lk.dst[kb[i]:kb[i + 1]], lk.sizes[kb[i]:kb[i + 1]],
                              direction, stream, lk.buffers)
                    filled[s].record(stream)
                    aux.wait_event(filled[s])
                    for rng in lr[i]:
                        local.copy_range(prepared, rng, direction, aux)
                    drained[s].record(aux)
            if not store and plan.num_slices:
                stream.wait_event(drained[(plan.num_slices - 1) % slots])

    def aux_stream(self, direction: Direction) -> Any:
        """The stream ``direction``'s gathers/scatters run on."""
        return self._aux[direction]

    def native_geometry(self, direction: Direction) -> dict[str, int]:
        """What the native planner needs of this stager for ``direction`` (the slice constants are
        read at each call: tests patch them)."""
        g = self.geometry
        return {"slots": g.slots, "slot_blocks": g.slot_blocks, "record_bytes": g.record_bytes,
                "pages_end": self.layout.pages_end, "staging_base": self.base[direction], "host_base": self.host_base,
                "host_blocks": self.layout.num_blocks}

    def native_room(self, blocks: int, pages: int) -> int:
        """Descriptor rows of pinned room a natively planned transfer writes into: the block ids of
        both sides (table form; the three rows hold them flat), else its page descriptors and at most
        one link copy per block."""
        return -(-2 * blocks // 3) if self.table_form else pages + blocks

    @staticmethod
    def slice_constants() -> tuple[int, int, int]:
        """(MIN_SLICE_BYTES, RAMP, GROWTH) as they stand now (tests patch the module's values)."""
        return MIN_SLICE_BYTES, RAMP, GROWTH

    def run_native(self, transfer, stream: Any, link: bool = True, order=None) -> int:
        """Plan and enqueue a ``NativeStagedTransfer`` in one native call; its link copy count
        (``order``: the engine's raw stream order, where ``orders_natively``)."""
        return self._fused.submit(self, transfer, stream, self._aux[as_direction(transfer.direction)], link=link,
                                  order=order)

    def release(self) -> None:
        if self._fused is not None:
            self._fused.close()
            self._fused = None
            self.submit_ordered = None
        self.buffer = None
