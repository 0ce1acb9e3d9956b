"""The worker core's results, split between vLLM's jobs and our own layer-wise loads.

One core serves vLLM's jobs (ids from vLLM's counter, >= 0) and the layer-wise loads of
``NPUOffloadingConnector`` (``OWN_IDS``, negative). ``engine.poll`` hands out each finished job
once, to whoever polls first, so both consumers poll through this router: vLLM's worker/handlers
get only vLLM's results (upstream's worker asserts every result it sees succeeded and counts it as
one of its jobs), the layer-wise loader takes its own by id.
"""

from __future__ import annotations

import itertools
import threading
from typing import Iterable

from ..copy.base import Direction
from ..engine import TransferResult
from ..offload_worker import OffloadWorkerCore


def own_ids() -> "itertools.count[int]":
    """Job ids for our own jobs: negative and far below the core's calibration ids (-1, -2, ...)."""
    return itertools.count(-(1 << 40), -1)


class ResultRouter:
    """Polls ``core`` for both consumers; a result waits here until its consumer asks."""

    def __init__(self, core: OffloadWorkerCore):
        self.core = core
        self._lock = threading.Lock()
        self._vllm: dict[Direction, list[TransferResult]] = {d: [] for d in Direction}
        self._own: dict[int, TransferResult] = {}

    def _sort(self, results: Iterable[TransferResult]) -> None:
        for r in results:
            if r.job_id < 0:
                self._own[r.job_id] = r
            else:
                self._vllm[r.direction].append(r)

    def poll(self, direction: Direction | None = None) -> list[TransferResult]:
        """vLLM's finished jobs (``direction``'s only, when given), each once."""
        with self._lock:
            self._sort(self.core.poll(direction))
            out: list[TransferResult] = []
            for d in (Direction(direction),) if direction is not None else tuple(Direction):
                out += self._vllm[d]
                self._vllm[d] = []
            return out

    def take_own(self, job_ids: Iterable[int]) -> dict[int, TransferResult]:
        """Results of our jobs among ``job_ids`` that have finished, each once."""
        with self._lock:
            self._sort(self.core.poll())
            return {j: self._own.pop(j) for j in job_ids if j in self._own}


__all__ = ["ResultRouter", "own_ids"]
