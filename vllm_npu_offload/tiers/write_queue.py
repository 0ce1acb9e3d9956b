"""Keys waiting for a lower tier to take their write, oldest first.

A tier writes more slowly than a busy server stores: at the capacity load an H200 stores about
1.2 GB/s of KV into host memory, while a virtio disk writes 0.5-1 GB/s beside its reads and a
Mooncake pool over TCP less. A key the tier cannot take yet (its write queue is full) waits here
instead of being skipped, and the tier takes it as soon as it has room, for as long as the key is
still in host memory: the disk writes whenever reads leave it time, not only when a store happens
to arrive while its queue has room.

A key that left host before its turn is dropped, and so are the keys stored after it in the same
batch (one store job: the same request's later blocks). A prefix lookup stops at the first key found
nowhere, so the keys after it could not be reached; the request that needs them recomputes from the
lost key and stores them all again.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

DEFAULT_LIMIT = 1 << 16  # keys; beyond it the oldest are dropped (far more than any host holds)


class WriteQueue:
    """FIFO of keys to write to one tier, in store order, each key once."""

    def __init__(self, limit: int = DEFAULT_LIMIT):
        if limit < 1:
            raise ValueError(f"WriteQueue limit={limit!r}: must be at least 1")
        self.limit = limit
        self._keys: OrderedDict[bytes, int] = OrderedDict()  # key -> batch it was stored in
        self._batch = 0
        self._lost_batch = -1
        self._dropped: list[bytes] = []  # keys that will never be written: left host, after a lost key, or over the limit

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key) -> bool:
        return key in self._keys

    def add(self, keys) -> None:
        """One batch: keys stored together, in block order. A key already waiting keeps its place."""
        self._batch += 1
        for key in keys:
            self._keys.setdefault(key, self._batch)
        while len(self._keys) > self.limit:
            self._dropped.append(self._keys.popitem(last=False)[0])

    def pop(self, present: Callable[[bytes], bool], in_host: Callable[[bytes], bool]) -> bytes | None:
        """The oldest key that still needs writing and can be: ``present`` (on the tier or moving
        already) keys are passed over, keys no longer ``in_host`` are dropped with the rest of their
        batch. None when nothing is left."""
        while self._keys:
            key, batch = self._keys.popitem(last=False)
            if batch == self._lost_batch:
                self._dropped.append(key)
                continue
            if present(key):
                continue
            if not in_host(key):
                self._dropped.append(key)
                self._lost_batch = batch
                continue
            return key
        return None

    def take_dropped(self) -> list[bytes]:
        """The keys dropped since the last call (the tier's counter takes them)."""
        out, self._dropped = self._dropped, []
        return out

    def clear(self) -> int:
        """Forget every key (a cache reset); returns how many were waiting."""
        n = len(self._keys)
        self._keys.clear()
        return n


__all__ = ["DEFAULT_LIMIT", "WriteQueue"]
