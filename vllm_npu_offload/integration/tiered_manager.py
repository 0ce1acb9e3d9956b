"""The scheduler side of ``NPUOffloadingSpec`` when lower tiers are configured: host, then each tier in order.

vLLM's own host manager (``CPUOffloadingManager``, LRU/ARC) keeps deciding everything about host
chunks; this wrapper adds the tier below it, through the calls every vLLM from 0.23 on makes
(``lookup`` per key, ``prepare_load``, ``touch``, ``prepare_store``, ``complete_store``), so it
does not depend on vLLM's own tiering classes, whose contract changed with almost every release.

- A lookup that misses the host but hits a lower tier (the first in order that has the key)
  allocates a host chunk (``prepare_store``, evicting as any store would), orders the read on every
  rank and answers "not yet" (the request waits, the step does not); once every rank has read and
  verified its record, the chunk is completed and the next lookup is a host hit. A failed or late
  read is a miss. A tier that cannot say yet whether it has a key (a store's existence check in
  flight) also answers "not yet".
- Admission (``disk_admit``): ``all`` writes every key stored to host (a conversation's next turn
  often comes after its KV has left host: only a write at store time has it on disk then);
  ``reuse`` writes a key the first time it is hit again while still in host (loaded from host, or
  found in the device's prefix cache), so keys no request reuses never cost a write. Each tier
  decides for itself. An admitted key waits in the tier's ``WriteQueue`` until the tier has room
  (oldest first, dropped if it leaves host first); its chunk is pinned (``prepare_load``, once per
  tier writing it) from the write's start until it has ended on every rank.

- Prefetch (``prefetch``, from ``NPUOffloadingConnector.on_new_request``): vLLM's scheduler looks a
  waiting request up only when it reaches the front of the queue and stops at the first one it cannot
  fit, so a read from a lower tier would start only then, and the stores of the requests running
  while it waits push its history out of host (LRU). A request's keys are therefore handed over when
  it arrives, and a window over the waiting requests, in arrival order, holds their chunks: keys
  still in host are made recent (kept), keys found in a lower tier are read into host chunks while
  the tier's cost rule has room. The window (a quarter of host by default) holds distinct chunks (a
  prefix many requests share counts once) for each request until its load (``prepare_load``) or its
  end (``on_request_finished``); then the next requests' turn comes.

- Idle drain: vLLM calls the manager only while its engine steps, so writes queued when the server
  goes quiet (the last turn's stores, a tier's queue or budget full) would wait for the next request:
  a restart or another instance sharing the tier would miss them. A thread of ours takes in finished
  I/O and starts the queued writes once no scheduler call has come for ``IDLE_DRAIN_S``; every entry
  point holds one lock, which that thread only tries (it never makes the scheduler wait on a step).

A lower tier is any object with ``DiskTier``'s scheduler-facing surface (``tiers/contract.py``,
``LowerTier``).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ..tiers.contract import Failure, LowerTier, Op
from ..tiers.miss_reasons import Fate, MissReasons
from ..tiers.write_queue import WriteQueue
from . import compat

logger = logging.getLogger(__name__)

RESET_DRAIN_S = 30.0
PREFETCH_TTL_S = 120.0  # a prefetch whose request never loaded nor finished stops counting after this
PREFETCH_RETRY_S = 0.05  # the window tries again this often when nothing has changed (a tier's lookup)
LOG_EVERY_S = 30.0  # the tier's counters in the server log, when they moved
IDLE_DRAIN_S = 0.05  # no scheduler call for this long: the drain thread takes in I/O and starts queued writes
# vLLM's metrics (vLLM >= 0.28 publishes what a manager's get_stats reports), per tier:
# (name suffix, TierStats field, help); names are vllm:kv_offload_<tier>_<suffix>
TIER_COUNTERS = (
    ("hits", "hits", "Offloaded chunks read from the {tier} tier into host memory"),
    ("prefetches", "prefetches",
     "Chunks read from the {tier} tier when their request arrived, before the scheduler looked them up"),
    ("cost_misses", "misses_cost", "Chunks on the {tier} tier recomputed because reading them would not have been faster"),
    ("no_chunk_misses", "misses_no_chunk",
     "Chunks on the {tier} tier recomputed because no host chunk was free of pins to read them into"),
    ("read_bytes", "read_bytes", "Bytes read from the {tier} tier"),
    ("read_seconds", "read_seconds", "Seconds the {tier} tier's reads took (sum)"),
    ("write_bytes", "write_bytes", "Bytes written to the {tier} tier"),
    ("write_seconds", "write_seconds", "Seconds the {tier} tier's writes took (sum)"),
    ("stores", "stores", "Chunks written to the {tier} tier"),
    ("dropped_stores", "dropped_stores", "Chunks not written to the {tier} tier (full, read-only, queue full, failed)"),
    ("evictions", "evictions", "Chunks evicted from the {tier} tier by its byte budget"),
    ("checksum_failures", "checksum_failures",
     "{tier} records that failed their checksum or header check (removed, recomputed)"),
    ("read_timeouts", "timeouts", "{tier} reads past their deadline (recomputed)"),
)
TIER_GAUGES = (("usage_bytes", "used_bytes_now", "Bytes of records on the {tier} tier"),)


def tier_metrics(tier: str) -> tuple[list[tuple[str, str, str]], list[tuple[str, str, str]]]:
    """(counters, gauges) of one tier as (vLLM metric name, TierStats field, help)."""
    def rows(spec):
        return [(f"vllm:kv_offload_{tier}_{suffix}", attr, doc.format(tier=tier)) for suffix, attr, doc in spec]
    return rows(TIER_COUNTERS), rows(TIER_GAUGES)
_LIVE: "weakref.WeakSet[TieredManager]" = weakref.WeakSet()


def live_tier_managers() -> list["TieredManager"]:
    """Tier managers alive in this process (diagnostics and tests)."""
    return list(_LIVE)


def _locked(fn):
    """An entry point: holds the manager's lock (the idle drain thread's work never interleaves)."""

    @functools.wraps(fn)
    def call(self, *args, **kwargs):
        return self._entered(fn, self, *args, **kwargs)

    return call


class _IdleDrain(threading.Thread):
    """Every IDLE_DRAIN_S: the manager's ``_drain_if_idle``; ends with the manager or its shutdown."""

    def __init__(self, manager: "TieredManager"):
        super().__init__(name="npu-offload-tier-drain", daemon=True)
        self._ref = weakref.ref(manager)
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(IDLE_DRAIN_S):
            m = self._ref()
            if m is None:
                return
            m._drain_if_idle()
            del m


@dataclass
class _Prefetch:
    """One request's keys to hold in host, in prompt order; ``held``: those the window holds for it."""

    req_id: str
    keys: list
    since: float
    next: int = 0
    held: list = field(default_factory=list)
    done: bool = False


class TieredManager:
    """Wraps the host tier's ``OffloadingManager``; every call it does not override goes to it."""

    def __init__(self, host, tiers: list[LowerTier], prefetch_chunks: int = 0):
        """``prefetch_chunks``: host chunks the prefetch window holds for waiting requests, at most (0:
        no prefetch)."""
        if not tiers:
            raise ValueError("TieredManager needs at least one lower tier")
        if prefetch_chunks < 0:
            raise ValueError(f"TieredManager prefetch_chunks={prefetch_chunks!r}: must be >= 0")
        self._lock = threading.RLock()
        self._last_call = time.monotonic()
        self.host = host
        self.tiers = list(tiers)
        self._ctx = compat.make_req_context("npu-offload-disk-tier")
        self._hit, self._miss, self._defer = compat.LOOKUP_HIT, compat.LOOKUP_MISS, compat.LOOKUP_DEFER
        self._reported: dict[str, float] = {}
        self._logged = {t.name: "" for t in self.tiers}
        self._logged_at = time.monotonic()
        self._waiting = {t.name: WriteQueue() for t in self.tiers}
        self.misses = MissReasons()  # why lookups found a key in no tier (logged with the counters)
        self.prefetch_chunks = prefetch_chunks
        self._prefetch: dict[str, _Prefetch] = {}  # by request id, until its load or its end
        self._prefetch_queue: deque[_Prefetch] = deque()  # those with keys left, in arrival order
        self._held: dict = {}  # key -> waiting requests the window holds it for (a shared prefix once)
        self._prefetch_due = 0.0  # when the window next moves (0: at the next call)
        self.kept = 0  # host chunks kept in host for a waiting request (touched when its turn in the window came)
        self.idle_drains = 0  # times the drain thread found work while the scheduler was quiet
        self._prefetch_reads: set = set()  # keys whose read the window started, until it ends
        _LIVE.add(self)
        self._drain = _IdleDrain(self)
        self._drain.start()

    @property
    def tier(self) -> LowerTier:
        """The first lower tier (diagnostics and tests)."""
        return self.tiers[0]

    def _in_flight(self) -> int:
        return sum(t.in_flight() for t in self.tiers)

    def _entered(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` as a scheduler call: under the lock, the drain thread held off."""
        with self._lock:
            self._last_call = time.monotonic()
            return fn(*args, **kwargs)

    def _drain_if_idle(self) -> None:
        """The drain thread's turn: only when no scheduler call came for IDLE_DRAIN_S, I/O is pending,
        and the lock is free right now."""
        if not self._lock.acquire(blocking=False):
            return
        try:
            if time.monotonic() - self._last_call < IDLE_DRAIN_S:
                return
            if not (self._in_flight() or any(len(q) for q in self._waiting.values())):
                return
            self.idle_drains += 1
            self._settle()
        except Exception:  # noqa: BLE001 - the next scheduler call settles again; the thread must live on
            logger.exception("tier idle drain failed")
        finally:
            self._lock.release()

    @_locked
    def settle(self, timeout_s: float = 0.0) -> None:
        """Take in the tier's finished orders, waiting up to ``timeout_s`` for those in flight, and move
        the prefetch window (diagnostics and tests: vLLM never calls this inside a lookup)."""
        self._settle()
        end = time.monotonic() + timeout_s
        while self._in_flight() and time.monotonic() < end:
            time.sleep(0.005)
            self._settle()
        self._move_window()

    def __getattr__(self, name: str) -> Any:
        if name in ("host", "_lock"):  # not set yet (a half-built object): no recursion through here
            raise AttributeError(name)
        attr = getattr(self.host, name)  # the host's own calls (complete_load, take_events, ...) under the lock
        return functools.partial(self._entered, attr) if callable(attr) else attr

    @_locked
    def get_stats(self):
        """The host tier's stats plus the disk tier's counters, where vLLM has per-manager metrics."""
        get = getattr(self.host, "get_stats", None)
        stats = get() if get is not None else None
        if stats is None or not hasattr(stats, "increase_counter"):
            return stats
        self._settle()
        for t in self.tiers:
            counters, gauges = tier_metrics(t.name)
            for name, attr, _ in counters:
                value = getattr(t.stats, attr)
                stats.increase_counter(name, value - self._reported.get(name, 0))
                self._reported[name] = value
            for name, attr, _ in gauges:
                stats.set_gauge(name, getattr(t.stats, attr))
        return stats

    # -- completions ---------------------------------------------------------------------
    def _settle(self) -> None:
        for t in self.tiers:
            done = t.poll()
            if done:
                self._prefetch_due = 0.0  # reads ended: room in a tier's queue, chunks in host
            self._apply(t, done)
            self._start_writes(t)
        if time.monotonic() - self._logged_at >= LOG_EVERY_S:
            self._logged_at = time.monotonic()
            for t in self.tiers:
                now = t.stats.line()
                if now != self._logged[t.name]:
                    logger.info("%s tier: %s; %s; %s; prefetch window: %d host chunks kept for waiting requests",
                                t.name, now, t.describe_rate(), self.misses.line(), self.kept)
                    self._logged[t.name] = now

    def _apply(self, tier: LowerTier, completions) -> None:
        """A finished read completes (or drops) its host chunk; a finished write unpins it. A read the
        window started counts as prefetched once it has succeeded (so never more than the hits)."""
        for c in completions:
            if c.op is Op.READ:
                if c.key in self._prefetch_reads:
                    self._prefetch_reads.discard(c.key)
                    tier.stats.prefetches += int(c.ok)
                self.host.complete_store([c.key], self._ctx, c.ok)
            else:
                self.host.complete_load([c.key], self._ctx)
                self.misses.note([c.key], Fate.WRITTEN if c.ok else Fate.WRITE_FAILED)

    # -- lookups and promotions ----------------------------------------------------------
    @_locked
    def lookup(self, key, req_context):
        self._settle()
        if any(key in t.abandoned for t in self.tiers):
            return self._miss
        result = self.host.lookup(key, req_context)
        if result != self._miss and result is not False:
            return result
        if any(t.reading(key) for t in self.tiers):
            return self._defer
        for t in self.tiers:
            if t.has(key):  # an unknown key is queued for the tier's own lookup here
                return self._promote(t, key, result)
            if t.looking_up(key):
                return self._defer  # this tier answers soon; the step does not wait for it
        self.misses.missed(key, queued=any(key in q for q in self._waiting.values()))
        return result

    def _promote(self, tier: LowerTier, key, miss):
        """Read ``key`` from ``tier`` into a fresh host chunk; "not yet" while it runs, else ``miss``."""
        if not tier.worth_reading():
            self.misses.missed(key, queued=False, refused=True)
            return miss
        started = self._start_read(tier, key)
        if started is None:
            tier.stats.misses_no_chunk += 1
            return miss  # no host chunk free of pins right now: recompute
        return self._defer if started else miss

    def _start_read(self, tier: LowerTier, key) -> bool | None:
        """Order the read of ``key`` from ``tier`` into a fresh host chunk (completed or dropped when the
        read ends, ``_apply``); None if no host chunk is free of pins, False if the order was not sent."""
        out = self.host.prepare_store([key], self._ctx)
        if out is None or list(out.keys_to_store) != [key]:
            return None
        if not tier.start_read(key, int(out.store_spec.block_ids[0])):
            self.host.complete_store([key], self._ctx, False)
            return False
        return True

    # -- prefetch ------------------------------------------------------------------------
    @_locked
    def prefetch(self, keys, req_context) -> None:
        """Hold ``keys`` (one request's, in prompt order) in host ahead of vLLM's scheduler: those in
        host are kept, those on a lower tier are read, as far as the prefix is found somewhere and the
        window and the tiers have room."""
        if not self.prefetch_chunks or not keys:
            return
        rid = req_context.req_id
        self._release(rid)
        p = _Prefetch(rid, list(keys), time.monotonic())
        self._prefetch[rid] = p
        self._prefetch_queue.append(p)
        self._prefetch_due = 0.0
        self._move_window()

    def _move_window(self) -> None:
        """Advance the prefetch window, only where no request's host hits wait to be pinned: a read it
        starts takes a host chunk (``prepare_store``), which may evict one. vLLM looks a request up
        key by key and pins its hits in ``prepare_load`` within the same step, so the window never
        moves inside ``lookup`` (a hit evicted in between fails vLLM's assertion in ``prepare_load``),
        only in ``prefetch``, ``prepare_load`` (after the pin), ``prepare_store``, ``complete_store``,
        ``on_request_finished`` and ``on_schedule_end``; and only when something changed (a request
        came, was scheduled or ended, a read ended) or every PREFETCH_RETRY_S."""
        if self._prefetch and time.monotonic() >= self._prefetch_due:
            self._settle()
            self._prefetch_due = time.monotonic() + PREFETCH_RETRY_S
            self._run_prefetch()

    def _release(self, req_id: str) -> None:
        """The request loaded its hits or ended: its prefetched chunks no longer count."""
        p = self._prefetch.pop(req_id, None)
        if p is not None:
            p.done = True
            self._prefetch_due = 0.0
            for key in p.held:
                n = self._held[key] - 1
                if n:
                    self._held[key] = n
                else:
                    del self._held[key]

    def _run_prefetch(self) -> None:
        """Advance the oldest requests' prefetches until a tier or the cap has no room."""
        q = self._prefetch_queue
        now = time.monotonic()
        for p in [p for p in self._prefetch.values() if now - p.since > PREFETCH_TTL_S]:
            self._release(p.req_id)
        self._prefetch_due = now + PREFETCH_RETRY_S
        while q:
            p = q[0]
            if not p.done and not self._advance(p):
                return  # no room: the next call goes on where this one stopped
            q.popleft()

    def _advance(self, p: _Prefetch) -> bool:
        """Keep ``p``'s keys that are in host there and start reads of those on a tier, key by key;
        False if it has to wait for room, True once it is done."""
        kept: list = []
        try:
            return self._advance_keys(p, kept)
        finally:
            if kept:  # one touch in prompt order: vLLM's LRU then keeps the prefix longest
                self.host.touch(kept, self._ctx)

    def _advance_keys(self, p: _Prefetch, kept: list) -> bool:
        while p.next < len(p.keys):
            key = p.keys[p.next]
            if any(t.reading(key) for t in self.tiers):
                p.next += 1
                continue
            if self._ready_in_host(key):
                # still in host: made recent, and counted in the window, so that the stores of the
                # requests running meanwhile do not evict it while this one waits (measured on the
                # H200: a later turn's history was in host when it arrived and gone when it was scheduled)
                if not self._hold(p, key):
                    return False
                kept.append(key)
                self.kept += 1
                p.next += 1
                continue
            if any(key in t.abandoned for t in self.tiers):
                break
            tier = next((t for t in self.tiers if t.has(key)), None)
            if tier is None:
                if any(t.looking_up(key) for t in self.tiers):
                    for later in p.keys[p.next + 1:]:  # ask about the rest of the prefix meanwhile
                        for t in self.tiers:
                            t.has(later)
                    return False  # a tier answers soon
                break  # the prefix ends here: nothing after it can be a hit
            if self._window_full(key) or not tier.worth_reading(count=False):
                return False
            if not self._start_read(tier, key):
                break  # no host chunk free of pins, or the order not sent: the scheduler's lookup decides later
            self._prefetch_reads.add(key)
            self._hold(p, key)
            p.next += 1
        p.done = True
        return True

    def _window_full(self, key) -> bool:
        """Whether the window has no place for ``key`` (a key it holds already takes none)."""
        return key not in self._held and len(self._held) >= self.prefetch_chunks

    def _hold(self, p: _Prefetch, key) -> bool:
        """Count ``key`` in the window for ``p``; False if it is full."""
        if self._window_full(key):
            return False
        self._held[key] = self._held.get(key, 0) + 1
        p.held.append(key)
        return True

    @_locked
    def on_schedule_end(self, *args, **kwargs):
        """vLLM's last manager call of a step (0.23: no argument; >= 0.25: the step's context), after
        every ``prepare_load``: the window moves here at least once a step."""
        self._move_window()
        fn = getattr(self.host, "on_schedule_end", None)
        return fn(*args, **kwargs) if fn is not None else None

    @_locked
    def on_request_finished(self, req_context) -> None:
        self._release(req_context.req_id)
        self._move_window()  # the next waiting requests' turn in the window
        fn = getattr(self.host, "on_request_finished", None)
        if fn is not None:
            fn(req_context)

    # -- admission to disk ---------------------------------------------------------------
    def _admit(self, policy: str, keys) -> None:
        for t in self.tiers:
            if t.admit != policy:
                continue
            self._waiting[t.name].add([k for k in keys if t.needs_write(k)])
            self._start_writes(t)

    def _start_writes(self, t: LowerTier) -> None:
        """Start the writes ``t`` has room for, oldest admitted key first (tiers/write_queue.py)."""
        q = self._waiting[t.name]
        while len(q) and t.may_write():
            key = q.pop(lambda k: not t.needs_write(k), self._ready_in_host)
            if key is None:
                break
            spec = self.host.prepare_load([key], self._ctx)
            if not t.start_write(key, int(spec.block_ids[0])):
                self.host.complete_load([key], self._ctx)
        lost = q.take_dropped()
        if lost:
            t.stats.dropped_stores += len(lost)
            t.stats.count_failure(Failure.LEFT_HOST, len(lost))
            self.misses.note(lost, Fate.DROPPED)

    def _ready_in_host(self, key) -> bool:
        r = self.host.lookup(key, self._ctx)
        return r is True or r == self._hit

    @_locked
    def prepare_load(self, keys, req_context):
        self._settle()
        spec = self.host.prepare_load(keys, req_context)  # the hits are pinned before the window moves
        self._admit("reuse", list(keys))
        self._release(req_context.req_id)
        self._move_window()
        return spec

    @_locked
    def touch(self, keys, req_context):
        self.host.touch(keys, req_context)
        if any(t.admit == "reuse" for t in self.tiers):
            self._settle()
            self._admit("reuse", list(keys))

    @_locked
    def complete_store(self, keys, req_context, success: bool = True):
        keys = list(keys)
        self.host.complete_store(keys, req_context, success)
        if success:
            self.misses.note(keys, Fate.HOST)
        if success and any(t.admit == "all" for t in self.tiers):
            self._settle()
            self._admit("all", keys)
        self._move_window()

    @_locked
    def prepare_store(self, keys, req_context):
        self._settle()
        self._move_window()
        return self.host.prepare_store(keys, req_context)

    @_locked
    def reset_cache(self) -> None:
        # Chunks pinned by tier I/O must not be handed out again while a thread still uses them.
        end = time.monotonic() + RESET_DRAIN_S
        for t in self.tiers:
            self._apply(t, t.drain(max(0.0, end - time.monotonic())))
            if t.in_flight():
                logger.warning("%s tier: %d orders still in flight after %.0f s at reset", t.name, t.in_flight(),
                               RESET_DRAIN_S)
            t.abandoned.clear()
            self._waiting[t.name].clear()
        self._prefetch_reads.clear()
        for rid in list(self._prefetch):
            self._release(rid)
        self._prefetch_queue.clear()
        return self.host.reset_cache()

    @_locked
    def shutdown(self) -> None:
        self._drain.stop.set()
        for t in self.tiers:
            t.close()
        fn = getattr(self.host, "shutdown", None)
        if fn is not None:
            fn()


__all__ = ["TIER_COUNTERS", "TIER_GAUGES", "TieredManager", "live_tier_managers", "tier_metrics"]
