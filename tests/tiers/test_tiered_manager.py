"""The manager over vLLM's own host manager with two lower tiers in order: which tier a hit is read
from, a tier that has not answered yet, writes to every tier with the chunk pinned until each ends.
The tiers here are in-memory stand-ins of the ``LowerTier`` contract; the real ones have their own
tests (test_disk_tier.py, test_disk_engine.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager  # noqa: E402

from vllm_npu_offload.integration import compat  # noqa: E402
from vllm_npu_offload.integration.tiered_manager import TieredManager, tier_metrics  # noqa: E402
from vllm_npu_offload.tiers.contract import Completion, Op, TierStats  # noqa: E402

CTX = compat.make_req_context("test")


class MemTier:
    """Orders end when ``finish`` says so (``poll`` then reports them); ``unknown`` keys are still
    being looked up."""

    def __init__(self, name: str, keys=(), admit: str = "all"):
        self.name, self.admit = name, admit
        self.keys = set(keys)
        self.unknown: set[bytes] = set()
        self.abandoned: set[bytes] = set()
        self.stats = TierStats()
        self.orders: list[tuple[Op, bytes, int]] = []
        self.ended: list[Completion] = []
        self.log: list[tuple[Op, bytes, int]] = []

    def has(self, key): return key in self.keys
    def looking_up(self, key): return key in self.unknown
    def reading(self, key): return any(o == Op.READ and k == key for o, k, _ in self.orders)
    def worth_reading(self): return True
    def may_write(self): return True
    def wants_write(self, key): return key not in self.keys and not any(k == key for _, k, _ in self.orders)
    def in_flight(self): return len(self.orders)
    def describe_rate(self): return "-"
    def close(self): pass

    def start_read(self, key, chunk):
        self.orders.append((Op.READ, key, chunk))
        self.log.append((Op.READ, key, chunk))
        return True

    def start_write(self, key, chunk):
        self.orders.append((Op.WRITE, key, chunk))
        self.log.append((Op.WRITE, key, chunk))
        return True

    def finish(self):
        for op, k, c in self.orders:
            if op is Op.WRITE:
                self.keys.add(k)
            self.stats.count_done(op, 1, 0.0)
            self.ended.append(Completion(k, op, True, c))
        self.orders = []

    def poll(self):
        out, self.ended = self.ended, []
        return out

    def drain(self, timeout_s):
        self.finish()
        return self.poll()


def hit(r):
    return r is True or r == compat.LOOKUP_HIT


def defer(r):
    """"Not yet": vLLM's retry, or (vLLM >= 0.32) its hit on a chunk whose store has not ended."""
    return r is None or r == compat.LOOKUP_DEFER or getattr(r, "name", "") == "HIT_PENDING"


def test_a_hit_is_read_from_the_first_tier_that_has_it():
    host = CPUOffloadingManager(num_chunks=4)
    disk, store = MemTier("disk", {b"a"}), MemTier("mooncake", {b"a", b"b"})
    m = TieredManager(host, [disk, store])
    assert defer(m.lookup(b"b", CTX)) and defer(m.lookup(b"a", CTX))
    assert [(o, k) for o, k, _ in store.log] == [(Op.READ, b"b")] and [(o, k) for o, k, _ in disk.log] == [(Op.READ, b"a")]
    assert defer(m.lookup(b"b", CTX))  # read in flight: still "not yet", no second read
    assert len(store.log) == 1
    disk.finish()
    store.finish()
    m.settle()
    assert hit(m.lookup(b"a", CTX)) and hit(m.lookup(b"b", CTX))
    assert not hit(m.lookup(b"c", CTX)) and not defer(m.lookup(b"c", CTX))


def test_a_tier_that_has_not_answered_defers_and_later_tiers_wait():
    host = CPUOffloadingManager(num_chunks=4)
    first, second = MemTier("mooncake"), MemTier("disk", {b"k"})
    first.unknown.add(b"k")
    m = TieredManager(host, [first, second])
    assert defer(m.lookup(b"k", CTX)) and second.log == []  # the order is kept: ask the first tier first
    first.unknown.clear()
    assert defer(m.lookup(b"k", CTX)) and [k for _, k, _ in second.log] == [b"k"]


def test_stores_go_to_every_tier_and_the_chunk_stays_pinned_until_both_end():
    host = CPUOffloadingManager(num_chunks=1)
    disk, store = MemTier("disk"), MemTier("mooncake")
    m = TieredManager(host, [disk, store])
    out = m.prepare_store([b"x"], CTX)
    m.complete_store(list(out.keys_to_store), CTX)
    assert [k for _, k, _ in disk.log] == [b"x"] and [k for _, k, _ in store.log] == [b"x"]
    # the only chunk is pinned by both writes: nothing can be stored over it yet
    blocked = host.prepare_store([b"y"], CTX)
    assert blocked is None or list(blocked.keys_to_store) == []
    disk.finish()  # one write ended, the other has not: still pinned
    m.settle()
    blocked = host.prepare_store([b"y"], CTX)
    assert blocked is None or list(blocked.keys_to_store) == []
    store.finish()
    m.settle()
    free = host.prepare_store([b"y"], CTX)
    assert list(free.keys_to_store) == [b"y"]


def test_each_tier_has_its_own_metric_names():
    counters, gauges = tier_metrics("mooncake")
    names = [n for n, _, _ in counters + gauges]
    assert "vllm:kv_offload_mooncake_hits" in names and "vllm:kv_offload_mooncake_usage_bytes" in names
    assert all("mooncake" in doc for _, _, doc in counters)
    assert [n for n, _, _ in tier_metrics("disk")[0]][0] == "vllm:kv_offload_disk_hits"
