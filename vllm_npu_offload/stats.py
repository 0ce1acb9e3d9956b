"""Process-wide transfer totals, for the demo and diagnostics (the per-step numbers go to vLLM)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


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

    def record(self, is_load: bool, ok: bool, nbytes: int, seconds: float, wall_seconds: float = 0.0) -> None:
        with self._lock:
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
            return DirectionTotals(**vars(self.load)), DirectionTotals(**vars(self.store))

    def reset(self) -> None:
        with self._lock:
            self.load, self.store = DirectionTotals(), DirectionTotals()


TOTALS = TransferTotals()
