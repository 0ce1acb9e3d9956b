"""Worker side of the simple CPU offload, independent of vLLM.

The scheduler (vLLM's, unchanged) hands the worker one load event and one store event
per step, each a flat list of block ids plus a monotonically increasing index, and a
map from load events to request ids. This module turns that into transfers with
three rules that the upstream and vLLM-Ascend ports broke:

1. Launch exactly once, from the step hooks (``launch(H2D)`` from ``start_load_kv``,
   ``launch(D2H)`` from ``wait_for_save``), never from ``collect`` (``get_finished``),
   which vLLM may call several times a step. An event index is accepted once; a
   re-bound or older index is ignored.
2. The load event -> request map is the worker's own, filled at ``bind`` and emptied
   only when that event's completion has been reported, so a load that finishes
   steps later is still reported even if the scheduler stops resending the mapping.
3. Completions come from the transfer engine's ``poll`` (the one completion plumbing of
   both connectors: locked, each job reported exactly once) and are applied on the engine
   thread; no list is iterated by one thread while another appends to it.

Every accepted event produces exactly one ``Completion``; a failed copy is a
completion with ``success=False`` (loads: requests reported with their device
blocks as load errors; stores: reported as failed, never as completed).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Mapping, Protocol, Sequence

import numpy as np

from .copy.backend import NPUDmaCopyBackend
from .copy.base import Direction
from .errors import OffloadConfigError
from .device_kv import DeviceKVTensor, GroupRef
from .offload_worker import OffloadWorkerCore
from .platform import Platform

logger = logging.getLogger(__name__)

NO_EVENT = -1


@dataclass(frozen=True)
class StepPlan:
    """One step's transfers, as the scheduler sent them (vLLM types stripped)."""

    load_event: int = NO_EVENT
    load_host_blocks: Sequence[int] = ()
    load_device_blocks: Sequence[int] = ()
    load_event_to_reqs: Mapping[int, Sequence[str]] = field(default_factory=dict)
    store_event: int = NO_EVENT
    store_device_blocks: Sequence[int] = ()
    store_host_blocks: Sequence[int] = ()
    need_flush: bool = False


@dataclass(frozen=True)
class Completion:
    direction: Direction
    event_idx: int
    success: bool
    error: str | None = None


class Transport(Protocol):
    """Moves blocks; every ``launch`` eventually yields one Completion from ``poll`` or ``flush``."""

    def launch(self, direction: Direction, event_idx: int, src_ids: Sequence[int], dst_ids: Sequence[int]) -> None: ...

    def poll(self) -> list[Completion]:
        """Non-blocking: completions of transfers finished since the last call, each once.
        Thread-safe: copies may finish on any thread."""

    def flush(self) -> list[Completion]:
        """Block until every launched transfer has finished; their completions not yet polled."""

    def shutdown(self) -> None: ...


@dataclass
class _LoadJob:
    req_ids: set[str]
    device_blocks: list[int]


@dataclass
class _Pending:
    event_idx: int
    src: Sequence[int]
    dst: Sequence[int]


@dataclass
class CoreStats:
    launched: int = 0
    completed: int = 0
    failed: int = 0
    ignored_completions: int = 0  # duplicate or unknown event: dropped, never reported twice
    ignored_binds: int = 0  # an event index seen before (metadata bound twice)


class SimpleOffloadCore:
    """Event bookkeeping for one worker. All methods run on the engine thread; the transport
    is the only thing copy threads touch."""

    def __init__(self, transport: Transport):
        self.transport = transport
        self._ready: list[Completion] = []  # polled or failed at launch, not applied yet
        self.stats = CoreStats()
        self._max_seen = {Direction.H2D: NO_EVENT, Direction.D2H: NO_EVENT}
        self._pending: dict[Direction, _Pending] = {}
        self._loads: dict[int, _LoadJob] = {}  # persistent event -> requests map
        self._stores: set[int] = set()
        self._finished_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self._load_error_blocks: set[int] = set()
        self._completed_stores: set[int] = set()
        self._failed_stores: set[int] = set()

    # -- step hooks ---------------------------------------------------------------------
    def bind(self, plan: StepPlan) -> None:
        """Register this step's events; launches nothing (except a leftover, see below)."""
        if self._pending:
            # A step whose start/save hook never ran: launch its work now rather than
            # leave device blocks pinned forever. Not expected with vLLM 0.32.
            logger.warning("simple offload: launching events %s whose step hook did not run",
                           {d.name: p.event_idx for d, p in self._pending.items()})
            self.launch_all()
        for ev, reqs in plan.load_event_to_reqs.items():
            job = self._loads.get(ev)
            if job is not None:  # only events in flight; stale resends are ignored
                job.req_ids.update(reqs)
        if plan.load_event != NO_EVENT and self._accept(Direction.H2D, plan.load_event):
            if len(plan.load_host_blocks) != len(plan.load_device_blocks):
                raise ValueError(
                    f"load event {plan.load_event}: {len(plan.load_host_blocks)} host blocks vs "
                    f"{len(plan.load_device_blocks)} device blocks"
                )
            reqs = set(plan.load_event_to_reqs.get(plan.load_event, ()))
            self._loads[plan.load_event] = _LoadJob(reqs, list(plan.load_device_blocks))
            self._pending[Direction.H2D] = _Pending(plan.load_event, plan.load_host_blocks, plan.load_device_blocks)
        if plan.store_event != NO_EVENT and self._accept(Direction.D2H, plan.store_event):
            if len(plan.store_host_blocks) != len(plan.store_device_blocks):
                raise ValueError(
                    f"store event {plan.store_event}: {len(plan.store_device_blocks)} device blocks vs "
                    f"{len(plan.store_host_blocks)} host blocks"
                )
            self._stores.add(plan.store_event)
            self._pending[Direction.D2H] = _Pending(plan.store_event, plan.store_device_blocks, plan.store_host_blocks)

    def _accept(self, direction: Direction, event_idx: int) -> bool:
        if event_idx <= self._max_seen[direction]:
            self.stats.ignored_binds += 1
            return False
        self._max_seen[direction] = event_idx
        return True

    def launch(self, direction: Direction) -> None:
        """Submit the bound event of ``direction`` if it has not been submitted yet."""
        p = self._pending.pop(Direction(direction), None)
        if p is None:
            return
        self.stats.launched += 1
        try:
            self.transport.launch(direction, p.event_idx, p.src, p.dst)
        except Exception as e:  # noqa: BLE001 - becomes a failed completion, never a hang
            logger.error("simple offload: %s event %d failed to launch: %s", direction.name, p.event_idx, e)
            self._ready.append(Completion(direction, p.event_idx, False, f"{type(e).__name__}: {e}"))

    def launch_all(self) -> None:
        for d in (Direction.H2D, Direction.D2H):
            self.launch(d)

    def flush(self) -> None:
        """Preemption: wait for all work, including bound work not submitted yet."""
        self.launch_all()
        self._ready += self.transport.flush()

    # -- reporting ----------------------------------------------------------------------
    def collect(self) -> tuple[set[str], set[str]]:
        """(finished_recving, failed_recving) since the last call. Safe to call any number of times."""
        ready, self._ready = self._ready + self.transport.poll(), []
        for c in ready:
            self._apply(c)
        fin, self._finished_recving = self._finished_recving, set()
        failed, self._failed_recving = self._failed_recving, set()
        return fin, failed

    def _apply(self, c: Completion) -> None:
        if c.direction is Direction.H2D:
            job = self._loads.pop(c.event_idx, None)
            if job is None:
                self.stats.ignored_completions += 1
                return
            if not job.req_ids:
                logger.warning("simple offload: load event %d finished but maps to no request", c.event_idx)
            self._finished_recving |= job.req_ids
            if not c.success:
                self._failed_recving |= job.req_ids
                self._load_error_blocks.update(job.device_blocks)
        else:
            if c.event_idx not in self._stores:
                self.stats.ignored_completions += 1
                return
            self._stores.discard(c.event_idx)
            (self._completed_stores if c.success else self._failed_stores).add(c.event_idx)
        self.stats.completed += 1
        if not c.success:
            self.stats.failed += 1
            logger.error("simple offload: %s event %d failed: %s", c.direction.name, c.event_idx, c.error)

    def take_load_errors(self) -> set[int]:
        """Device block ids whose load failed, since the last call."""
        out, self._load_error_blocks = self._load_error_blocks, set()
        return out

    def take_store_results(self) -> tuple[set[int], set[int]]:
        """(completed, failed) store events since the last call."""
        ok, self._completed_stores = self._completed_stores, set()
        bad, self._failed_stores = self._failed_stores, set()
        return ok, bad

    # -- introspection / teardown ------------------------------------------------------
    def in_flight(self) -> tuple[int, int]:
        """(loads, stores) accepted but not yet reported."""
        return len(self._loads), len(self._stores)

    def is_idle(self) -> bool:
        return not (self._loads or self._stores or self._pending or self._ready
                    or self._finished_recving or self._failed_recving or self._load_error_blocks
                    or self._completed_stores or self._failed_stores)

    def shutdown(self) -> None:
        self.flush()
        self.collect()
        self.transport.shutdown()


def _job_id(direction: Direction, event_idx: int) -> int:
    return event_idx * 2 + int(direction)


class CoreTransport:
    """Transport over the one worker core (``OffloadWorkerCore``) that NPUOffloadingSpec uses too.

    The simple scheduler hands block-granular host ids, so the core runs with one KV group
    (every segment) and one block per host chunk; host layout, planning, staging and the
    transfer engine are the same code for both connectors, on CUDA, NPU and CPU.
    """

    def __init__(self, core: OffloadWorkerCore):
        if core.blocks_per_chunk != 1 or core.num_groups != 1:
            raise OffloadConfigError(
                f"simple offload needs a core with 1 block per chunk and 1 group, got "
                f"{core.blocks_per_chunk} and {core.num_groups}"
            )
        self.core = core

    @classmethod
    def from_segments(cls, segments: Sequence[DeviceKVTensor], num_host_blocks: int, platform: Platform,
                      backend: NPUDmaCopyBackend | None = None, staging_bytes: int | None = None) -> "CoreTransport":
        """Each device segment's block ``b`` <-> host block ``b``'s slot for that segment."""
        if not segments:
            raise OffloadConfigError("simple offload: no KV cache segments to offload")
        if num_host_blocks <= 0:
            raise OffloadConfigError(f"simple offload: num_host_blocks must be > 0, got {num_host_blocks}")
        refs = [[GroupRef(i, s.page_bytes) for i, s in enumerate(segments)]]
        return cls(OffloadWorkerCore(segments, refs, 1, num_host_blocks, platform, backend, staging_bytes))

    # what callers and tests inspect
    platform = property(lambda self: self.core.platform)
    host = property(lambda self: self.core.host)
    backend = property(lambda self: self.core.backend)
    engine = property(lambda self: self.core.engine)

    def launch(self, direction: Direction, event_idx: int, src_ids, dst_ids) -> None:
        src = np.asarray(src_ids, dtype=np.int64)
        dev, host = (src, dst_ids) if direction is Direction.D2H else (dst_ids, src)
        self.core.submit(_job_id(direction, event_idx), direction, dev, [len(src)], [0], host)

    def poll(self) -> list[Completion]:
        return [Completion(r.direction, r.job_id // 2, r.success, r.error) for r in self.core.poll()]

    def flush(self) -> list[Completion]:
        self.core.engine.drain()
        return self.poll()

    def shutdown(self) -> None:
        self.core.shutdown()


# -- where the blocks live ---------------------------------------------------------------
