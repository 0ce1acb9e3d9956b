"""Test doubles for the simple-offload worker: fake transports and the naive design.

``NaiveWorker`` reproduces the upstream / vLLM-Ascend port's structure on purpose:
transfers launched from ``get_finished``, the event -> request map read from the
current step's metadata only, and a plain list shared between the copy thread
(append) and the engine thread (iterate, pop, clear). The defect tests run the same
scenario against it to show that each test would catch the defect.
"""

from __future__ import annotations

import contextlib
import random
import threading
from collections import Counter

from vllm_npu_offload.copy.base import CopyPath, Direction
from vllm_npu_offload.errors import CopyError
from vllm_npu_offload.simple_core import NO_EVENT, Completion, StepPlan


class ManualTransport:
    """Completes nothing by itself; the test decides when each event finishes."""

    def __init__(self):
        self.launches: Counter = Counter()
        self.outstanding: list[tuple[Direction, int]] = []
        self.ready: list[Completion] = []

    def launch(self, direction, event_idx, src, dst):
        self.launches[(Direction(direction), event_idx)] += 1
        self.outstanding.append((Direction(direction), event_idx))

    def finish(self, direction, event_idx, success=True):
        self.outstanding.remove((direction, event_idx))
        self.ready.append(Completion(direction, event_idx, success, None if success else "injected"))

    def poll(self):
        ready, self.ready = self.ready, []
        return ready

    def flush(self):
        for d, e in list(self.outstanding):
            self.finish(d, e)
        return self.poll()

    def shutdown(self):
        pass


class ThreadedTransport:
    """Producer threads complete launched events in random order at random times; ``poll`` (on
    the engine thread) takes what they finished, as the transfer engine's locked poll does."""

    def __init__(self, producers: int = 4, fail_rate: float = 0.05, seed: int = 0):
        self._done: list[Completion] = []
        self.fail_rate = fail_rate
        self.launches: Counter = Counter()
        self.failed: set[tuple[Direction, int]] = set()
        self._outstanding: list[tuple[Direction, int]] = []
        self._in_progress = 0
        self._cv = threading.Condition()
        self._stop = False
        self._threads = [
            threading.Thread(target=self._produce, args=(random.Random(seed + i),), daemon=True)
            for i in range(producers)
        ]
        for t in self._threads:
            t.start()

    def launch(self, direction, event_idx, src, dst):
        with self._cv:
            self.launches[(Direction(direction), event_idx)] += 1
            self._outstanding.append((Direction(direction), event_idx))
            self._cv.notify_all()

    def _take(self, rng):
        with self._cv:
            while not self._outstanding and not self._stop:
                self._cv.wait(0.01)
            if self._stop:
                return None
            i = rng.randrange(len(self._outstanding))
            self._outstanding[i], self._outstanding[-1] = self._outstanding[-1], self._outstanding[i]
            self._in_progress += 1
            return self._outstanding.pop()

    def _complete(self, item, ok):
        if not ok:
            self.failed.add(item)
        with self._cv:
            self._done.append(Completion(item[0], item[1], ok, None if ok else "injected"))
            self._in_progress -= 1
            self._cv.notify_all()

    def _produce(self, rng):
        while True:
            item = self._take(rng)
            if item is None:
                return
            if rng.random() < 0.3:
                threading.Event().wait(rng.random() * 1e-4)  # finish "later", at a random step
            self._complete(item, rng.random() >= self.fail_rate)

    def poll(self):
        with self._cv:
            done, self._done = self._done, []
        return done

    def flush(self):
        with self._cv:
            items, self._outstanding = self._outstanding, []
            self._in_progress += len(items)
        for it in items:
            self._complete(it, True)
        with self._cv:
            while self._in_progress:
                self._cv.wait(0.01)
        return self.poll()

    def shutdown(self):
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        for t in self._threads:
            t.join(2)


class _NaiveEvent:
    def __init__(self, on_sync=None):
        self.done = False
        self.on_sync = on_sync

    def query(self):
        return self.done

    def synchronize(self):
        if self.on_sync is not None:
            self.on_sync()
        self.done = True


class NaiveWorker:
    """The defective design (see module docstring). ``launch`` counts submissions."""

    def __init__(self):
        self.meta: StepPlan | None = None
        self.launches: Counter = Counter()
        self.load_events: list[tuple[int, _NaiveEvent]] = []  # shared with the "copy thread"
        self.pending_loads: set[int] = set()

    def bind(self, plan: StepPlan):
        self.meta = plan
        if plan.load_event != NO_EVENT:
            self.pending_loads.add(plan.load_event)

    def copy_thread_append(self, event_idx, event):
        self.load_events.append((event_idx, event))

    def get_finished(self) -> set[str]:
        m = self.meta
        if m is not None and m.load_event != NO_EVENT:  # defect 1: launch here
            self.launches[(Direction.H2D, m.load_event)] += 1
        done = set()
        while self.load_events and self.load_events[0][1].query():
            done.add(self.load_events.pop(0)[0])
        out = set()
        for ev in done:
            self.pending_loads.discard(ev)
            out |= set(m.load_event_to_reqs.get(ev, ()))  # defect 2: current step's map only
        return out

    def flush(self) -> set[int]:
        """Defect 3: iterate then clear() a list another thread appends to."""
        flushed = set()
        for ev_idx, ev in self.load_events:
            ev.synchronize()
            flushed.add(ev_idx)
        self.load_events.clear()
        return flushed


class FailingCopyPath(CopyPath):
    name = "test-failing"

    def copy(self, *a, **kw):
        raise CopyError("injected copy failure", "test")


@contextlib.contextmanager
def failing_copies(worker, direction: Direction):
    """Every ``direction`` copy of an ``NPUSimpleCPUOffloadWorker`` fails while inside."""
    paths = worker.transport.backend._paths
    orig = paths[direction]
    paths[direction] = FailingCopyPath()
    try:
        yield
    finally:
        paths[direction] = orig
