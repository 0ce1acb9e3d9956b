"""Which keys the disk holds, in least-recently-used order, within a byte budget.

The files are the truth (they survive restarts and are shared between servers); this index is the
scheduler's view of them: filled by a scan of the identity's directory at start-up and again every
few seconds (records other servers wrote), and kept current by this server's own writes. A key is
on the tier only when every rank's record is there.
"""

from __future__ import annotations

from collections import OrderedDict


class DiskIndex:
    def __init__(self, budget_bytes: int, key_bytes: int):
        self.budget_bytes = budget_bytes
        self.key_bytes = key_bytes  # every rank's record of one key, headers included
        self._lru: OrderedDict[bytes, None] = OrderedDict()

    def __contains__(self, key: bytes) -> bool:
        return key in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def used_bytes(self) -> int:
        return len(self._lru) * self.key_bytes

    def add(self, key: bytes) -> None:
        self._lru[key] = None
        self._lru.move_to_end(key)

    def touch(self, key: bytes) -> None:
        if key in self._lru:
            self._lru.move_to_end(key)

    def remove(self, key: bytes) -> bool:
        return self._lru.pop(key, 0) is None

    def merge(self, keys_oldest_first: list[bytes]) -> int:
        """Add keys found on disk that the index lacks, as the least recently used; returns how many."""
        new = [k for k in keys_oldest_first if k not in self._lru]
        for k in reversed(new):
            self._lru[k] = None
            self._lru.move_to_end(k, last=False)
        return len(new)

    def over_budget(self, protected=(), reserve: int = 0) -> list[bytes]:
        """Least recently used keys to drop so that the index, plus ``reserve`` bytes about to be
        written, fits its budget again."""
        excess = self.used_bytes + reserve - self.budget_bytes
        out: list[bytes] = []
        if excess <= 0:
            return out
        for key in self._lru:
            if excess <= 0:
                break
            if key in protected:
                continue
            out.append(key)
            excess -= self.key_bytes
        for key in out:
            del self._lru[key]
        return out


__all__ = ["DiskIndex"]
