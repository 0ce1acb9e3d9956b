"""The staged slice pipeline enqueued by one call into ``libnpu_offload_cuda.so``.

Same schedule as ``Stager.run`` (staging.py), but the descriptor upload, every
gather/scatter launch, link copy and slot event of a transfer go to the driver from C:
from Python each of those calls costs tens of microseconds, and on transfers of a few
MiB the device would spend that time waiting. ``NPU_OFFLOAD_STAGE_PIPELINE=python``
keeps the Python loop (for comparison in benchmarks).
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import torch

from .. import env
from ..errors import CopyError
from ..platform import Platform
from .base import Direction

_u64p = ctypes.POINTER(ctypes.c_uint64)
# 1: every gather of a store takes its block ids in its launch parameters, none uploaded (diagnosis)
ENV_INLINE_STORE_IDS = "NPU_OFFLOAD_STAGE_STORE_INLINE_IDS"


class StagedJob(ctypes.Structure):
    """Mirror of ``npo_staged_job`` in csrc_cuda/npo_cuda.h."""

    _fields_ = [
        ("store", ctypes.c_int), ("programs", ctypes.c_int), ("stream", ctypes.c_void_p), ("aux", ctypes.c_void_p),
        ("host_ids", _u64p), ("dev_ids", ctypes.c_uint64), ("n_ids", ctypes.c_uint64),
        ("min_page", ctypes.c_uint64), ("n_slices", ctypes.c_uint64), ("slots", ctypes.c_uint64),
        ("range_off", _u64p), ("ranges", _u64p), ("link_src", _u64p), ("link_dst", _u64p), ("link_size", _u64p),
        ("link_bounds", _u64p), ("events", ctypes.POINTER(ctypes.c_void_p)), ("skip_link", ctypes.c_int),
        ("inline_ids", ctypes.c_int),
    ]


def _ptr(a: np.ndarray):
    return a.ctypes.data_as(_u64p)


class CudaStagedPipeline:
    """Runs staged plans in table form for one stager: slot events per direction (created once)
    and each group planner's pair table on the device (uploaded at first use)."""

    table_form = True  # Stager.plan hands over block ids + pair tables, not page descriptors

    def __init__(self, lib, platform: Platform, slots: int, programs: "dict[Direction, int]", min_page: int):
        self.lib, self.platform, self.slots = lib, platform, slots
        self.programs, self.min_page = programs, min_page
        self.events = {d: lib.create_events(1 + 2 * slots) for d in Direction}
        self.inline_store_ids = bool(env.get(ENV_INLINE_STORE_IDS))
        self._tables: dict[int, tuple[Any, torch.Tensor]] = {}

    def _table(self, planner) -> torch.Tensor:
        hit = self._tables.get(id(planner))
        if hit is None:  # the planner is kept alive with its table, so its id stays unique
            table = torch.from_numpy(planner.pair_table()).to(self.platform.device)
            hit = self._tables[id(planner)] = (planner, table)
        return hit[1]

    def run(self, plan, direction: Direction, stream: Any, aux: Any, link: bool = True) -> None:
        """Enqueue ``plan``; ``link=False`` runs only the gather/scatter (benchmarks)."""
        if plan.table_ranges is None or plan.ids is None:
            raise CopyError("staged run: the plan is not in table form", "npo_cuda_staged_run")
        rows = [(self._table(r.planner).data_ptr(), len(r.planner.pairs), r.block0, r.blocks)
                for per in plan.table_ranges for r in per]
        rng = np.array(rows, np.uint64).reshape(-1, 4)
        off = np.zeros(plan.num_slices + 1, np.uint64)
        np.cumsum([len(per) for per in plan.table_ranges], out=off[1:])
        bounds = np.ascontiguousarray(plan.link_bounds, np.uint64)
        lk = [np.ascontiguousarray(a, np.int64) for a in (plan.link.src, plan.link.dst, plan.link.sizes)]
        ids = plan.ids
        if ids.device_cols is None:  # the set's device mirror: allocated once, reused with the set
            ids.device_cols = torch.empty(ids.packed.numel(), dtype=torch.int64, device=self.platform.device)
        job = StagedJob(
            int(Direction(direction) is Direction.D2H), self.programs[Direction(direction)],
            self.platform.raw_stream_handle(stream),
            self.platform.raw_stream_handle(aux), ctypes.cast(ids.packed.data_ptr(), _u64p), ids.device_cols.data_ptr(),
            plan.n_ids, self.min_page, plan.num_slices, self.slots, _ptr(off), _ptr(rng), *(_ptr(a) for a in lk),
            _ptr(bounds), self.events[direction], int(not link),
            int(self.inline_store_ids and Direction(direction) is Direction.D2H))
        self.lib.staged_run(job, rows=plan.pages)

    def close(self) -> None:
        for evs in self.events.values():
            self.lib.destroy_events(evs)
        self.events = {}
        self._tables = {}
