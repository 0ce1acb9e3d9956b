"""A test hook, off unless ``NPU_OFFLOAD_FAULTS`` is set: failures injected at random where real ones
happen, to show in real serving what each does (the request recomputes with the right tokens, the
server keeps serving, the failure is counted).

- ``load`` / ``store``: a host<->device copy job is reported failed (vLLM then recomputes the
  blocks of a failed load; a failed store's chunk never becomes loadable).
- ``disk_read``: a disk tier read fails with an I/O error before touching the file.
- ``disk_corrupt``: one payload byte of the record on disk is flipped before it is read, so the
  record's checksum check fails and the record is removed.
- ``disk_write``: a disk tier write fails with an I/O error.

``NPU_OFFLOAD_FAULTS=load=0.02,disk_corrupt=0.1`` (probabilities per job or per record); a warning
at start-up says the hook is on.
"""

from __future__ import annotations

import logging
import random
import threading

from . import env

logger = logging.getLogger(__name__)

KINDS = env.FAULT_KINDS


class Faults:
    def __init__(self, probs: dict[str, float], seed: int | None = None):
        self.probs = dict(probs)
        self.seed(seed)
        self._lock = threading.Lock()
        self.injected = {k: 0 for k in self.probs}

    def seed(self, seed: int | None) -> None:
        """One generator per kind: a kind's draws do not depend on the other kinds' threads."""
        self._rng = {k: random.Random(None if seed is None else f"{seed}:{k}") for k in self.probs}

    def hit(self, kind: str) -> bool:
        p = self.probs.get(kind, 0.0)
        if p <= 0.0:
            return False
        with self._lock:
            if self._rng[kind].random() >= p:
                return False
            self.injected[kind] += 1
            return True


_ACTIVE: Faults | None = None
_LOADED = False
_LOAD_LOCK = threading.Lock()


def active() -> Faults | None:
    """The process's faults from ``NPU_OFFLOAD_FAULTS`` (read once), or None when it is unset."""
    global _ACTIVE, _LOADED
    if _LOADED:
        return _ACTIVE
    with _LOAD_LOCK:
        if not _LOADED:
            probs = env.get("NPU_OFFLOAD_FAULTS")
            if probs:
                _ACTIVE = Faults(probs)
                logger.warning("NPU_OFFLOAD_FAULTS is set: failures are injected on purpose (%s); a test hook, "
                               "never for serving users", ", ".join(f"{k}={v:g}" for k, v in probs.items()))
            _LOADED = True
    return _ACTIVE


def reload() -> Faults | None:
    """Read ``NPU_OFFLOAD_FAULTS`` again (tests)."""
    global _LOADED, _ACTIVE
    with _LOAD_LOCK:
        _LOADED, _ACTIVE = False, None
    return active()


__all__ = ["Faults", "KINDS", "active", "reload"]
