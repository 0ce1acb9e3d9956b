"""Ordered asynchronous transfers with exactly-once completion.

Per direction, transfers execute in submission order. They take a small ring of that
direction's streams in turn, each job after the previous one's end event: on one stream,
jobs of many page copies queued behind a long forward fill its hardware queue and the
engine thread blocks in the next enqueue (docs/benchmarks.md: 2.7 s per no-reuse round with
direct stores on one stream). The streams are created once (see ``Platform.new_stream``
for why they are never torch's pooled ones). Every job (loads too)
also waits for the compute stream, which closes both known races: a store reading KV
that the model is still writing, and a load overwriting a block that attention still
reads. A transfer that can (a staged one on CUDA, planned by the native library) takes that order
in its own native call: the compute-stream wait, the previous job's end and its start/end events,
with no torch call per transfer (the ordered branch of ``submit``). There a load waits for the compute stream
only in its scatters, the one step that writes KV pages: its link copies into the staging slots
overlap the model's step in flight (vLLM schedules asynchronously: that step may still use a block
the load reuses, so the scatters must not skip the wait). Completion is detected by polling end
events; each job is reported exactly once, with bytes and seconds, and a failed copy is reported
as ``success=False`` rather than raised (also when the device reports the error only at the job's
end event), so the caller can fail its requests instead of hanging.
A reported job's pooled buffers and events go back after the next submit's copies are on their
way (or at an idle poll): the poll that makes a completion visible does only what the caller needs.
Bad input that a native planner checks (a block id out of range) raises ValueError at submit, with
nothing enqueued, as the worker's own checks do.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Iterable, NamedTuple

from . import faults, stats
from .copy.base import Direction, as_direction
from .plan import DescriptorPool
from .platform import Platform
from .stats import TOTALS
from .transfer import Transfer


_DIRECTIONS = tuple(Direction)
_new_result = tuple.__new__
# Streams per direction that transfers take in turn. One stream's hardware queue holds about one job
# of many page copies, so a second job on it blocked the engine thread until the stream drained (2.7 s
# per no-reuse round of direct stores on an H200); with four per direction that time fell to what
# vLLM's native offload spends there (docs/benchmarks.md). Made once, when the engine starts.
TRANSFER_STREAMS = 4


class TransferResult(NamedTuple):
    """One finished transfer, as ``poll`` reports it (immutable; a named tuple: a frozen dataclass
    costs ~0.6 us more to build, on the poll that makes a completion visible)."""

    job_id: int
    direction: Direction
    success: bool
    num_bytes: int
    seconds: float
    num_descriptors: int = 0
    error: str | None = None

    @property
    def gbps(self) -> float:
        return self.num_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass(slots=True)
class _InFlight:
    job_id: int
    direction: Direction
    start: Any
    end: Any
    transfer: Transfer
    error: str | None = None
    submitted_at: float = 0.0  # perf_counter() at submit
    # the transfer's bytes and descriptors, read when the job is queued, after its copies were
    # enqueued (off the poll that reports it; a staged transfer knows its link copies only then)
    nbytes: int = field(init=False)
    descriptors: int = field(init=False)

    def __post_init__(self) -> None:
        self.nbytes, self.descriptors = self.transfer.total_bytes, len(self.transfer)


class TransferEngine:
    def __init__(self, platform: Platform, pool: DescriptorPool | None = None, streams: int = TRANSFER_STREAMS):
        """``streams``: per direction, how many streams transfers take in turn (tests vary it)."""
        self.platform = platform
        self.pool = pool or DescriptorPool(platform)
        self._faults = faults.active()  # None unless the test hook is set
        self._lock = threading.RLock()
        self._queues: dict[Direction, deque[_InFlight]] = {d: deque() for d in Direction}
        if streams < 1:
            raise ValueError(f"streams={streams}; a direction needs at least one")
        self._ring = streams
        # made now, not at a direction's first submit: making a stream is a driver call that may wait
        # for the device, and submit runs while the model's step does
        self._streams = {d: [platform.new_stream() for _ in range(self._ring)] for d in Direction}
        self._turn = {d: 0 for d in Direction}
        self._events: list[Any] = []
        self._job_ids: set[int] = set()
        self._done: dict[Direction, list[TransferResult]] = {d: [] for d in Direction}
        self._drained = 0  # results ``drain`` left in ``_done`` (the poll looks there only when some are)
        self._all_queues = tuple(self._queues[d] for d in _DIRECTIONS)
        self._retired: list[_InFlight] = []  # finished and reported, buffers and events not yet returned
        self._closed = False
        self._query = platform.completion_query()  # (start, end) -> None while pending, else seconds

    # -- submission -------------------------------------------------------------------
    def submit(self, job_id: int, transfer: Transfer) -> None:
        """Enqueue one transfer after the compute stream's work and this direction's earlier
        jobs. Never blocks on the device; a failed submit is reported by ``poll``. The
        transfer's pooled buffers go back to the pool once it has finished."""
        direction = transfer.direction
        if direction.__class__ is not Direction:  # ``as_direction`` inline: a frame less on the critical path
            direction = Direction(direction)
        t_submit = time.perf_counter()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"transfer engine is shut down; job {job_id} rejected")
            if job_id in self._job_ids:
                raise ValueError(f"job id {job_id} is already in flight")
            queue = self._queues[direction]
            ring = self._streams[direction]
            turn = self._turn[direction]
            stream = ring[turn % len(ring)]
            self._turn[direction] = turn + 1
            events = self._events
            start = events.pop() if events else self.platform.new_event()
            end = events.pop() if events else self.platform.new_event()
            prev = queue[-1] if queue else None
            if transfer.orders_itself:  # one native call: stream order, events and copies (inline: a frame less)
                after = None
                if prev is not None and len(ring) > 1:  # after the previous job's end (on another stream of the ring)
                    after = prev.end
                error = None
                try:
                    transfer.enqueue_ordered(stream, self.platform, start, end, after)
                except ValueError:  # bad input the library checks (a block id out of range): nothing enqueued
                    events.extend((start, end))
                    raise
                except Exception as e:  # noqa: BLE001 - becomes a failed result (the library recorded the end)
                    error = f"{type(e).__name__}: {e}"
                queue.append(_InFlight(job_id, direction, start, end, transfer, error, t_submit))
                self._job_ids.add(job_id)
                if self._retired:  # the copies are on their way: earlier jobs' bookkeeping now
                    self._retire()
                return
            compute = self.platform.current_stream()
            stream.wait_stream(compute)
            if prev is not None and len(ring) > 1:  # earlier jobs of this direction first (on other streams)
                stream.wait_event(prev.end)
            error = None
            # a transfer that names every stream itself skips torch's stream context (~10 us)
            with nullcontext() if transfer.names_streams else self.platform.stream_context(stream):
                start.record(stream)
                try:
                    transfer.enqueue(stream)
                except ValueError:  # bad input the library checks (a block id out of range): nothing enqueued
                    self._events.extend((start, end))
                    raise
                except Exception as e:  # noqa: BLE001 - becomes a failed result
                    error = f"{type(e).__name__}: {e}"
                end.record(stream)
            queue.append(_InFlight(job_id, direction, start, end, transfer, error, t_submit))
            self._job_ids.add(job_id)
            if self._retired:
                self._retire()

    def streams(self, direction: Direction) -> list[Any]:
        """The streams this direction's transfers take in turn (made when the engine starts)."""
        return self._streams[as_direction(direction)]

    def stream(self, direction: Direction) -> Any:
        """The stream this direction's next transfer takes."""
        with self._lock:
            return self._streams[as_direction(direction)][self._turn[direction] % self._ring]

    # -- completion -------------------------------------------------------------------
    def _seconds(self, item: _InFlight) -> float | None:
        """``_query`` of a job: None while it runs; a query that fails (the device reports an error
        at the job's end event) fails the job, reported like a failed copy rather than raised."""
        try:
            return self._query(item.start, item.end)
        except Exception as e:  # noqa: BLE001 - becomes a failed result
            return self._query_failed(item, e)

    @staticmethod
    def _query_failed(item: _InFlight, e: Exception) -> float:
        if item.error is None:
            item.error = f"{type(e).__name__}: {e}"
        return 0.0

    def _finish(self, item: _InFlight, seconds: float) -> TransferResult:
        """The result of a finished job (counted in the totals at once), ``seconds`` as ``_query``
        gave them; its buffers and events wait in ``_retired`` until ``_retire`` (after the next
        submit's copies are on their way, or a poll with nothing to report): the connector sees the
        completion first."""
        error = item.error
        if self._faults is not None and error is None and self._faults.hit(
                "load" if item.direction is Direction.H2D else "store"):
            error = "injected fault (NPU_OFFLOAD_FAULTS)"
        ev_err = getattr(item.end, "error", None)
        if error is None and ev_err is not None:
            error = f"{type(ev_err).__name__}: {ev_err}"
        wall = time.perf_counter() - item.submitted_at
        if seconds < 0:  # no span from the events (``drain``): from submit to now, an upper bound of the copies'
            seconds = wall
        self._job_ids.discard(item.job_id)
        ok = error is None
        nbytes = item.nbytes
        # ``TOTALS.record`` inline (a frame less): folded when read, or at ``_retire`` past FOLD_EVERY
        TOTALS.pending.append((item.direction is Direction.H2D, ok, nbytes, seconds, wall))
        self._retired.append(item)
        # tuple.__new__: the named tuple's own __new__ is a Python function, a frame on this poll
        return _new_result(TransferResult, (item.job_id, item.direction, ok, nbytes if ok else 0, seconds,
                                            item.descriptors, error))

    def _retire(self) -> None:
        """Return reported jobs' buffers to the pool and their events to the free list."""
        retired, self._retired = self._retired, []
        if len(TOTALS.pending) > stats.FOLD_EVERY:
            TOTALS.fold()
        for item in retired:
            self.pool.release(item.transfer.buffers)
            self._events.extend((item.start, item.end))

    def poll(self, direction: Direction | None = None) -> list[TransferResult]:
        """Results of transfers that finished since the last call, each exactly once; only
        ``direction``'s when given (the other's stay for their own poll: vLLM 0.21-0.24 polls a
        handler per direction)."""
        with self._lock:
            out: list[TransferResult] = []
            if self._drained:
                for d in (as_direction(direction),) if direction is not None else _DIRECTIONS:
                    self._drained -= len(self._done[d])
                    out += self._done[d]
                    self._done[d] = []
            query = self._query
            for q in (self._queues[as_direction(direction)],) if direction is not None else self._all_queues:
                while q:
                    item = q[0]
                    try:  # ``_seconds`` inline: a frame less on the poll that makes a completion visible
                        seconds = query(item.start, item.end)
                    except Exception as e:  # noqa: BLE001 - becomes a failed result
                        seconds = self._query_failed(item, e)
                    if seconds is None:
                        break
                    out.append(self._finish(q.popleft(), seconds))
            if not out and self._retired:
                self._retire()
            return out

    def _end_events(self, job_ids: set[int]) -> list[Any]:
        """End events of the given jobs still in flight."""
        with self._lock:
            return [it.end for q in self._queues.values() for it in q if it.job_id in job_ids]

    def wait(self, job_ids: Iterable[int]) -> None:
        """Block until the given jobs (and, by ordering, those before them) have finished."""
        for ev in self._end_events(set(job_ids)):
            ev.synchronize()

    def end_event(self, job_id: int) -> Any | None:
        """The event a job's stream records after its last copy, while the job is in flight (None
        once it has been reported): a consumer that must not read the KV before the copy lands
        makes its own stream wait on it (a stream wait, not a host sync; layer-wise loads)."""
        ends = self._end_events({job_id})
        return ends[0] if ends else None

    def in_flight(self) -> int:
        with self._lock:
            return sum(len(q) for q in self._queues.values())

    def drain(self) -> None:
        """Wait for everything submitted so far; results stay available to ``poll``."""
        with self._lock:
            items = {id(it): it for q in self._queues.values() for it in q}
        for it in items.values():
            it.end.synchronize()
        with self._lock:
            for q in self._queues.values():
                while q and id(q[0]) in items:  # not a job submitted meanwhile
                    item = q.popleft()
                    seconds = self._seconds(item)  # done: its end was waited for above
                    self._done[item.direction].append(self._finish(item, -1.0 if seconds is None else seconds))
                    self._drained += 1
            self._retire()

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
        self.drain()
        with self._lock:
            self._closed = True
