"""The scheduler side's sockets to every rank's tier server, shared by the disk and Mooncake tiers.

A background thread (re)connects to each rank's address; a thread per connection puts what the rank
says (``Hello``, ``Done``) on the tier's event queue, and ``("down", rank)`` when it goes away. An
order goes to every rank; a rank that did not get it answers nothing, so the order never ends and
its read misses its deadline.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from .channel import connect
from .contract import Completion, Done, Failure, Hello, Op, Order, RecordIdentity

logger = logging.getLogger(__name__)

RECONNECT_S = 0.2
DEADLINE_CHECK_S = 0.02


@dataclass
class PendingOrder:
    """An order sent to every rank, until each has answered."""

    key: bytes
    op: Op
    chunk: int
    ranks_left: set[int]
    started: float
    ok: bool = True
    nbytes: int = 0
    seconds: float = 0.0
    failures: list[Failure] = field(default_factory=list)

    def answered(self, d: Done, tier: str) -> bool:
        """Take one rank's answer; True once every rank has answered."""
        self.ranks_left.discard(d.rank)
        self.nbytes += d.nbytes
        self.seconds = max(self.seconds, d.seconds)
        if not d.ok:
            self.ok = False
            self.failures.append(d.failure or Failure.IO_ERROR)
            logger.debug("%s tier: %s of %s failed on rank %d: %s", tier, d.op.value, self.key.hex()[:16], d.rank,
                         d.detail)
        return not self.ranks_left


class RankLinks:
    def __init__(self, addresses: list[str], events: queue.SimpleQueue, name: str):
        self.addresses = addresses
        self.conns: list = [None] * len(addresses)
        self.events = events
        self._name = name
        self._closed = threading.Event()
        threading.Thread(target=self._connect_all, name=f"npu-kv-{name}-connect", daemon=True).start()

    @property
    def all_up(self) -> bool:
        return all(c is not None for c in self.conns)

    def lost(self, rank: int) -> None:
        self.conns[rank] = None

    def send(self, order: Order) -> int:
        """Send ``order`` to every rank; returns how many got it."""
        sent = 0
        for rank, conn in enumerate(self.conns):
            try:
                conn.send(order)
                sent += 1
            except (OSError, AttributeError):
                self.conns[rank] = None
        return sent

    def close(self) -> None:
        self._closed.set()
        for c in self.conns:
            if c is not None:
                try:
                    c.close()
                except OSError:
                    pass

    def _connect_all(self) -> None:
        while not self._closed.is_set():
            for rank, addr in enumerate(self.addresses):
                if self.conns[rank] is not None:
                    continue
                try:
                    conn = connect(addr)
                except OSError:
                    continue
                self.conns[rank] = conn
                threading.Thread(target=self._receive, args=(rank, conn), name=f"npu-kv-{self._name}-recv-r{rank}",
                                 daemon=True).start()
            self._closed.wait(RECONNECT_S)

    def _receive(self, rank: int, conn) -> None:
        try:
            while True:
                self.events.put(conn.recv())
        except (EOFError, OSError):
            self.events.put(("down", rank))


class OrderedTier:
    """What the disk and Mooncake tiers' scheduler sides share: orders to every rank, their
    bookkeeping, the read and write queues in bytes, the cost rule. A subclass sets ``name``, ``cfg``
    (``world_size``, ``read_queue_s``, ``prefill_tokens_per_s``, ``tokens_per_key``,
    ``max_write_backlog_bytes``), ``stats``, ``rate``, ``key_bytes``, ``up``, ``writable`` and
    ``_stores_paused_until``, defines ``needs_write``, and calls ``_init_orders`` first."""

    name = "tier"

    def _init_orders(self, addresses: list[str]) -> None:
        self.abandoned: set[bytes] = set()
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._links = RankLinks(addresses, self._events, self.name)
        self._pending: dict[int, PendingOrder] = {}
        self._reads: dict[bytes, int] = {}  # key -> seq
        self._writes: dict[bytes, int] = {}
        self._seq = 0
        self._read_backlog = 0
        self._write_backlog = 0
        self._warned: set[str] = set()
        self._next_deadline_check = 0.0
        self._hellos: dict[int, Hello] = {}

    def _identity_of(self, h: Hello, ready: bool) -> RecordIdentity | None:
        """Take ``h``; the ranks' common record identity once every rank has said hello (None before,
        when the tier is ``ready`` already, or when the ranks disagree: then the tier stays off)."""
        self._hellos[h.rank] = h
        if ready or len(self._hellos) < self.cfg.world_size:
            return None
        ids = {x.identity for x in self._hellos.values()}
        if len(ids) != 1:
            logger.error("%s tier off: the ranks disagree on the record identity (%s)", self.name, ids)
            return None
        return ids.pop()

    def _take_events(self) -> list[Completion]:
        """Everything the ranks said since the last call: hellos, answers (the orders that ended on
        every rank come back), ranks gone; other events go to ``_on_event``. Then the read deadlines."""
        out: list[Completion] = []
        while True:
            try:
                ev = self._events.get_nowait()
            except queue.Empty:
                break
            if isinstance(ev, Hello):
                self._on_hello(ev)
            elif isinstance(ev, Done):
                c = self._on_done(ev)
                if c is not None:
                    out.append(c)
            elif ev[0] == "down":
                self._links.lost(ev[1])
                self._warn_once(f"down{ev[1]}", "%s tier: rank %d's worker went away; the tier is off", self.name,
                                ev[1])
            else:
                self._on_event(ev)
        now = time.monotonic()
        if self._reads and now >= self._next_deadline_check:  # poll runs on every lookup: look now and then
            self._next_deadline_check = now + DEADLINE_CHECK_S
            for key, seq in self._reads.items():
                if key not in self.abandoned and now - self._pending[seq].started > self.cfg.read_timeout_s:
                    self.abandoned.add(key)
                    self.stats.timeouts += 1
                    self._warn_once("timeout", "%s tier: a read took over %.1f s; its request recomputes", self.name,
                                    self.cfg.read_timeout_s)
        return out

    def _on_event(self, ev) -> None:
        pass

    def _on_done(self, d: Done) -> Completion | None:
        """One rank's answer; the order's completion once every rank has answered (then the queues in
        bytes, the read rate and the subclass's ``_finish_read`` / ``_finish_write``)."""
        p = self._pending.get(d.seq)
        if p is None or not p.answered(d, self.name):
            return None
        del self._pending[d.seq]
        if p.op is Op.READ:
            self._reads.pop(p.key, None)
            self._read_backlog -= self.key_bytes
            self.rate.ended(self.key_bytes, self._read_backlog, time.monotonic())
            self.abandoned.discard(p.key)
            self._finish_read(p)
        else:
            self._writes.pop(p.key, None)
            self._write_backlog -= self.key_bytes
            self._finish_write(p)
        return Completion(p.key, p.op, p.ok, p.chunk)

    def _readable(self) -> bool:
        """Whether the tier can take reads at all now (subclasses say)."""
        return True

    def worth_reading(self, count: bool = True) -> bool:
        """The cost rule for one more key now: the queued reads, this key included, drain within
        ``read_queue_s`` at the measured rate and, with a prefill rate, beat recomputing the key.
        ``count``: a refusal is a recomputed key (a prefetch that waits for room is not)."""
        if not self._readable() or self.rate.value <= 0:
            return False
        seconds = (self._read_backlog + self.key_bytes) / self.rate.value
        ok = seconds < self.cfg.read_queue_s
        if ok and self.cfg.prefill_tokens_per_s > 0:
            ok = seconds < self.cfg.tokens_per_key / self.cfg.prefill_tokens_per_s
        if not ok and count:
            self.stats.misses_cost += 1
        return ok

    def may_write(self) -> bool:
        return (self.up and self.writable and time.monotonic() >= self._stores_paused_until
                and self._write_backlog < self.cfg.max_write_backlog_bytes)

    def needs_write(self, key: bytes) -> bool:  # each tier knows what it holds
        raise NotImplementedError

    def describe_rate(self) -> str:
        return f"cost rule's read rate {self.rate.value / 1e9:.2f} GB/s"

    def _warn_once(self, what: str, msg: str, *args) -> None:
        if what not in self._warned:
            self._warned.add(what)
            logger.warning(msg, *args)

    def reading(self, key: bytes) -> bool:
        return key in self._reads

    def writing(self, key: bytes) -> bool:
        return key in self._writes

    def in_flight(self) -> int:
        return len(self._pending)

    def drain(self, timeout_s: float) -> list:
        return drain(self, timeout_s)

    def drop_store(self, failure: Failure = Failure.BUSY) -> None:
        self.stats.dropped_stores += 1
        self.stats.count_failure(failure)

    def _send(self, op: Op, key: bytes, chunk: int) -> bool:
        self._seq += 1
        order = Order(self._seq, op, key, chunk)
        self._pending[self._seq] = PendingOrder(key, op, chunk, set(range(self.cfg.world_size)), time.monotonic())
        if self._links.send(order) == 0:
            del self._pending[self._seq]
            return False
        # a rank that did not get the order answers nothing; the order then never ends (its deadline)
        return True

    def start_read(self, key: bytes, chunk: int) -> bool:
        if not self._send(Op.READ, key, chunk):
            return False
        self._reads[key] = self._seq
        self.rate.started(self._read_backlog, time.monotonic())
        self._read_backlog += self.key_bytes
        return True

    def start_write(self, key: bytes, chunk: int) -> bool:
        if not self._send(Op.WRITE, key, chunk):
            return False
        self._writes[key] = self._seq
        self._write_backlog += self.key_bytes
        return True


def drain(tier, timeout_s: float) -> list:
    """Wait (blocking) until ``tier`` has no order in flight, at most ``timeout_s``; for resets only."""
    out = tier.poll()
    end = time.monotonic() + timeout_s
    while tier.in_flight() and time.monotonic() < end:
        time.sleep(0.005)
        out += tier.poll()
    return out


__all__ = ["OrderedTier", "PendingOrder", "RankLinks", "drain"]
