"""The disk tier's background thread: deletes the records the scheduler evicted and rescans the folder.

Both run off the scheduler's thread, and deletions never wait for a scan: a scan of a folder of
thousands of records, on a server whose engine thread holds the GIL most of the time, takes long
enough for evictions to pile up, and every record still waiting to be deleted is on disk beyond
the budget. So a scan deletes what is queued after every subdirectory it lists, and stats only
the files it has not seen before (their modification time orders other servers' records).

What the scheduler hears, in this order, on its event queue:
- ``("deleted", done)``: the first ``done`` keys it sent are gone from every rank;
- ``("scan", done, keys)``: the whole records on disk, oldest first, less every key deleted while
  the scan ran (the scan may have listed it before it went); ``done`` as at the scan's end, so
  that the scheduler leaves out the keys it sent that were not deleted yet.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time

from .disk_io import TMP_MARK, RecordFiles, key_hex

logger = logging.getLogger(__name__)


class DiskJanitor:
    def __init__(self, files: RecordFiles, world_size: int, rescan_s: float, events: queue.SimpleQueue,
                 closed: threading.Event):
        self.files = files
        self.world_size = world_size
        self.rescan_s = rescan_s  # 0: one scan, at start-up
        self.events = events
        self.closed = closed
        self._to_delete: queue.SimpleQueue = queue.SimpleQueue()
        self._done = 0  # keys deleted, in the order they were sent (this thread only)
        self._mtimes: dict[str, float] = {}  # record file name -> mtime, as of the last scan

    def delete(self, key: bytes) -> None:
        """Queue every rank's record of ``key`` for deletion (any thread)."""
        self._to_delete.put(key)

    def start(self) -> "DiskJanitor":
        threading.Thread(target=self._run, name="npu-kv-disk-janitor", daemon=True).start()
        return self

    def _run(self) -> None:
        # the thread must outlive anything a folder can do to it: writes wait for its deletions
        next_scan, warned = 0.0, False
        while not self.closed.is_set():
            try:
                if time.monotonic() >= next_scan:
                    next_scan = time.monotonic() + self.rescan_s if self.rescan_s > 0 else float("inf")
                    self.scan()
                try:
                    key = self._to_delete.get(timeout=0.5)
                except queue.Empty:
                    continue
                self._delete_queued(first=key)
            except Exception as e:  # noqa: BLE001 - logged once; the next round tries again
                if not warned:
                    warned = True
                    logger.warning("disk tier: the janitor of %s failed (%r); it goes on", self.files.dir, e)
                time.sleep(0.5)

    def _delete_queued(self, first: bytes | None = None) -> list[bytes]:
        """Delete ``first`` and every key queued now; tell the scheduler; returns the keys."""
        keys = [] if first is None else [first]
        while True:
            try:
                keys.append(self._to_delete.get_nowait())
            except queue.Empty:
                break
        try:
            for key in keys:
                for rank in range(self.world_size):
                    self.files.remove(key, rank)
        finally:  # counted even if a removal raised: the scheduler's budget waits on this count
            if keys:
                self._done += len(keys)
                self.events.put(("deleted", self._done))
        return keys

    def scan(self) -> None:
        """List the whole records (every rank's file there), oldest first, deleting between directories."""
        found: dict[str, tuple[set[int], float]] = {}
        seen: dict[str, float] = {}
        deleted: set[str] = set()
        directory = self.files.dir
        try:
            subs = [e.path for e in os.scandir(directory) if e.is_dir()]
        except OSError:  # not there (yet), or unreadable: nothing to list
            subs = []
        for sub in subs:
            try:
                entries = list(os.scandir(sub))
            except OSError:
                continue
            for f in entries:
                name = f.name
                if TMP_MARK in name:
                    continue
                stem, dot, rank = name.rpartition(".r")
                if not dot or not rank.isdigit():
                    continue
                mtime = self._mtimes.get(name)
                if mtime is None:
                    try:
                        mtime = f.stat().st_mtime
                    except OSError:
                        continue
                seen[name] = mtime
                ranks, newest = found.get(stem, (set(), 0.0))
                ranks.add(int(rank))
                found[stem] = (ranks, max(newest, mtime))
            deleted.update(key_hex(k) for k in self._delete_queued())  # as the files name them
        self._mtimes = seen
        whole = sorted((mtime, stem) for stem, (ranks, mtime) in found.items()
                       if ranks >= set(range(self.world_size)) and stem not in deleted)
        keys = []
        for _, stem in whole:
            try:
                keys.append(bytes.fromhex(stem))
            except ValueError:
                continue
        self.events.put(("scan", self._done, keys))


__all__ = ["DiskJanitor"]
