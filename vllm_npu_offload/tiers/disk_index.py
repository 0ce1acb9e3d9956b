"""Which keys the disk holds, in least-recently-used order, within a byte budget.

The files are the truth (they survive restarts and are shared between servers); this index is the
scheduler's view of them: filled by a scan of the identity's directory at start-up and again every
few seconds (records other servers wrote), and kept current by this server's own writes. A key is
on the tier only when every rank's record is there.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path

from .disk_io import TMP_MARK


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


def scan(directory: Path, world_size: int) -> list[bytes]:
    """Keys with every rank's record under ``directory``, oldest first (by the newest file's mtime)."""
    found: dict[str, tuple[set[int], float]] = {}
    if not directory.is_dir():
        return []
    for sub in os.scandir(directory):
        if not sub.is_dir():
            continue
        for f in os.scandir(sub.path):
            name = f.name
            if TMP_MARK in name:
                continue
            stem, dot, rank = name.rpartition(".r")
            if not dot or not rank.isdigit():
                continue
            try:
                mtime = f.stat().st_mtime
            except OSError:
                continue
            ranks, newest = found.get(stem, (set(), 0.0))
            ranks.add(int(rank))
            found[stem] = (ranks, max(newest, mtime))
    whole = [(mtime, stem) for stem, (ranks, mtime) in found.items() if ranks >= set(range(world_size))]
    out = []
    for _, stem in sorted(whole):
        try:
            out.append(bytes.fromhex(stem))
        except ValueError:
            continue
    return out


__all__ = ["DiskIndex", "scan"]
