"""Process-wide transfer totals, for the demo and diagnostics (the per-step numbers go to vLLM)."""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

FOLD_EVERY = 1024  # jobs waiting in ``pending`` before the engine folds them in itself


@dataclass
class DirectionTotals:
    jobs: int = 0
    failed: int = 0
    bytes: int = 0
    seconds: float = 0.0  # device time between each job's start and end events
    wall_seconds: float = 0.0  # from submit until a poll saw the job done (what a request waits)

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass
class TransferTotals:
    load: DirectionTotals = field(default_factory=DirectionTotals)
    store: DirectionTotals = field(default_factory=DirectionTotals)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    # (is_load, ok, bytes, seconds, wall seconds) of jobs not yet counted: the engine's poll appends
    # (a deque append is atomic and costs no lock, on the poll that makes a completion visible) and
    # whoever reads the totals folds them in first; the engine folds when more than FOLD_EVERY wait
    # as it returns reported jobs' buffers (off that poll)
    pending: deque = field(default_factory=deque, repr=False)

    def fold(self) -> None:
        """Count the pending jobs into the totals."""
        with self._lock:
            self._fold()

    def _fold(self) -> None:
        pending = self.pending
        while pending:
            is_load, ok, nbytes, seconds, wall_seconds = pending.popleft()
            d = self.load if is_load else self.store
            d.jobs += 1
            if ok:
                d.bytes += nbytes
                d.seconds += seconds
                d.wall_seconds += wall_seconds
            else:
                d.failed += 1

    def snapshot(self) -> tuple[DirectionTotals, DirectionTotals]:
        with self._lock:
            self._fold()
            return DirectionTotals(**vars(self.load)), DirectionTotals(**vars(self.store))

    def reset(self) -> None:
        with self._lock:
            self.pending.clear()  # the same deque: the engine holds its append
            self.load, self.store = DirectionTotals(), DirectionTotals()


TOTALS = TransferTotals()
