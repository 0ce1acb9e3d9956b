"""The scheduler's side of the disk tier: what is on disk, what to read and write, and when not to.

Everything here is called on the scheduler's thread and returns at once. Orders go to every rank's
``DiskTierServer`` over its socket; their answers come back on receiver threads into a queue that
``poll`` drains. A key on disk is promoted into the host tier (read into a host chunk the caller
allocated) before a request may count it as a hit, so a record that fails its checks is a miss
and the tokens are recomputed: a request never waits on a read that went wrong, and never loads
bytes that were not verified.

The cost rule: a read is started only if the disk, with what is already queued on it, delivers the
key within ``read_queue_s``, and, when a prefill rate is given, sooner than the accelerator would
recompute its tokens (``prefill_tokens_per_s``). On a busy server the accelerator's prefill is
shared by every request while the disk's reads run beside it: the disk adds capacity only while the
requests it holds back wait less than the accelerator would make them wait, so the queue is the
cost that matters. Keys beyond it are recomputed, which keeps the accelerator busy. The read rate is
the one measured at start-up at first, then what the disk delivers while reads are queued (writes,
other servers and a shared filesystem's load included). A read that misses its deadline turns the lookup into a miss; its chunk is released only
when the read has really ended (a late read must not land in a chunk that holds something else).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .channel import socket_path
from .contract import Completion, Failure, Hello, Op, TierStats
from .disk_index import DiskIndex
from .disk_io import RecordFiles
from .disk_janitor import DiskJanitor
from .rank_links import OrderedTier, PendingOrder
from .record import HEADER_BYTES

logger = logging.getLogger(__name__)

NO_SPACE_BACKOFF_S = 10.0  # stores pause this long after ENOSPC, then try again
RATE_WINDOW_BYTES = 256 << 20  # one sample of the live read rate
RATE_WEIGHT = 0.25  # of a new sample in the read rate
# The longest a lookup waits for a starting tier (ranks' hello, the first scan of the records); a
# rank that never answers leaves the tier down and lookups miss after it.
STARTUP_WAIT_S = 10.0


class ReadRate:
    """Bytes per second the tier delivers while reads are queued: start-up probe, then live samples.

    A sample is the bytes over the time since the busy period began (reads queued without a pause),
    taken each time another window of bytes has finished: completions that arrive together (a
    batch, or a poll that collects many) then never count against a window that just began, which
    once read 210 GB/s off a pool that delivered 0.3."""

    def __init__(self, probed: float):
        self.value = probed
        self._t0: float | None = None
        self._bytes = 0
        self._sampled = 0

    def started(self, backlog_before: int, now: float) -> None:
        if backlog_before == 0:
            self._t0, self._bytes, self._sampled = now, 0, 0

    def ended(self, nbytes: int, backlog_after: int, now: float) -> None:
        if self._t0 is None:
            return
        self._bytes += nbytes
        new = self._bytes - self._sampled
        if new >= RATE_WINDOW_BYTES or (backlog_after == 0 and new >= RATE_WINDOW_BYTES // 8):
            if now > self._t0:
                sample = self._bytes / (now - self._t0)
                self.value = sample if self.value <= 0 else (1 - RATE_WEIGHT) * self.value + RATE_WEIGHT * sample
            self._sampled = self._bytes
        if backlog_after == 0:
            self._t0 = None


@dataclass(frozen=True)
class DiskTierConfig:
    root: str
    budget_bytes: int  # all ranks' records together
    world_size: int
    engine_id: str
    tokens_per_key: int
    read_timeout_s: float = 5.0
    read_queue_s: float = 1.0  # reads start while the queue of reads drains within this
    prefill_tokens_per_s: float = 0.0  # > 0: reads must also beat recomputing at this rate
    rescan_s: float = 10.0  # 0: scan once at start-up
    admit: str = "all"  # "all": every stored key; "reuse": a key once it is hit again while in host
    max_write_backlog_bytes: int = 1 << 30


class DiskTier(OrderedTier):
    """A ``LowerTier`` (contract.py) over every rank's ``DiskTierServer``."""

    name = "disk"

    def __init__(self, cfg: DiskTierConfig):
        self.cfg = cfg
        self.admit = cfg.admit
        self.stats = TierStats()
        self.index: DiskIndex | None = None
        self.files: RecordFiles | None = None
        self.rate = ReadRate(0.0)
        self.writable = False
        self._init_orders([socket_path(cfg.engine_id, cfg.root, r) for r in range(cfg.world_size)])
        self._stores_paused_until = 0.0
        self._closed = threading.Event()
        self._janitor: DiskJanitor | None = None
        # Keys sent to the janitor for deletion, by their place in its queue, until it reports them
        # done: a scan that started before a key's files went may still list them, and must not put
        # the key back in the index (a phantom record: a read that finds nothing, a budget miscounted).
        self._tombstones: dict[bytes, int] = {}
        self._deletes_sent = 0
        self._deleted_upto = 0
        self._headroom = 0  # bytes the index keeps free for records the janitor has yet to delete
        self._started, self._scanned = time.monotonic(), False

    def _delete(self, key: bytes) -> None:
        """Every rank's record of ``key`` goes (on the janitor's thread); until then it is a tombstone."""
        assert self._janitor is not None
        self._tombstones[key] = self._deletes_sent
        self._deletes_sent += 1
        self._janitor.delete(key)

    def _deleting(self, key: bytes) -> bool:
        return self._tombstones.get(key, -1) >= self._deleted_upto

    @property
    def deleting_bytes(self) -> int:
        """Records evicted or failed whose files the janitor has not deleted yet: still on disk."""
        return (self._deletes_sent - self._deleted_upto) * self.key_bytes

    # -- state ---------------------------------------------------------------------------
    @property
    def up(self) -> bool:
        return self.index is not None and self._links.all_up

    def _on_hello(self, h: Hello) -> None:
        ident = self._identity_of(h, ready=self.index is not None)
        if ident is None:
            return
        self.files = RecordFiles(Path(self.cfg.root), ident.fingerprint())
        self.index = DiskIndex(self.cfg.budget_bytes, (ident.chunk_bytes + HEADER_BYTES) * self.cfg.world_size)
        self.rate = ReadRate(min(x.read_bytes_per_s for x in self._hellos.values()))
        self.writable = all(x.writable for x in self._hellos.values())
        # an eighth of the budget at most, a quarter of the writes in flight at most (256 MiB by default)
        room = min(self.cfg.max_write_backlog_bytes // 4, self.cfg.budget_bytes // 8)
        self._headroom = room // self.index.key_bytes * self.index.key_bytes
        self._janitor = DiskJanitor(self.files, self.cfg.world_size, self.cfg.rescan_s, self._events,
                                    self._closed).start()
        logger.info(
            "disk tier: %s, budget %.1f GiB (%d keys of %d bytes over %d ranks), %s I/O, read %.2f GB/s, "
            "write %.2f GB/s, reads at most %.1f s%s", self.files.dir, self.cfg.budget_bytes / 2**30,
            self.cfg.budget_bytes // self.index.key_bytes, self.index.key_bytes, self.cfg.world_size,
            "direct" if all(x.direct_io for x in self._hellos.values()) else "buffered",
            self.rate.value / 1e9, min(x.write_bytes_per_s for x in self._hellos.values()) / 1e9,
            self.cfg.read_timeout_s, "" if self.writable else ", read-only",
        )

    def poll(self) -> list[Completion]:
        """Take in everything the ranks said; returns the orders that ended on every rank."""
        out = self._take_events()
        if self.index is not None:
            self.stats.used_bytes_now = self.index.used_bytes
            self.stats.keys_now = len(self.index)
            self.stats.deleting_bytes_now = self.deleting_bytes
        return out

    def _on_event(self, ev) -> None:
        if ev[0] == "scan" and self.index is not None:
            # keys sent for deletion that the janitor had not deleted when the scan ended are left out
            _, done, keys = ev
            if self.index.merge([k for k in keys if self._tombstones.get(k, -1) < done]):
                self._evict()  # records of other servers, or of a write that raced its key's eviction
            self._scanned = self._links.all_up
        elif ev[0] == "deleted":
            # a scan never reports a key the janitor deleted while it ran (it leaves them out), and a
            # scan that ended before these deletions was merged already: their tombstones can go
            self._deleted_upto = ev[1]
            self._tombstones = {k: n for k, n in self._tombstones.items() if n >= ev[1]}

    def _finish_read(self, p: PendingOrder) -> None:
        s = self.stats
        if p.ok:
            s.count_done(Op.READ, p.nbytes, p.seconds)
            return
        s.read_failures += 1
        for f in p.failures:
            s.count_failure(f)
            if f in (Failure.CORRUPT, Failure.FOREIGN):
                s.checksum_failures += 1
        if any(f in (Failure.CORRUPT, Failure.FOREIGN) for f in p.failures):
            self._warn_once("corrupt", "disk tier: a record failed its checks and was removed; recomputing")
        if self.index is not None and self.index.remove(p.key):
            self._delete(p.key)  # the other ranks' records of it are useless now

    def _finish_write(self, p: PendingOrder) -> None:
        s = self.stats
        if p.ok:
            s.count_done(Op.WRITE, p.nbytes, p.seconds)
            if self.index is not None and not self._deleting(p.key):
                # (a key evicted while its new record was being written: the janitor may yet
                # delete that record, so the index does not claim it; a later scan finds it if it stays)
                self.index.add(p.key)
                self._evict()
            return
        s.dropped_stores += 1
        for f in p.failures:
            s.count_failure(f)
        if Failure.READ_ONLY in p.failures:
            self.writable = False
            self._warn_once("ro", "disk tier: %s is not writable; stores are dropped, reads go on", self.cfg.root)
        elif Failure.NO_SPACE in p.failures:
            self._stores_paused_until = time.monotonic() + NO_SPACE_BACKOFF_S
            self._warn_once("nospace", "disk tier: %s is full (ENOSPC); stores pause %.0f s at a time",
                            self.cfg.root, NO_SPACE_BACKOFF_S)
        self._delete(p.key)  # a partial write: no rank's record may stay alone

    def _evict(self, extra: int = 0) -> None:
        """Drop least recently used records so that the index, the writes under way, ``extra`` bytes
        and the headroom fit the budget: a record is made room for before its write is sent, never
        after it is on disk."""
        assert self.index is not None
        reserve = self._write_backlog + self._headroom + extra
        for key in self.index.over_budget(protected=self._reads, reserve=reserve):
            self.stats.evictions += 1
            self._delete(key)

    def may_write(self) -> bool:
        """Whether one more write may start: room is made for it in the index first, and it starts only
        if the files on disk stay within the budget with it, counting the evicted records the janitor
        has not deleted yet (a janitor that falls behind holds writes back in the write queue instead
        of letting the folder grow past its budget)."""
        if not super().may_write():
            return False
        idx = self.index
        if idx.used_bytes + self._write_backlog + self._headroom + idx.key_bytes > idx.budget_bytes:
            self._evict(extra=idx.key_bytes)
        return idx.used_bytes + self._write_backlog + self.deleting_bytes + idx.key_bytes <= idx.budget_bytes

    def start_write(self, key: bytes, chunk: int) -> bool:
        if not super().start_write(key, chunk):
            return False
        if self.index is not None:
            self._evict()
        return True

    # -- decisions -------------------------------------------------------------------------
    def has(self, key: bytes) -> bool:
        return self.up and self.index is not None and key in self.index

    def looking_up(self, key: bytes) -> bool:
        """Whether the disk may hold ``key`` but the tier cannot say yet: right after start-up, until
        every rank has said hello and the first scan of the folder is in (at most STARTUP_WAIT_S), so
        that a restarted server's first requests find their records instead of recomputing."""
        return not self._scanned and time.monotonic() < self._started + STARTUP_WAIT_S

    def _readable(self) -> bool:
        return self.index is not None

    def needs_write(self, key: bytes) -> bool:
        """Whether ``key`` is neither on disk nor moving (a write may wait for room: write_queue.py)."""
        return (self.index is not None and key not in self.index
                and key not in self._writes and key not in self._reads)

    @property
    def key_bytes(self) -> int:
        return self.index.key_bytes if self.index is not None else 0

    def start_read(self, key: bytes, chunk: int) -> bool:
        if not super().start_read(key, chunk):
            return False
        self.index.touch(key)
        return True

    def close(self) -> None:
        self._closed.set()
        self._links.close()


__all__ = ["DiskTier", "DiskTierConfig", "ReadRate"]
