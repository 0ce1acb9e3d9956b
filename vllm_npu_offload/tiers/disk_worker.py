"""A rank's side of the disk tier: reads and writes whole host chunks on its own threads.

It owns nothing the scheduler does not hand it: an order names a key and a host chunk, and the
scheduler has pinned that chunk in its host-tier manager for the order's whole life (a write's
chunk cannot be evicted or rewritten, a read's chunk is loadable only after the read is done), so
the I/O threads never race a device transfer. The model's step and the engine's thread never wait
for any of it.

Reads go first: a read has a request waiting (deferred) for it, a write is only an investment in a
later hit. Queued reads are taken before queued writes, and writes hold at most half the threads,
so a read that arrives behind a burst of stores finds a thread free.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import deque
from pathlib import Path

from .. import faults
from .channel import listen, serve, unlisten
from .contract import Done, Failure, Hello, Op, Order, RecordIdentity
from .disk_io import RecordFiles, TierIOError, page_buffer, probe_rates, remove_stale_temporaries
from .record import HEADER_BYTES, RecordError

logger = logging.getLogger(__name__)

IO_THREADS = 4  # a few reads in flight keep a disk's queue busy; CRC-32C runs on the same threads


class DiskTierServer:
    """Serves one scheduler connection at a time on ``address`` for one rank's host buffer."""

    def __init__(self, host: memoryview, identity: RecordIdentity, rank: int, root: str, address: str,
                 probe_bytes: int = 64 << 20, io_threads: int = IO_THREADS):
        self.host = host
        self.identity = identity
        self.rank = rank
        self.files = RecordFiles(Path(root), identity.fingerprint())
        self.address = address
        self.chunk_bytes = identity.chunk_bytes
        self.num_chunks = host.nbytes // self.chunk_bytes
        self._cv = threading.Condition()
        self._reads: deque = deque()  # (conn, order)
        self._writes: deque = deque()
        self._writing = 0
        self._max_writers = max(1, io_threads // 2)
        self._headers: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(io_threads):
            self._headers.put(page_buffer())
        self._io = [threading.Thread(target=self._io_loop, name=f"npu-kv-disk-r{rank}-{i}", daemon=True)
                    for i in range(io_threads)]
        self._send_lock = threading.Lock()
        self._faults = faults.active()  # None unless the test hook is set
        self._closed = False
        self.writable, self.read_rate, self.write_rate = self._prepare(probe_bytes)
        self._listener = listen(address)
        self._thread = threading.Thread(target=self._serve, name=f"npu-kv-disk-accept-r{rank}", daemon=True)
        self._thread.start()
        for t in self._io:
            t.start()
        logger.info(
            "disk tier (rank %d): %s, record %d bytes, %s I/O, read %.2f GB/s, write %.2f GB/s%s",
            rank, self.files.dir, self.chunk_bytes, "direct" if self.files.direct else "buffered",
            self.read_rate / 1e9, self.write_rate / 1e9, "" if self.writable else ", read-only: no stores",
        )

    def _prepare(self, probe_bytes: int) -> tuple[bool, float, float]:
        try:
            self.files.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            remove_stale_temporaries(self.files.dir)
            st = os.statvfs(self.files.dir)
            room = st.f_bavail * st.f_frsize // 8 // 4096 * 4096  # never fill a small filesystem to probe it
            read, write = probe_rates(self.files, max(4096, min(probe_bytes, room)))
            return True, read, write
        except (OSError, TierIOError) as e:
            logger.warning("disk tier (rank %d): %s is not writable (%s): it serves reads only", self.rank,
                           self.files.dir, e)
            return False, 0.0, 0.0

    def hello(self) -> Hello:
        return Hello(self.rank, self.identity, self.writable, self.files.direct, self.read_rate, self.write_rate)

    # -- serving -------------------------------------------------------------------------
    def _serve(self) -> None:
        serve(self._listener, self.hello, self._enqueue, lambda: self._closed)

    def _enqueue(self, conn, order: Order) -> None:
        with self._cv:
            (self._reads if order.op is Op.READ else self._writes).append((conn, order))
            self._cv.notify()

    def _next(self):
        """The next order for an I/O thread: a read if any, else a write if a write slot is free."""
        with self._cv:
            while True:
                if self._closed:
                    return None
                if self._reads:
                    return self._reads.popleft()
                if self._writes and self._writing < self._max_writers:
                    self._writing += 1
                    return self._writes.popleft()
                self._cv.wait()

    def _io_loop(self) -> None:
        while (item := self._next()) is not None:
            conn, order = item
            try:
                done = self.execute(order)
            finally:
                if order.op is Op.WRITE:
                    with self._cv:
                        self._writing -= 1
                        self._cv.notify()
            try:
                with self._send_lock:
                    conn.send(done)
            except OSError:
                pass

    def execute(self, order: Order) -> Done:
        """Carry out one order now (on the calling thread); never raises."""
        t0 = time.perf_counter()
        if not 0 <= order.chunk < self.num_chunks:
            return Done(order.seq, self.rank, order.op, False, failure=Failure.IO_ERROR,
                        detail=f"host chunk {order.chunk} out of range [0, {self.num_chunks})")
        view = self.host[order.chunk * self.chunk_bytes:(order.chunk + 1) * self.chunk_bytes]
        hdr = self._headers.get()
        try:
            if self._faults is not None:
                self._inject(order)
            if order.op is Op.READ:
                n = self.files.read_into(order.key, self.rank, self.identity.world_size, view, hdr)
            else:
                if not self.writable:
                    raise TierIOError(Failure.READ_ONLY, f"{self.files.dir} is read-only")
                n = self.files.write_from(order.key, self.rank, self.identity.world_size, view, hdr)
            return Done(order.seq, self.rank, order.op, True, n, time.perf_counter() - t0)
        except RecordError as e:
            self.files.remove(order.key, self.rank)  # never to be read again
            return Done(order.seq, self.rank, order.op, False, failure=e.failure, detail=str(e))
        except TierIOError as e:
            return Done(order.seq, self.rank, order.op, False, failure=e.failure, detail=str(e))
        except Exception as e:  # a tier never takes the worker down: the order fails, the key is a miss
            return Done(order.seq, self.rank, order.op, False, failure=Failure.IO_ERROR, detail=repr(e))
        finally:
            self._headers.put(hdr)

    def _inject(self, order: Order) -> None:
        """The test hook (faults.py): fail the order, or damage the record it is about to read."""
        f = self._faults
        if order.op is Op.READ and f.hit("disk_read"):
            raise TierIOError(Failure.IO_ERROR, "injected read error (NPU_OFFLOAD_FAULTS)")
        if order.op is Op.WRITE and f.hit("disk_write"):
            raise TierIOError(Failure.IO_ERROR, "injected write error (NPU_OFFLOAD_FAULTS)")
        if order.op is Op.READ and f.hit("disk_corrupt"):
            path = self.files.path(order.key, self.rank)
            try:
                with open(path, "r+b") as fh:  # one payload byte flipped: the checksum must catch it
                    fh.seek(HEADER_BYTES)
                    b = fh.read(1)
                    if b:
                        fh.seek(HEADER_BYTES)
                        fh.write(bytes([b[0] ^ 0xFF]))
            except OSError:
                pass  # no record to damage: the read misses anyway

    def shutdown(self) -> None:
        self._closed = True
        unlisten(self._listener, self.address)
        with self._cv:
            self._cv.notify_all()
        for t in self._io:
            t.join()


__all__ = ["DiskTierServer"]
