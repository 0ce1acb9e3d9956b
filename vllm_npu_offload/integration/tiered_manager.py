"""The scheduler side of ``NPUOffloadingSpec`` when a disk tier is configured: host, then disk.

vLLM's own host manager (``CPUOffloadingManager``, LRU/ARC) keeps deciding everything about host
chunks; this wrapper adds the tier below it, through the calls every vLLM from 0.23 on makes
(``lookup`` per key, ``prepare_load``, ``touch``, ``prepare_store``, ``complete_store``), so it
does not depend on vLLM's own tiering classes, whose contract changed with almost every release.

- A lookup that misses the host but hits the disk allocates a host chunk (``prepare_store``,
  evicting as any store would), orders the read on every rank and answers "not yet" (the request
  waits, the step does not); once every rank has read and verified its record, the chunk is
  completed and the next lookup is a host hit. A failed or late read is a miss.
- Admission (``disk_admit``): ``all`` writes every key stored to host (a conversation's next turn
  often comes after its KV has left host: only a write at store time has it on disk then);
  ``reuse`` writes a key the first time it is hit again while still in host (loaded from host, or
  found in the device's prefix cache), so keys no request reuses never cost a write. The chunk stays pinned
  (``prepare_load``) until the write has ended on every rank.
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import Any

from ..tiers.contract import Op
from ..tiers.disk_tier import DiskTier
from . import compat

logger = logging.getLogger(__name__)

RESET_DRAIN_S = 30.0
LOG_EVERY_S = 30.0  # the tier's counters in the server log, when they moved
# vLLM's metrics (vLLM >= 0.28 publishes what a manager's get_stats reports): (name, TierStats field, help)
DISK_COUNTERS = (
    ("vllm:kv_offload_disk_hits", "hits", "Offloaded chunks read from the disk tier into host memory"),
    ("vllm:kv_offload_disk_cost_misses", "misses_cost",
     "Chunks on the disk tier recomputed because reading them would not have been faster"),
    ("vllm:kv_offload_disk_no_chunk_misses", "misses_no_chunk",
     "Chunks on the disk tier recomputed because no host chunk was free of pins to read them into"),
    ("vllm:kv_offload_disk_read_bytes", "read_bytes", "Bytes read from the disk tier"),
    ("vllm:kv_offload_disk_read_seconds", "read_seconds", "Seconds the disk tier's reads took (sum)"),
    ("vllm:kv_offload_disk_write_bytes", "write_bytes", "Bytes written to the disk tier"),
    ("vllm:kv_offload_disk_write_seconds", "write_seconds", "Seconds the disk tier's writes took (sum)"),
    ("vllm:kv_offload_disk_stores", "stores", "Chunks written to the disk tier"),
    ("vllm:kv_offload_disk_dropped_stores", "dropped_stores",
     "Chunks not written to the disk tier (full, read-only, queue full, failed)"),
    ("vllm:kv_offload_disk_evictions", "evictions", "Chunks evicted from the disk tier by its byte budget"),
    ("vllm:kv_offload_disk_checksum_failures", "checksum_failures",
     "Disk records that failed their checksum or header check (removed, recomputed)"),
    ("vllm:kv_offload_disk_read_timeouts", "timeouts", "Disk reads past their deadline (recomputed)"),
)
DISK_GAUGES = (
    ("vllm:kv_offload_disk_usage_bytes", "used_bytes_now", "Bytes of records on the disk tier"),
)
_LIVE: "weakref.WeakSet[TieredManager]" = weakref.WeakSet()


def live_tier_managers() -> list["TieredManager"]:
    """Tier managers alive in this process (diagnostics and tests)."""
    return list(_LIVE)


class TieredManager:
    """Wraps the host tier's ``OffloadingManager``; every call it does not override goes to it."""

    def __init__(self, host, tier: DiskTier):
        self.host = host
        self.tier = tier
        self._ctx = compat.make_req_context("npu-offload-disk-tier")
        self._hit, self._miss, self._defer = compat.LOOKUP_HIT, compat.LOOKUP_MISS, compat.LOOKUP_DEFER
        self._reported: dict[str, float] = {}
        self._logged = ("", time.monotonic())
        _LIVE.add(self)

    def settle(self, timeout_s: float = 0.0) -> None:
        """Take in the tier's finished orders, waiting up to ``timeout_s`` for those in flight."""
        self._settle()
        end = time.monotonic() + timeout_s
        while self.tier.in_flight() and time.monotonic() < end:
            time.sleep(0.005)
            self._settle()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.host, name)

    def get_stats(self):
        """The host tier's stats plus the disk tier's counters, where vLLM has per-manager metrics."""
        get = getattr(self.host, "get_stats", None)
        stats = get() if get is not None else None
        if stats is None or not hasattr(stats, "increase_counter"):
            return stats
        self._settle()
        cur = self.tier.stats
        for name, attr, _ in DISK_COUNTERS:
            value = getattr(cur, attr)
            stats.increase_counter(name, value - self._reported.get(name, 0))
            self._reported[name] = value
        for name, attr, _ in DISK_GAUGES:
            stats.set_gauge(name, getattr(cur, attr))
        return stats

    # -- completions ---------------------------------------------------------------------
    def _settle(self) -> None:
        self._apply(self.tier.poll())
        line, at = self._logged
        if time.monotonic() - at >= LOG_EVERY_S:
            now = self.tier.stats.line()
            if now != line:
                logger.info("disk tier: %s; cost rule's read rate %.2f GB/s", now, self.tier.rate.value / 1e9)
            self._logged = (now, time.monotonic())

    def _apply(self, completions) -> None:
        """A finished read completes (or drops) its host chunk; a finished write unpins it."""
        for c in completions:
            if c.op is Op.READ:
                self.host.complete_store([c.key], self._ctx, c.ok)
            else:
                self.host.complete_load([c.key], self._ctx)

    # -- lookups and promotions ----------------------------------------------------------
    def lookup(self, key, req_context):
        self._settle()
        if key in self.tier.abandoned:
            return self._miss
        result = self.host.lookup(key, req_context)
        if result != self._miss and result is not False:
            return result
        if self.tier.reading(key):
            return self._defer
        if not self.tier.has(key) or not self.tier.worth_reading():
            return result
        out = self.host.prepare_store([key], self._ctx)
        if out is None or list(out.keys_to_store) != [key]:
            self.tier.stats.misses_no_chunk += 1
            return result  # no host chunk free of pins right now: recompute
        chunk = int(out.store_spec.block_ids[0])
        if not self.tier.start_read(key, chunk):
            self.host.complete_store([key], self._ctx, False)
            return result
        return self._defer

    # -- admission to disk ---------------------------------------------------------------
    def _admit(self, keys) -> None:
        if not self.tier.may_write():
            return
        todo = [k for k in keys if self.tier.wants_write(k) and self._ready_in_host(k)]
        if not todo:
            return
        spec = self.host.prepare_load(todo, self._ctx)
        for key, chunk in zip(todo, spec.block_ids):
            if not self.tier.start_write(key, int(chunk)):
                self.host.complete_load([key], self._ctx)

    def _ready_in_host(self, key) -> bool:
        r = self.host.lookup(key, self._ctx)
        return r is True or r == self._hit

    def prepare_load(self, keys, req_context):
        self._settle()
        spec = self.host.prepare_load(keys, req_context)
        if self.tier.cfg.admit == "reuse":
            self._admit(list(keys))
        return spec

    def touch(self, keys, req_context):
        self.host.touch(keys, req_context)
        if self.tier.cfg.admit == "reuse":
            self._settle()
            self._admit(list(keys))

    def complete_store(self, keys, req_context, success: bool = True):
        self.host.complete_store(keys, req_context, success)
        if success and self.tier.cfg.admit == "all":
            self._settle()
            self._admit(list(keys))

    def prepare_store(self, keys, req_context):
        self._settle()
        return self.host.prepare_store(keys, req_context)

    def reset_cache(self) -> None:
        # Chunks pinned by tier I/O must not be handed out again while a thread still uses them.
        self._apply(self.tier.drain(RESET_DRAIN_S))
        if self.tier.in_flight():
            logger.warning("disk tier: %d orders still in flight after %.0f s at reset", self.tier.in_flight(),
                           RESET_DRAIN_S)
        self.tier.abandoned.clear()
        return self.host.reset_cache()

    def shutdown(self) -> None:
        self.tier.close()
        fn = getattr(self.host, "shutdown", None)
        if fn is not None:
            fn()


__all__ = ["TieredManager", "live_tier_managers"]
