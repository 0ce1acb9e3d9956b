"""Worker side of layer-wise loads: one transfer per layer group, the forward waits per layer.

At the step's start every layer-wise load is submitted as one job per layer group (the core's
layer groups come after vLLM's KV group, see ``layer_groups``), group by group, on the core's load
stream; the end event of each group's last job is kept. Before a layer's attention,
``wait_layer`` makes the current (compute) stream wait on its group's event: a stream wait, never a
host sync, and by stream order it covers the groups before it too. If the step replays a FULL CUDA
graph (no hooks run), ``start`` makes the compute stream wait for every group at once.

At the step's end (after the whole forward is enqueued) ``finish`` waits on the host for the
step's copies, so that a failed group is known before vLLM accepts the step's tokens: every device
block of a load with a failed group is reported invalid (vLLM recomputes or fails the request).
So is every load of a step in which some layer group's layers never called ``wait_layer`` (their
attention may have read the blocks before they landed). Every load, failed or not, is reported done
so that the scheduler releases its host blocks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from ..copy.base import Direction
from .job_router import ResultRouter, own_ids
from .layer_groups import LayerGroups

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadJob:
    """One scheduler load job of the one KV group: device blocks, where the first sits in the
    request (``block_index``), host chunks."""

    job_id: int
    device_blocks: np.ndarray
    block_index: int
    chunks: np.ndarray


@dataclass
class StepOutcome:
    done: set[int] = field(default_factory=set)  # scheduler job ids finished this step
    invalid_blocks: set[int] = field(default_factory=set)  # device blocks whose KV is not to be trusted
    loaded: list[tuple[int, float]] = field(default_factory=list)  # (bytes, seconds) per successful load


@dataclass
class LayerwiseStats:
    """Since start-up, for a benchmark to see that the path ran (and how)."""

    loads: int = 0  # scheduler load jobs loaded layer by layer
    steps: int = 0  # steps that had some
    full_graph_steps: int = 0  # of those, steps replaying a FULL CUDA graph (waited for at the start)
    unwaited_steps: int = 0  # steps whose layers never waited for some group (loads reported invalid)
    failed_loads: int = 0  # loads reported invalid (failed copy or unwaited group)


class LayerwiseLoader:
    """Submits, orders and checks one step's layer-wise loads on ``router.core``."""

    def __init__(self, router: ResultRouter, layer_groups: LayerGroups, first_group: int):
        self.router = router
        self.core = router.core
        self.groups = layer_groups
        self.first_group = first_group  # core group of layer group 0 (after vLLM's KV groups)
        self._ids = own_ids()
        self._reset()
        self._warned = False
        self.stats = LayerwiseStats()

    def _reset(self) -> None:
        self._jobs: list[LoadJob] = []
        self._own: dict[int, LoadJob] = {}  # our core job id -> its scheduler load job
        self._failed: set[int] = set()  # scheduler jobs with a group that could not be submitted
        self._events: list[Any] = []  # per layer group: the end event to wait on (None: nothing left)
        self._waited = -1  # highest layer group the compute stream already waits for

    @property
    def active(self) -> bool:
        return bool(self._jobs)

    def _sizes(self, group: int, value: int) -> list[int]:
        out = [0] * (self.first_group + self.groups.count)
        out[self.first_group + group] = value
        return out

    def start(self, jobs: Sequence[LoadJob], full_graph: bool) -> None:
        """Submit ``jobs`` layer group by layer group; ``full_graph``: no hook will run this step."""
        self._jobs = list(jobs)
        self.stats.loads += len(self._jobs)
        self.stats.steps += 1
        self.stats.full_graph_steps += int(full_graph)
        last_event = None
        for g in range(self.groups.count):
            for job in self._jobs:
                own = next(self._ids)
                try:
                    self.core.submit(own, Direction.H2D, job.device_blocks, self._sizes(g, len(job.device_blocks)),
                                     self._sizes(g, job.block_index), job.chunks)
                except Exception:  # noqa: BLE001 - the request is recomputed, never run on this KV
                    logger.exception("layer-wise load job %d, layer group %d: submission failed", job.job_id, g)
                    self._failed.add(job.job_id)
                    continue
                self._own[own] = job
                event = self.core.engine.end_event(own)
                last_event = event if event is not None else last_event
            self._events.append(last_event)
        if full_graph:
            self.wait_group(self.groups.count - 1)

    def wait_group(self, group: int) -> None:
        """Make the compute stream wait for layer group ``group`` (and, by stream order, the ones before)."""
        if group <= self._waited or not self._jobs:
            return
        event = self._events[group]
        if event is not None:
            self.core.platform.current_stream().wait_event(event)
        self._waited = group

    def wait_layer(self, layer_name: str) -> None:
        group = self.groups.of_layer.get(layer_name)
        if group is not None:
            self.wait_group(group)

    def finish(self) -> StepOutcome:
        """After the step's forward is enqueued: wait for its copies, report done and invalid blocks."""
        out = StepOutcome()
        if not self._jobs:
            return out
        self.core.wait(list(self._own))
        results = self.router.take_own(self._own)
        failed = set(self._failed)
        moved: dict[int, tuple[int, float]] = {}
        for own, job in self._own.items():
            r = results.get(own)
            if r is None or not r.success:
                logger.error("layer-wise load job %d failed: %s", job.job_id, r.error if r else "no result")
                failed.add(job.job_id)
                continue
            nbytes, secs = moved.get(job.job_id, (0, 0.0))
            moved[job.job_id] = (nbytes + r.num_bytes, secs + r.seconds)
        if self._waited < self.groups.count - 1:
            if not self._warned:
                logger.error("layer-wise loads: the attention layers of layer groups %d.. never called "
                             "wait_for_layer_load this step, so their KV may have been read before it landed; "
                             "the step's layer-wise loads are reported invalid (recomputed)", self._waited + 1)
                self._warned = True
            self.stats.unwaited_steps += 1
            failed |= {job.job_id for job in self._jobs}
        for job in self._jobs:
            out.done.add(job.job_id)
            if job.job_id in failed:
                self.stats.failed_loads += 1
                out.invalid_blocks.update(int(b) for b in job.device_blocks)
            elif job.job_id in moved:
                out.loaded.append(moved[job.job_id])
        self._reset()
        return out


__all__ = ["LayerwiseLoader", "LayerwiseStats", "LoadJob", "StepOutcome"]
