"""The staged slice pipeline on Ascend, enqueued by one call into ``libnpu_offload_acl.so``.

Same schedule as ``Stager.run``'s Python loop (staging.py), but every slice's gather/scatter,
link copies and slot events go to ACL from C (``npu_offload_acl_staged_run``): from Python
each of those calls costs tens of microseconds of the engine thread, per slice.
Plans come in page-descriptor form (``table_form = False``): planned by the library itself in the
call that enqueues them (``npu_offload_acl_staged_submit``), or, with ``NPU_OFFLOAD_STAGE_PLAN=python``,
by ``Stager.plan``, whose slices this module lays out contiguously. ``NPU_OFFLOAD_STAGE_PIPELINE=python``
keeps the loop (the Stager decides, for every platform).
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from .._native import acl
from ..errors import CopyError
from ..plan import CopyPlanner, Descriptors, address
from .base import Direction, SliceRanges, as_direction

def slice_indices(local_ranges) -> tuple[np.ndarray, np.ndarray]:
    """(descriptor indices of every slice back to back, slice bounds into them), vectorised.

    Each ``DescriptorRange`` is ``rows`` runs of ``width`` consecutive descriptors; one list
    comprehension reads the ranges (a few per transfer: slices x groups; measured 0.8 us for 5
    ranges on a slow 2-core host, against ~40-60 us for the numpy calls), numpy does the rest.
    """
    per = np.fromiter((len(r) for r in local_ranges), np.int64, len(local_ranges))
    rg = np.array([(r.first, r.width, r.rows, r.stride) for rs in local_ranges for r in rs], np.int64).reshape(-1, 4)
    first, width, rows, stride = rg.T
    # one entry per row of every range: where it starts and how wide it is
    row_of = np.repeat(np.arange(len(rg)), rows)
    row_k = np.arange(len(row_of)) - np.repeat(np.cumsum(rows) - rows, rows)
    starts, widths = first[row_of] + row_k * stride[row_of], width[row_of]
    ends = np.cumsum(widths)
    idx = np.arange(ends[-1] if len(ends) else 0, dtype=np.int64) + np.repeat(starts - (ends - widths), widths)
    bounds = np.zeros(len(local_ranges) + 1, np.int64)
    np.cumsum(np.bincount(np.repeat(np.arange(len(per)), per), width * rows, len(per)).astype(np.int64),
              out=bounds[1:])
    return idx, bounds


def _by_slice(plan) -> "tuple[Descriptors, np.ndarray]":
    """The plan's page descriptors slice after slice, and the slice bounds in them: as they lie
    when the planner wrote them so (``SliceRanges``), else gathered from the ranges."""
    if isinstance(plan.local_ranges, SliceRanges):
        return plan.local, plan.local_ranges.bounds
    idx, bounds = slice_indices(plan.local_ranges)
    loc = plan.local
    return Descriptors(loc.src[idx], loc.dst[idx], loc.sizes[idx], loc.total_bytes), bounds


def _contiguous(d: "Descriptors") -> "Descriptors":
    """``d`` with C-contiguous int64 rows for the native call (``d`` itself when they are: always
    for a pooled set's heads, whose pointers are known)."""
    if d.addrs is not None:
        return d
    rows = (d.src, d.dst, d.sizes)
    out = tuple(np.ascontiguousarray(a, np.int64) for a in rows)
    return d if all(a is b for a, b in zip(out, rows)) else Descriptors(*out, d.total_bytes)


class AclStagedPipeline:
    """Runs page-descriptor staged plans for one stager; owns each direction's slot events
    (entry, filled[slots], drained[slots]), created once in the library, not torch_npu's.

    ``local`` and ``link`` are ``acl_copy.AclCopyPath``s over one library (the path makes its pipeline,
    so this module names neither it nor the layers above: a ``stager`` is the ``staging.Stager`` that
    owns this pipeline, a ``transfer`` a ``transfer.NativeStagedTransfer``)."""

    table_form = False  # Stager.plan hands over page descriptors and per-slice ranges
    plans_natively = True  # or, unless NPU_OFFLOAD_STAGE_PLAN=python, the library plans them itself
    checks_ids = True  # ... and checks the block ids of both sides (NPU_OFFLOAD_OUT_OF_RANGE: ValueError)

    def __init__(self, local: Any, link: Any, slots: int):
        self.local, self.link, self.slots = local, link, slots
        self.lib = local.lib
        self.events = {d: acl.create_events(1 + 2 * slots, self.lib) for d in Direction}
        self._tables: dict[int, tuple[CopyPlanner, np.ndarray, int]] = {}
        self._requests: dict[Direction, acl.StagedRequest] = {}
        self._groups: dict[Direction, tuple] = {}  # (the request's group slots, the planner each was filled for)

    def run(self, plan, direction: Direction, stream: Any, aux: Any, link: bool = True) -> None:
        """Enqueue ``plan``; ``link=False`` runs only the gather/scatter, on ``stream`` (benchmarks)."""
        direction = as_direction(direction)
        if plan.local is None:
            raise CopyError("staged run: the plan has no page descriptors (table form?)", "npu_offload_acl_staged_run")
        local, bounds = _by_slice(plan)
        bounds, link_bounds = np.ascontiguousarray(bounds, np.int64), np.ascontiguousarray(plan.link_bounds, np.int64)
        job = acl.StagedJob(
            int(direction is Direction.D2H), int(link), int(self.local.batch), 0, self.local.max_batch,
            self.local.stream_handle(stream), self.local.stream_handle(aux) if link else None,
            self.events[direction], self.slots, plan.num_slices,
            *_contiguous(local).pointers(), address(bounds), *_contiguous(plan.link).pointers(),
            address(link_bounds))
        acl.staged_run(job, self.lib)

    # -- native planning (npu_offload_acl_staged_submit) ---------------------------------------------
    def prepare_tables(self, planners) -> None:
        """Make every planner's host pair table now (the CUDA twin uploads its own at this point)."""
        for planner in planners:
            if planner is not None:
                self._table(planner)

    def _table(self, planner: CopyPlanner) -> int:
        """The address of ``planner``'s host pair table (made by ``prepare_tables``, kept with the planner)."""
        hit = self._tables.get(id(planner))
        if hit is None:  # the planner is kept alive with its table, so its id stays unique
            table = planner.pair_table()
            hit = self._tables[id(planner)] = (planner, table, address(table))
        return hit[2]

    def _request(self, stager: Any, direction: Direction) -> acl.StagedRequest:
        """``direction``'s request, made once (geometry, events, copy settings) and reused: the engine
        enqueues one transfer at a time, under its lock, on the engine thread."""
        req = self._requests.get(direction)
        if req is None:
            req = self._requests[direction] = acl.StagedRequest()
            geo = stager.native_geometry(direction)
            j = req.job
            j.store, j.batch, j.max_per_call = int(direction is Direction.D2H), int(self.local.batch), \
                self.local.max_batch
            j.events, j.slots = self.events[direction], geo["slots"]
            for k in ("slot_blocks", "record_bytes", "pages_end", "staging_base", "host_base", "host_blocks"):
                setattr(req, k, geo[k])
        return req

    def request(self, stager: Any, transfer: Any, stream: int, aux: int | None,
                link: bool = True) -> acl.StagedRequest:
        """The native request for ``transfer`` on raw streams ``stream`` / ``aux``."""
        d = as_direction(transfer.direction)
        req, store = self._request(stager, d), d is Direction.D2H
        hit = self._groups.get(d)
        if hit is None or len(hit[1]) < len(transfer.groups):
            n = max(4, len(transfer.groups))
            hit = self._groups[d] = ((acl.StagedGroup * n)(), [None] * n)
            req.groups = hit[0]
        groups, filled_for = hit
        for i, (planner, span, dev, host) in enumerate(transfer.groups):
            g = groups[i]
            if filled_for[i] is not planner:  # a slot's table, span and limit change with its group only
                g.pairs, g.n_pairs, g.span_lo, g.span_hi = self._table(planner), len(planner.pairs), span[0], span[1]
                g.device_limit = planner.src_limit if store else planner.dst_limit
                filled_for[i] = planner
            g.device_ids, g.host_ids, g.blocks = address(dev), address(host), len(dev)
        req.n_groups = len(transfer.groups)
        room = transfer.room
        req.out_src, req.out_dst, req.out_size = room.addrs
        req.capacity = room.capacity
        j = req.job
        # the stream handles are read for each call: reading one flushes torch_npu's task queue
        j.stream, j.aux, j.link = stream, aux, int(link)
        req.min_slice_bytes, req.ramp, req.growth = stager.slice_constants()
        return req

    def submit(self, stager: Any, transfer: Any, stream: Any, aux: Any,
               link: bool = True, order: None = None) -> int:
        """Plan and enqueue ``transfer`` in one call (``link=False``: only the gather/scatter, on
        ``stream``); its link copies."""
        if order is not None:  # orders_natively is False here: the engine keeps the order itself
            raise CopyError("the ACL pipeline does not take the engine's stream order", "npu_offload_acl_staged_submit")
        handle = self.local.stream_handle
        req = self.request(stager, transfer, handle(stream), handle(aux) if link else None, link)
        return acl.staged_submit(req, self.lib)[1]

    def plan_only(self, stager: Any, transfer: Any) -> dict[str, np.ndarray]:
        """The native plan of ``transfer`` without enqueueing it (tests compare it with Stager.plan;
        benchmarks time it): page and link descriptors (copies of the room's rows) and slice bounds."""
        n = sum(len(g[2]) for g in transfer.groups)
        bounds = np.zeros((2, n + 1), np.int64)
        out = acl.StagedPlanOut(address(bounds[0]), address(bounds[1]), n)
        acl.staged_plan(self.request(stager, transfer, 0, 0), out, self.lib)
        k, p, m, room = out.n_slices, out.n_local, out.n_links, transfer.room
        rows = {"src": room.src_np, "dst": room.dst_np, "size": room.sizes_np}
        res = {f"local_{key}": a[:p].copy() for key, a in rows.items()}
        res.update({f"link_{key}": a[p:p + m].copy() for key, a in rows.items()})
        res["local_bounds"], res["link_bounds"] = bounds[0, :k + 1], bounds[1, :k + 1]
        return res

    def close(self) -> None:
        for evs in self.events.values():
            acl.destroy_events(evs, self.lib)
        self.events = {}
        self._tables, self._requests, self._groups = {}, {}, {}  # the requests name the events
