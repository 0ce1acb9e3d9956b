"""Scheduler side of layer-wise loads: which hits go synchronous, and their completion.

vLLM's ``OffloadingConnectorScheduler`` stays in charge of lookups, pinning and the load job
itself; this object only (1) turns a qualifying hit into ``(n, False)``, so vLLM schedules the rest
of the prompt in the same step, (2) shows upstream's ``update_state_after_alloc`` the hit's blocks as
not yet computed (vLLM already hashed them: ``compat.unhashed_view``), (3) takes the load job it
created out of upstream's books (docs/layerwise.md: upstream would trip on a running request with a
pending load), (4) names the step's layer-wise jobs in the connector metadata, and (5) releases the
job's host blocks once every worker reported it finished, which each does at the end of the step
that computed it (``LayerwiseWorkerMetadata.layerwise_done``), failed or not. In ``auto`` mode a hit
goes layer by layer only while no other request is running: the requests the last step scheduled,
less those finished since (``finished``), are the ones a piecewise loading step would delay.
"""

from __future__ import annotations

import logging

from . import compat
from .layerwise_meta import LayerwiseConnectorMetadata
from .layerwise_policy import sync_hit
from .options import LayerwiseOptions

logger = logging.getLogger(__name__)


class LayerwiseScheduler:
    """Layer-wise bookkeeping beside upstream's ``OffloadingConnectorScheduler`` (``upstream``)."""

    def __init__(self, upstream, opts: LayerwiseOptions):
        self.upstream = upstream
        self.opts = opts
        self.block_tokens = compat.offloaded_block_tokens(upstream)
        self.device_block_tokens = compat.engine_block_tokens(upstream)
        self._flagged: dict[str, int] = {}  # requests told (n, False) -> their local hit, until allocation
        self._step: set[int] = set()  # layer-wise jobs of the step being scheduled
        self._pending: dict[int, compat.TakenLoad] = {}  # shipped, not yet reported by every worker
        self._running: set[str] = set()  # the last step's requests, less those finished since (auto)
        self.auto_declined = 0  # auto: qualifying hits left asynchronous because others were running

    @property
    def pending(self) -> dict[int, compat.TakenLoad]:
        return self._pending

    def matched(self, request, num_computed_tokens: int, hit: int | None, is_async: bool) -> tuple[int | None, bool]:
        """``get_num_new_matched_tokens``'s answer, made synchronous where the hit qualifies."""
        self._flagged.pop(request.request_id, None)
        if not hit or not is_async:
            return hit, is_async
        n = sync_hit(request.num_tokens, num_computed_tokens, hit, self.block_tokens, self.opts.min_tokens,
                     trim=not compat.hit_end_is_pinned(self.upstream, request.request_id),
                     min_left=self.opts.min_new_tokens)
        if n is None:
            return hit, is_async
        if self.opts.auto and self._running - {request.request_id}:
            self.auto_declined += 1
            return hit, is_async
        self._flagged[request.request_id] = num_computed_tokens
        return n, False

    def before_alloc(self, request, blocks, num_external_tokens: int):
        """The ``blocks`` upstream's ``update_state_after_alloc`` must see for this request."""
        local = self._flagged.get(request.request_id)
        if local is None or num_external_tokens <= 0:
            return blocks
        bt = self.device_block_tokens
        return compat.unhashed_view(blocks, local // bt, -(-(local + num_external_tokens) // bt))

    def jobs_before_alloc(self) -> set[int]:
        return set(compat.batch_load_jobs(self.upstream))

    def after_alloc(self, request, before: set[int]) -> None:
        """Take the load job that ``update_state_after_alloc`` just made for a flagged request."""
        if self._flagged.pop(request.request_id, None) is None:
            return
        for job_id, entry in compat.batch_load_jobs(self.upstream).items():
            if job_id not in before and entry.req_id == request.request_id:
                self._pending[job_id] = compat.take_load_job(self.upstream, job_id)
                self._step.add(job_id)

    def ship(self, meta, scheduler_output) -> LayerwiseConnectorMetadata:
        """This step's metadata, naming its layer-wise jobs."""
        jobs, self._step = self._step, set()
        self._running = compat.scheduled_request_ids(scheduler_output)
        if jobs:
            compat.mark_sync_loads(scheduler_output)
        return LayerwiseConnectorMetadata.extend(meta, jobs)

    def on_output(self, worker_meta) -> None:
        """Release what every worker finished (the step's forward has returned)."""
        for job_id, count in (getattr(worker_meta, "layerwise_done", None) or {}).items():
            load = self._pending.get(job_id)
            if load is None:  # dropped by reset_cache
                continue
            left = load.workers - count
            if left > 0:
                self._pending[job_id] = compat.TakenLoad(load.keys, load.req_context, left)
                continue
            del self._pending[job_id]
            compat.finish_load(self.upstream, load)

    def finished(self, request_id: str) -> None:
        """A request left the engine (``request_finished``): it no longer runs."""
        self._running.discard(request_id)

    def reset(self) -> None:
        """``reset_cache``: the manager forgets every block, so pending loads have nothing to release."""
        self._pending.clear()


__all__ = ["LayerwiseScheduler"]
