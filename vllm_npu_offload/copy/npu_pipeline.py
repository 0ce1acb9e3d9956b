"""The staged slice pipeline on Ascend, planned and enqueued by one call into ``libnpu_offload_acl.so``.

Same schedule as ``Stager.run``'s Python loop (staging.py), but the plan and every slice's
gather/scatter, link copies and slot events go to ACL from C (``npu_offload_acl_staged_submit``,
which enqueues with ``npu_offload_acl_staged_run``): from Python each of those calls costs tens of
microseconds of the engine thread, per slice. Plans come in page-descriptor form
(``table_form = False``), as ``Stager.plan``'s, the reference they are tested against.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._native import acl
from ..errors import CopyError
from ..plan import CopyPlanner, address
from .base import Direction, as_direction


class AclStagedPipeline:
    """Plans and runs staged transfers in page-descriptor form for one stager; owns each direction's slot events
    (entry, filled[slots], drained[slots]), created once in the library, not torch_npu's.

    ``local`` and ``link`` are ``acl_copy.AclCopyPath``s over one library (the path makes its pipeline,
    so this module names neither it nor the layers above: a ``stager`` is the ``staging.Stager`` that
    owns this pipeline, a ``transfer`` a ``transfer.NativeStagedTransfer``)."""

    table_form = False  # the plan is page descriptors (Stager.plan's reference plan too)
    checks_ids = True  # the library checks the block ids of both sides (NPU_OFFLOAD_OUT_OF_RANGE: ValueError)

    def __init__(self, local: Any, link: Any, slots: int):
        self.local, self.link, self.slots = local, link, slots
        self.lib = local.lib
        self.events = {d: acl.create_events(1 + 2 * slots, self.lib) for d in Direction}
        self._tables: dict[int, tuple[CopyPlanner, np.ndarray, int]] = {}
        self._requests: dict[Direction, acl.StagedRequest] = {}
        self._groups: dict[Direction, tuple] = {}  # (the request's group slots, the planner each was filled for)

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
