"""The scheduler side's sockets to every rank's tier server, shared by the disk and Mooncake tiers.

A background thread (re)connects to each rank's address; a thread per connection puts what the rank
says (``Hello``, ``Done``) on the tier's event queue, and ``("down", rank)`` when it goes away. An
order goes to every rank; a rank that did not get it answers nothing, so the order never ends and
its read misses its deadline.
"""

from __future__ import annotations

import queue
import threading
import time

from .channel import connect
from .contract import Order

RECONNECT_S = 0.2


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


def drain(tier, timeout_s: float) -> list:
    """Wait (blocking) until ``tier`` has no order in flight, at most ``timeout_s``; for resets only."""
    out = tier.poll()
    end = time.monotonic() + timeout_s
    while tier.in_flight() and time.monotonic() < end:
        time.sleep(0.005)
        out += tier.poll()
    return out


__all__ = ["RankLinks", "drain"]
