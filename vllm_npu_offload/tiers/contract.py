"""What a lower tier and the scheduler say to each other, and what makes a record valid.

A record is one host chunk of one rank: the bytes of one offloaded key (vLLM's block hash, which
carries ``cache_salt`` and LoRA, plus the KV-cache group) on that rank. Its validity fingerprint
covers everything else that decides what those bytes mean: the model, the KV dtype, the host record
layout (page sizes and offsets, i.e. each KV-cache group's spec as this rank holds it), our layout
version and the parallelism. Two servers that agree on the fingerprint may read each other's
records; any difference puts them in different directories, and the header is checked again on
every read.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Protocol

# Bump when the meaning of a record's bytes or header changes: old records then stop matching.
RECORD_LAYOUT_VERSION = 1


@dataclass(frozen=True)
class RecordIdentity:
    """Everything that makes one rank's record bytes valid for another server."""

    model: str
    kv_dtype: str
    page_bytes: tuple[int, ...]  # host slot of each KV tensor, in record order
    page_offsets: tuple[int, ...]
    record_bytes: int  # one engine block of every tensor, aligned
    blocks_per_chunk: int
    world_size: int  # ranks that each hold a share of a key's bytes
    layout_version: int = RECORD_LAYOUT_VERSION

    @property
    def chunk_bytes(self) -> int:
        return self.record_bytes * self.blocks_per_chunk

    def fingerprint(self) -> str:
        """32 hex digits over the identity; the directory records of this identity live in."""
        text = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:32]


class Op(str, Enum):
    READ = "read"  # tier -> host chunk (a promotion)
    WRITE = "write"  # host chunk -> tier


class Failure(str, Enum):
    """Why a read or write did not happen; every one of them is a miss or a dropped store."""

    MISSING = "missing"  # no record (evicted, or never written by this rank)
    CORRUPT = "corrupt"  # checksum, size or header mismatch: the record is removed
    FOREIGN = "foreign"  # a record of another identity or key under this name: removed
    NO_SPACE = "no_space"  # ENOSPC / EDQUOT
    READ_ONLY = "read_only"  # EROFS / EACCES / EPERM on write
    IO_ERROR = "io_error"  # any other OSError
    BUSY = "busy"  # the tier's queue was full: dropped before any I/O
    LEFT_HOST = "left_host"  # evicted from host before the tier had room for its write (write_queue.py)


@dataclass(frozen=True)
class Hello:
    """A rank's worker introduces itself to the scheduler once its host buffer exists."""

    rank: int
    identity: RecordIdentity
    writable: bool
    direct_io: bool
    read_bytes_per_s: float  # measured at start-up on the tier's own path
    write_bytes_per_s: float


@dataclass(frozen=True)
class Order:
    seq: int
    op: Op
    key: bytes
    chunk: int  # host chunk id (the manager's block id) on every rank


@dataclass(frozen=True)
class Done:
    seq: int
    rank: int
    op: Op
    ok: bool
    nbytes: int = 0
    seconds: float = 0.0
    failure: Failure | None = None
    detail: str = ""


@dataclass
class TierStats:
    """Counters a tier reports (log line and metrics); monotonically increasing except ``*_now``."""

    hits: int = 0  # keys promoted to host
    prefetches: int = 0  # of them, read when their request arrived (before vLLM's scheduler looked them up)
    misses_cost: int = 0  # on the tier, recomputed because the read would not have been faster
    misses_no_chunk: int = 0  # on the tier, recomputed because every host chunk was pinned
    read_bytes: int = 0
    read_seconds: float = 0.0
    write_bytes: int = 0
    write_seconds: float = 0.0
    stores: int = 0  # keys written
    dropped_stores: int = 0
    evictions: int = 0
    checksum_failures: int = 0
    read_failures: int = 0
    timeouts: int = 0
    used_bytes_now: int = 0
    keys_now: int = 0
    deleting_bytes_now: int = 0  # evicted records not deleted yet (still on disk, beyond used_bytes_now)
    by_failure: dict[str, int] = field(default_factory=dict)
    where: str = "on disk"  # how the log line names what the tier holds now

    def count_done(self, op: "Op", nbytes: int, seconds: float) -> None:
        """One key read (a hit) or written, on every rank."""
        if op is Op.READ:
            self.hits += 1
            self.read_bytes += nbytes
            self.read_seconds += seconds
        else:
            self.stores += 1
            self.write_bytes += nbytes
            self.write_seconds += seconds

    def line(self) -> str:
        """One log line of the counters so far (what vLLM releases without per-tier metrics show)."""
        gb = 1e9
        rate = self.read_bytes / self.read_seconds / gb if self.read_seconds else 0.0
        return (f"hits {self.hits} ({self.read_bytes / gb:.2f} GB, {rate:.2f} GB/s per read, "
                f"{self.prefetches} prefetched), "
                f"recomputed: {self.misses_cost} by cost, {self.misses_no_chunk} no host chunk, "
                f"{self.timeouts} late, {self.read_failures} failed ({self.checksum_failures} checksum); "
                f"stores {self.stores} ({self.write_bytes / gb:.2f} GB), dropped {self.dropped_stores} "
                f"({self.by_failure.get(Failure.LEFT_HOST.value, 0)} left host first), "
                f"evictions {self.evictions}, {self.where} {self.used_bytes_now / gb:.2f} GB"
                + (f" (+{self.deleting_bytes_now / gb:.2f} GB being deleted)" if self.deleting_bytes_now else ""))

    def count_failure(self, failure: Failure | None, n: int = 1) -> None:
        name = failure.value if failure is not None else "unknown"
        self.by_failure[name] = self.by_failure.get(name, 0) + n


@dataclass
class Completion:
    """An order that ended on every rank: a read's chunk now holds the verified key, or not."""

    key: bytes
    op: Op
    ok: bool
    chunk: int


class LowerTier(Protocol):
    """What the scheduler-side manager asks of a tier below host memory. Every call returns at once:
    I/O runs on the ranks' threads, answers come back through ``poll``."""

    name: str  # in logs and metric names ("disk", "mooncake")
    admit: str  # "all" | "reuse" (integration/tiered_manager.py)
    abandoned: set[bytes]  # keys whose read passed its deadline: misses until the read ends
    stats: TierStats

    def has(self, key: bytes) -> bool: ...
    def looking_up(self, key: bytes) -> bool: ...  # whether it has ``key`` is not known yet
    def reading(self, key: bytes) -> bool: ...
    def worth_reading(self, count: bool = True) -> bool: ...  # the cost rule for one more read now
    def start_read(self, key: bytes, chunk: int) -> bool: ...
    def may_write(self) -> bool: ...  # a write may start now (up, writable, room in its queue)
    def needs_write(self, key: bytes) -> bool: ...  # not on the tier and not moving
    def start_write(self, key: bytes, chunk: int) -> bool: ...
    def poll(self) -> list[Completion]: ...
    def in_flight(self) -> int: ...
    def drain(self, timeout_s: float) -> list[Completion]: ...
    def describe_rate(self) -> str: ...
    def close(self) -> None: ...


__all__ = ["Completion", "Done", "Failure", "Hello", "LowerTier", "Op", "Order", "RECORD_LAYOUT_VERSION",
           "RecordIdentity", "TierStats"]
