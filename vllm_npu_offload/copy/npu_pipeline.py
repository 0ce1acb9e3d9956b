"""The staged slice pipeline on Ascend, enqueued by one call into ``libnpu_offload_acl.so``.

Same schedule as ``Stager.run``'s Python loop (staging.py), but every slice's gather/scatter,
link copies and slot events go to ACL from C (``npu_offload_acl_staged_run``): from Python
each of those calls costs tens of microseconds of the engine thread, per slice.
Plans come in page-descriptor form (``table_form = False``); this module only lays each
slice's descriptors out contiguously. ``NPU_OFFLOAD_STAGE_PIPELINE=python`` keeps the loop
(the Stager decides, for every platform).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from .._native import acl
from ..errors import CopyError
from ..plan import Descriptors, address
from .base import Direction, SliceRanges, as_direction

if TYPE_CHECKING:
    from .acl_copy import AclCopyPath

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
    (entry, filled[slots], drained[slots]), created once in the library, not torch_npu's."""

    table_form = False  # Stager.plan hands over page descriptors and per-slice ranges

    def __init__(self, local: "AclCopyPath", link: "AclCopyPath", slots: int):
        self.local, self.link, self.slots = local, link, slots
        self.lib = local.lib
        self.events = {d: acl.create_events(1 + 2 * slots, self.lib) for d in Direction}

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

    def close(self) -> None:
        for evs in self.events.values():
            acl.destroy_events(evs, self.lib)
        self.events = {}
