"""The staged slice pipeline planned and enqueued by one call into ``libnpu_offload_cuda.so``.

Same schedule as ``Stager.run`` (staging.py), but the plan, the block-id upload, every
gather/scatter launch, link copy and slot event of a transfer go to the driver from C:
from Python each of those calls costs tens of microseconds, and on transfers of a few
MiB the device would spend that time waiting.
"""

from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..plan import address
from ..platform import Platform
from .base import Direction, as_direction

_u64p = ctypes.POINTER(ctypes.c_uint64)
_addressof, _from_buffer = ctypes.addressof, ctypes.c_char.from_buffer


class StagedJob(ctypes.Structure):
    """Mirror of ``npo_staged_job`` in csrc_cuda/npo_cuda.h (a request's streams, ids and events)."""

    _fields_ = [
        ("store", ctypes.c_int), ("programs", ctypes.c_int), ("stream", ctypes.c_void_p), ("aux", ctypes.c_void_p),
        ("host_ids", ctypes.c_void_p), ("dev_ids", ctypes.c_uint64), ("n_ids", ctypes.c_uint64),
        ("min_page", ctypes.c_uint64), ("n_slices", ctypes.c_uint64), ("slots", ctypes.c_uint64),
        ("range_off", _u64p), ("ranges", _u64p), ("link_src", _u64p), ("link_dst", _u64p), ("link_size", _u64p),
        ("link_bounds", _u64p), ("events", ctypes.POINTER(ctypes.c_void_p)), ("skip_link", ctypes.c_int),
    ]


class StagedGroup(ctypes.Structure):
    """Mirror of ``npo_staged_group``."""

    _fields_ = [("table", ctypes.c_uint64), ("pairs", ctypes.c_uint64), ("span_lo", ctypes.c_uint64),
                ("span_hi", ctypes.c_uint64), ("device_ids", ctypes.c_void_p), ("host_ids", ctypes.c_void_p),
                ("blocks", ctypes.c_uint64), ("device_limit", ctypes.c_uint64)]


class StagedRequest(ctypes.Structure):
    """Mirror of ``npo_staged_request``: a staged transfer the library plans and enqueues."""

    _fields_ = [("job", StagedJob), ("ids_capacity", ctypes.c_uint64), ("groups", ctypes.POINTER(StagedGroup)),
                ("n_groups", ctypes.c_uint64)] + [(name, ctypes.c_uint64) for name in (
                    "slot_blocks", "record_bytes", "pages_end", "staging_base", "host_base", "host_blocks",
                    "min_slice_bytes", "ramp", "growth")] + [(name, ctypes.c_void_p) for name in (
                        "compute", "compute_mark", "after", "start", "end")]


class StagedPlanOut(ctypes.Structure):
    """Mirror of ``npo_staged_plan_out`` (the plan alone, for tests and benchmarks)."""

    _fields_ = [(name, _u64p) for name in ("range_off", "ranges", "link_src", "link_dst", "link_size",
                                           "link_bounds")] + [
        (name, ctypes.c_uint64) for name in ("cap_slices", "cap_ranges", "cap_links", "n_slices", "n_ranges",
                                             "n_links")]


@dataclass(slots=True, eq=False)
class _Lane:
    """One direction's reused request and what it was last filled with."""

    req: StagedRequest
    store: bool
    groups: Any = None  # the request's group slots (a ctypes array)
    slots: list = field(default_factory=list)  # its elements, made once (indexing the array makes a new one)
    filled_for: list = field(default_factory=list)  # the planner each slot was filled for
    room: Any = None
    streams: tuple = (None, None)
    link: bool = True
    consts: tuple = ()
    constants: Any = None  # the module whose MIN_SLICE_BYTES, RAMP and GROWTH the stager's slices follow
    # ``lib.staged_submitter(req)``: the native call with its arguments bound, its link count and message
    call: Any = None
    links: Any = None
    msg: Any = None


def _ptr(a: np.ndarray):
    return a.ctypes.data_as(_u64p)


class CudaStagedPipeline:
    """Plans and runs staged transfers in table form for one stager: slot events per direction
    (created once) and each group planner's pair table on the device (uploaded at the start)."""

    table_form = True  # the plan is block ids + pair tables (Stager.plan's reference plan too), no page descriptors
    orders_natively = True  # the library takes the engine's stream order and events in the same call
    checks_ids = True  # ... and checks the block ids of both sides (NPO_ERR_RANGE: ValueError)

    def __init__(self, lib, platform: Platform, slots: int, programs: "dict[Direction, int]", min_page: int):
        self.lib, self.platform, self.slots = lib, platform, slots
        self.programs, self.min_page = programs, min_page
        # the pipeline's entry and slot events, then the mark of the model's stream (its own: a load's
        # scatters wait for it after the entry has been recorded again)
        self.events = {d: lib.create_events(2 + 2 * slots) for d in Direction}
        lib.gather_load()  # at the worker's start: loading the kernel at a first launch waited out a model step
        self._tables: dict[int, tuple[Any, torch.Tensor, int]] = {}
        self._lanes: dict[Direction, _Lane] = {}
        self._raw: dict[int, tuple[Any, int]] = {}  # id(stream) -> (stream, its raw handle)
        # per direction, id(stream) -> (stream, its raw handle, its aux's): submit_ordered's
        self._ordered: dict[Direction, dict[int, tuple[Any, int, int]]] = {d: {} for d in Direction}
        self._marks = {d: self.events[d][1 + 2 * slots] for d in Direction}

    def prepare_tables(self, planners) -> None:
        """Upload every planner's pair table now, at the worker's start: the upload is a pageable
        copy on the current stream, which waits for the model's stream, so made at a transfer's
        first use it stalled that submit until the step in flight ended (~200 ms behind a 200 ms
        kernel, measured on an H200)."""
        for planner in planners:
            if planner is not None:
                self._table(planner)

    def _table(self, planner) -> int:
        """The device address of ``planner``'s pair table (uploaded by ``prepare_tables``; a planner
        it was not given, at its first use)."""
        hit = self._tables.get(id(planner))
        if hit is None:  # the planner is kept alive with its table, so its id stays unique
            table = torch.from_numpy(planner.pair_table()).to(self.platform.device)
            hit = self._tables[id(planner)] = (planner, table, table.data_ptr())
        return hit[2]

    def _device_ids(self, bufs, stream: Any) -> int:
        """The device address the pinned buffer ``bufs``'s block ids are uploaded to: the set's
        device mirror, allocated at its first use and reused with the set. Allocated on ``stream``
        (one of ours): torch's allocator hands a stream only blocks freed on that same stream, so
        the mirror is never memory the model's stream freed while a kernel of its step in flight
        still reads it (made on the model's stream, a load's ids written at once crashed vLLM 0.23's
        serving; a load still writes them after the model's mark: npo_staged_run_job)."""
        addr = bufs.device_addr
        if not addr:
            with self.platform.stream_context(stream):
                bufs.device_cols = torch.empty(3 * bufs.capacity, dtype=torch.int64, device=self.platform.device)
            addr = bufs.device_addr = bufs.device_cols.data_ptr()
        return addr

    # -- native planning (npo_cuda_staged_submit) ------------------------------------------------
    def _lane(self, stager, d: Direction) -> "_Lane":
        """``d``'s reused request, its fields fixed for the stager's life written once."""
        lane = self._lanes.get(d)
        if lane is None:
            req = StagedRequest()
            geo = stager.native_geometry(d)
            j = req.job
            j.store, j.programs, j.min_page = int(d is Direction.D2H), self.programs[d], self.min_page
            j.slots = geo["slots"]
            j.events = self.events[d]
            for k in ("slot_blocks", "record_bytes", "pages_end", "staging_base", "host_base", "host_blocks"):
                setattr(req, k, geo[k])
            req.compute_mark = self._marks[d]
            lane = self._lanes[d] = _Lane(req, d is Direction.D2H, constants=sys.modules[stager.slice_constants.__module__])
            lane.call, lane.links, lane.msg = self.lib.staged_submitter(req)
        return lane

    def request(self, stager, transfer, stream: int, aux: int, link: bool = True) -> StagedRequest:
        """The native request for ``transfer`` on raw streams ``stream`` / ``aux`` (one request per
        direction, reused: the engine enqueues one transfer at a time, under its lock). Only what
        changed since the direction's last transfer is written: on the engine thread each ctypes
        field costs ~0.1-0.2 us, and the request sits on the transfer's critical path."""
        lane = self._lanes.get(transfer.direction) or self._lane(stager, as_direction(transfer.direction))
        req = lane.req
        tg = transfer.groups
        if len(lane.filled_for) < len(tg):
            n = max(4, len(tg))
            lane.groups, lane.filled_for = (StagedGroup * n)(), [None] * n
            lane.slots = list(lane.groups)
            req.groups = lane.groups
        slots, filled_for = lane.slots, lane.filled_for
        for i, (planner, span, dev, host) in enumerate(tg):
            g = slots[i]
            if filled_for[i] is not planner:  # a slot's table, span and limit change with its group only
                g.table, g.pairs, g.span_lo, g.span_hi = self._table(planner), len(planner.pairs), *span
                g.device_limit = planner.src_limit if lane.store else planner.dst_limit  # the library checks the ids
                filled_for[i] = planner
            try:  # plan.address inline (two frames less on the critical path); it for what this refuses
                g.device_ids, g.host_ids = _addressof(_from_buffer(dev)), _addressof(_from_buffer(host))
            except (TypeError, ValueError, BufferError):
                g.device_ids, g.host_ids = address(dev), address(host)
            g.blocks = len(dev)
        if req.n_groups != len(tg):
            req.n_groups = len(tg)
        ids = transfer.room
        if lane.room is not ids:  # the pool hands the set released last: mostly the same one
            j = req.job
            j.host_ids, j.dev_ids = ids.addrs[0], self._device_ids(ids, stager.aux_stream(transfer.direction))
            req.ids_capacity = 3 * ids.capacity
            lane.room = ids
        if lane.streams != (stream, aux):
            req.job.stream, req.job.aux = stream, aux
            lane.streams = (stream, aux)
        if lane.link != link:
            req.job.skip_link = 0 if link else 1
            lane.link = link
        m = lane.constants  # ``stager.slice_constants()`` without its frame: the module's values, read each time
        consts = (m.MIN_SLICE_BYTES, m.RAMP, m.GROWTH)
        if lane.consts != consts:  # (tests patch them)
            req.min_slice_bytes, req.ramp, req.growth = lane.consts = consts
        return req

    def _raw_handle(self, stream: Any) -> int:
        """``stream``'s raw handle, kept with the stream (the engine's ring and the aux streams live as
        long as the worker; reading a torch stream's handle costs a C++ property call each time)."""
        hit = self._raw.get(id(stream))  # held with its entry, so no other stream takes its id meanwhile
        if hit is None:
            if len(self._raw) >= 64:  # a compute stream may come as a new object each time: stay small
                self._raw.clear()
            hit = self._raw[id(stream)] = (stream, self.platform.raw_stream_handle(stream))
        return hit[1]

    def submit_ordered(self, stager, transfer, stream: Any, order) -> int:
        """``submit`` with the engine's order, the transfer's aux the direction's own (as where the
        stager orders natively): one frame from the transfer to the request, the raw handles of a
        stream and its aux looked up together (this is on every transfer's critical path)."""
        by_stream = self._ordered[transfer.direction]
        hit = by_stream.get(id(stream))  # held with its entry, so no other stream takes its id meanwhile
        if hit is None:
            if len(by_stream) >= 64:
                by_stream.clear()
            aux = stager.aux_stream(transfer.direction)
            hit = by_stream[id(stream)] = (stream, self.platform.raw_stream_handle(stream),
                                           self.platform.raw_stream_handle(aux))
        req = self.request(stager, transfer, hit[1], hit[2])
        req.compute, req.after, req.start, req.end = order
        lane = self._lanes[transfer.direction]
        rc = lane.call()  # ``lib.staged_submit`` without its frame and its thread-local lookup
        if rc:
            self.lib.staged_failed(rc, lane.msg)
        return lane.links.value

    def submit(self, stager, transfer, stream: Any, aux: Any, link: bool = True, order=None) -> int:
        """Plan and enqueue ``transfer`` (a ``NativeStagedTransfer``) in one call; its link copies.
        ``order``: the engine's (compute stream, previous end, start, end) as raw handles (0: none),
        waited for and recorded in the same call."""
        req = self.request(stager, transfer, self._raw_handle(stream), self._raw_handle(aux), link)
        if order is None:
            req.compute = req.after = req.start = req.end = None
        else:
            req.compute, req.after, req.start, req.end = order
        return self.lib.staged_submit(req)

    def model_mark(self, direction: Direction):
        """The event that marks the model's stream for a natively ordered transfer (the last one)."""
        return self._marks[as_direction(direction)]

    def plan_only(self, stager, transfer) -> dict[str, np.ndarray]:
        """The native plan of ``transfer`` without enqueueing it (tests compare it with Stager.plan):
        the ids (written into its pinned buffer), per-slice table ranges and link copies."""
        req = self.request(stager, transfer, 0, 0)
        n = sum(len(g[2]) for g in transfer.groups)
        cap_ranges = n * max(1, len(transfer.groups))
        arrays = {"range_off": np.zeros(n + 1, np.uint64), "ranges": np.zeros(4 * cap_ranges, np.uint64),
                  "link_src": np.zeros(n, np.uint64), "link_dst": np.zeros(n, np.uint64),
                  "link_size": np.zeros(n, np.uint64), "link_bounds": np.zeros(n + 1, np.uint64)}
        out = StagedPlanOut(*(_ptr(a) for a in arrays.values()), n, cap_ranges, n)
        self.lib.staged_plan(req, out)
        k, m, r = out.n_slices, out.n_links, out.n_ranges
        res = {"range_off": arrays["range_off"][:k + 1], "ranges": arrays["ranges"][:4 * r].reshape(-1, 4),
               "link_bounds": arrays["link_bounds"][:k + 1]}
        for key in ("link_src", "link_dst", "link_size"):
            res[key] = arrays[key][:m]
        res["ids"] = transfer.room.flat_np[:2 * n].copy()
        return res

    def close(self) -> None:
        for evs in self.events.values():
            self.lib.destroy_events(evs)
        self.events = {}
        self._tables, self._lanes, self._raw = {}, {}, {}  # the requests name the events
        self._ordered = {d: {} for d in Direction}
