"""Why a lookup found a key in no tier: what became of the key, as far as this scheduler saw it.

A prefix lookup ends at its first missing key and the rest of the prompt is recomputed, so the
reason for that one key is the reason the rest was not served. The manager notes each key's last
fate (stored to host, written to a tier, dropped before its write) in a bounded map and sorts each
miss by it; the counts go into the tier's log line. They are what says, on a real load, whether a
tier falls short because the disk could not take the stores in time, because its budget evicted
them, or because the prompts were new.
"""

from __future__ import annotations

from collections import OrderedDict
from enum import Enum

DEFAULT_LIMIT = 1 << 16  # keys remembered (a key older than that counts as new again)


class Fate(str, Enum):
    HOST = "host"  # stored to host (admitted to a tier's write queue, or not)
    WRITTEN = "written"  # on a lower tier once
    DROPPED = "dropped"  # left host before a tier took it
    WRITE_FAILED = "write_failed"
    MISSED = "missed"  # its miss is counted already (until its next fate)


class MissReason(str, Enum):
    NEW = "new"  # never stored here: new text, or older than the map
    QUEUED = "queued"  # left host while waiting for its write
    DROPPED = "dropped"  # left host before the tier took it
    GONE = "gone"  # was on the tier; evicted by the budget, failed its checks, or removed
    NOT_ADMITTED = "not_admitted"  # left host, never sent to a tier (admission, tier down or read-only)
    WRITE_FAILED = "write_failed"
    COST = "cost"  # on the tier, but the cost rule had it recomputed (the disk's read queue was full)


class MissReasons:
    """Each key's last fate, and the misses counted by reason (each key's miss once per fate)."""

    def __init__(self, limit: int = DEFAULT_LIMIT):
        if limit < 1:
            raise ValueError(f"MissReasons limit={limit!r}: must be at least 1")
        self.limit = limit
        self._fates: OrderedDict[bytes, Fate] = OrderedDict()
        self.counts: dict[str, int] = {r.value: 0 for r in MissReason}

    def note(self, keys, fate: Fate) -> None:
        for key in keys:
            self._fates[key] = fate
            self._fates.move_to_end(key)
        while len(self._fates) > self.limit:
            self._fates.popitem(last=False)

    def missed(self, key, queued: bool, refused: bool = False) -> MissReason | None:
        """Count the miss of ``key`` (``queued``: still in a tier's write queue; ``refused``: on a tier,
        recomputed by its cost rule); None if counted already."""
        fate = self._fates.get(key)
        if fate is Fate.MISSED:
            return None  # a deferred request looks its keys up again every step
        if refused:
            reason = MissReason.COST
        elif fate is None:
            reason = MissReason.NEW
        elif queued:
            reason = MissReason.QUEUED
        elif fate is Fate.HOST:
            reason = MissReason.NOT_ADMITTED
        else:
            reason = {Fate.WRITTEN: MissReason.GONE, Fate.DROPPED: MissReason.DROPPED,
                      Fate.WRITE_FAILED: MissReason.WRITE_FAILED}[fate]
        self.counts[reason.value] += 1
        self.note([key], Fate.MISSED)
        return reason

    def line(self) -> str:
        c = self.counts
        return (f"first missing keys: {c['new']} new, {c['queued']} queued for a write, {c['dropped']} dropped "
                f"before their write, {c['gone']} gone from the tier, {c['not_admitted']} not admitted, "
                f"{c['write_failed']} write failed, {c['cost']} refused by the cost rule")


__all__ = ["DEFAULT_LIMIT", "Fate", "MissReason", "MissReasons"]
