"""The manager over vLLM's own host manager with two lower tiers in order: which tier a hit is read
from, a tier that has not answered yet, writes to every tier with the chunk pinned until each ends.
The tiers here are in-memory stand-ins of the ``LowerTier`` contract; the real ones have their own
tests (test_disk_tier.py, test_disk_engine.py)."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm")

from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager  # noqa: E402

from vllm_npu_offload.integration import compat, tiered_manager  # noqa: E402
from vllm_npu_offload.integration.tiered_manager import PREFETCH_RETRY_S, TieredManager, tier_metrics  # noqa: E402
from vllm_npu_offload.tiers.contract import Completion, Op, TierStats  # noqa: E402

CTX = compat.make_req_context("test")


@pytest.fixture(autouse=True)
def no_idle_drain(request, monkeypatch):
    """These tests end the stand-in tiers' orders themselves, step by step: the drain thread (tested
    on its own below) stays out of their way unless a test asks for it."""
    if "idle_drain" not in request.keywords:
        monkeypatch.setattr(tiered_manager, "IDLE_DRAIN_S", 3600.0)


class MemTier:
    """Orders end when ``finish`` says so (``poll`` then reports them); ``unknown`` keys are still
    being looked up."""

    def __init__(self, name: str, keys=(), admit: str = "all", room: int = 1 << 30):
        self.name, self.admit, self.room = name, admit, room  # room: writes in flight at most
        self.keys = set(keys)
        self.unknown: set[bytes] = set()
        self.abandoned: set[bytes] = set()
        self.stats = TierStats()
        self.orders: list[tuple[Op, bytes, int]] = []
        self.ended: list[Completion] = []
        self.log: list[tuple[Op, bytes, int]] = []

    def has(self, key): return key in self.keys and key not in self.unknown
    def looking_up(self, key): return key in self.unknown
    def reading(self, key): return any(o == Op.READ and k == key for o, k, _ in self.orders)
    def worth_reading(self, count=True): return not self.full
    full = False  # the cost rule refuses every read
    def may_write(self): return sum(o is Op.WRITE for o, _, _ in self.orders) < self.room
    def needs_write(self, key): return key not in self.keys and not any(k == key for _, k, _ in self.orders)
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


def test_stores_wait_for_room_oldest_first_and_one_that_left_host_drops_the_rest_of_its_batch():
    """A tier with room for two writes at a time: the rest wait (not skipped), start in store order
    as writes end, and a waiting key evicted from host is dropped with its batch's later keys."""
    host = CPUOffloadingManager(num_chunks=8)
    disk = MemTier("disk", room=2)
    m = TieredManager(host, [disk])
    first = [b"a1", b"a2", b"a3", b"a4"]
    out = m.prepare_store(first, CTX)
    m.complete_store(list(out.keys_to_store), CTX)
    assert [k for _, k, _ in disk.log] == [b"a1", b"a2"]
    second = [b"b1", b"b2"]
    m.complete_store(list(m.prepare_store(second, CTX).keys_to_store), CTX)
    assert len(disk.log) == 2  # no room: waiting, not skipped
    disk.finish()
    m.settle()
    assert [k for _, k, _ in disk.log] == [b"a1", b"a2", b"a3", b"a4"]  # oldest first
    disk.finish()
    m.settle()
    assert [k for _, k, _ in disk.log][4:] == [b"b1", b"b2"]
    disk.finish()
    m.settle()
    assert disk.keys == set(first + second) and disk.stats.dropped_stores == 0
    # a batch whose first waiting key leaves host: it and the keys after it are dropped, counted
    m.complete_store(list(m.prepare_store([b"c0"], CTX).keys_to_store), CTX)
    m.complete_store(list(m.prepare_store([b"c1", b"c2"], CTX).keys_to_store), CTX)
    m.complete_store(list(m.prepare_store([b"d1", b"d2", b"d3"], CTX).keys_to_store), CTX)
    assert [k for _, k, _ in disk.log][6:] == [b"c0", b"c1"]
    waiting = len(m._waiting["disk"])
    assert waiting == 4  # c2, d1, d2, d3
    # evict d1 from host: fill it with new keys (c0 and c1 are pinned by their writes)
    host.touch([b"a1", b"a2", b"a3", b"a4", b"b1", b"b2", b"c2", b"d2", b"d3"], CTX)
    host.complete_store(list(host.prepare_store([b"e1"], CTX).keys_to_store), CTX)
    assert not hit(host.lookup(b"d1", CTX))
    assert all(hit(host.lookup(k, CTX)) for k in (b"c2", b"d2", b"d3"))  # only d1 left host
    disk.finish()
    m.settle()
    disk.finish()
    m.settle()
    written = [k for _, k, _ in disk.log][8:]
    assert written == [b"c2"], written  # d1 left host: d2 and d3 (after it) are never written
    assert disk.stats.dropped_stores == 3 and disk.stats.by_failure == {"left_host": 3}
    assert "dropped 3 (3 left host first)" in disk.stats.line()
    assert len(m._waiting["disk"]) == 0


def test_each_tier_has_its_own_metric_names():
    counters, gauges = tier_metrics("mooncake")
    names = [n for n, _, _ in counters + gauges]
    assert "vllm:kv_offload_mooncake_hits" in names and "vllm:kv_offload_mooncake_usage_bytes" in names
    assert all("mooncake" in doc for _, _, doc in counters)
    assert [n for n, _, _ in tier_metrics("disk")[0]][0] == "vllm:kv_offload_disk_hits"


def test_tier_keys_and_order_errors_name_the_key():
    from vllm_npu_offload.errors import OffloadConfigError
    from vllm_npu_offload.integration.tier_options import mooncake_options, tier_order

    assert mooncake_options({}) is None
    assert mooncake_options({"mooncake_master": "10.0.0.1:50051"}).master == "10.0.0.1:50051"
    for bad, match in (({"mooncake_tenant": "t"}, "without mooncake_master"),
                       ({"mooncake_master": "10.0.0.1:50051", "mooncake_protocl": "tcp"}, "mooncake_protocl"),
                       ({"mooncake_master": "nohost"}, "mooncake_master")):
        with pytest.raises(OffloadConfigError, match=match):
            mooncake_options(bad)
    assert tier_order({}, ["mooncake", "disk"]) == ["disk", "mooncake"]
    assert tier_order({"tier_order": ["mooncake", "disk"]}, ["disk", "mooncake"]) == ["mooncake", "disk"]
    for bad in (["disk", "disk"], ["tape"], "disk"):
        with pytest.raises(OffloadConfigError, match="tier_order"):
            tier_order({"tier_order": bad}, ["disk"])
    with pytest.raises(OffloadConfigError, match="leaves out"):
        tier_order({"tier_order": ["disk"]}, ["disk", "mooncake"])


def test_each_miss_is_counted_once_by_what_became_of_its_key():
    """A lookup that finds a key in no tier ends the prompt's prefix there; the manager says why the
    key was not there: never stored (new text), left host while its write waited, dropped before its
    write, or gone from the tier after it was written. A deferred request looks its keys up again
    every step: each miss counts once."""
    host = CPUOffloadingManager(num_chunks=2)
    disk = MemTier("disk", room=1)
    m = TieredManager(host, [disk])

    def store(keys):
        m.complete_store(list(m.prepare_store(keys, CTX).keys_to_store), CTX)

    store([b"w"])
    disk.finish()
    m.settle()
    disk.keys.discard(b"w")  # evicted from the tier by its budget
    store([b"x1"])  # written now: its chunk is pinned
    store([b"x2"])  # evicts w from host; waits for the tier's room
    store([b"x3"])  # evicts x2 from host while it waits
    assert not hit(m.lookup(b"w", CTX)) and not hit(m.lookup(b"x2", CTX))
    assert not hit(m.lookup(b"new", CTX)) and not hit(m.lookup(b"new", CTX))
    assert m.misses.counts == {"new": 1, "queued": 1, "dropped": 0, "gone": 1, "not_admitted": 0,
                               "write_failed": 0, "cost": 0}
    disk.finish()
    m.settle()  # x2's turn: it left host, so it is dropped; x3 is written
    assert disk.stats.dropped_stores == 1 and [k for _, k, _ in disk.log][-1] == b"x3"
    assert not hit(m.lookup(b"x2", CTX))  # another request's miss of it, now dropped
    assert m.misses.counts["dropped"] == 1 and m.misses.counts["queued"] == 1
    disk.finish()
    m.settle()
    disk.full = True  # x3 is on the tier and left host (x4, x5 took both chunks) but the disk is busy
    store([b"x4"])
    store([b"x5"])
    assert not hit(m.lookup(b"x3", CTX)) and not hit(m.lookup(b"x3", CTX))
    assert m.misses.counts["cost"] == 1
    assert m.misses.line() == ("first missing keys: 1 new, 1 queued for a write, 1 dropped before their write, "
                               "1 gone from the tier, 0 not admitted, 0 write failed, 1 refused by the cost rule")


def _ctx(rid):
    return compat.make_req_context(rid)


def test_a_new_requests_keys_found_on_a_tier_are_read_into_host_before_the_scheduler_looks():
    """vLLM looks a waiting request up only at the front of its queue; prefetch reads its keys when it
    arrives: those in host are skipped, the tier's are read in prompt order, and the first key found
    nowhere ends it. Once the reads end, the scheduler's lookups are host hits and no read is left."""
    host = CPUOffloadingManager(num_chunks=8)
    disk = MemTier("disk", keys={b"b", b"c", b"e"})
    m = TieredManager(host, [disk], prefetch_chunks=4)
    m.complete_store(list(m.prepare_store([b"a"], CTX).keys_to_store), CTX)
    disk.finish()  # a's write
    m.settle()
    disk.log.clear()
    m.prefetch([b"a", b"b", b"c", b"d", b"e"], _ctx("r1"))
    assert [(op, k) for op, k, _ in disk.log] == [(Op.READ, b"b"), (Op.READ, b"c")]  # d is nowhere: e unreachable
    assert disk.stats.prefetches == 0 and disk.stats.misses_cost == 0  # counted once read
    assert not hit(m.lookup(b"b", _ctx("r1")))  # still reading: the request waits (not a miss either)
    assert m.lookup(b"b", _ctx("r1")) != compat.LOOKUP_MISS
    disk.finish()
    assert all(hit(m.lookup(k, _ctx("r1"))) for k in (b"a", b"b", b"c"))
    assert disk.stats.prefetches == 2 and disk.stats.hits == 2
    assert [(op, k) for op, k, _ in disk.log] == [(Op.READ, b"b"), (Op.READ, b"c")]  # no second read


def test_prefetch_waits_for_room_in_the_tier_and_under_its_cap_and_resumes_in_arrival_order():
    host = CPUOffloadingManager(num_chunks=16)
    disk = MemTier("disk", keys={b"a1", b"a2", b"a3", b"b1", b"b2", b"c1"})
    m = TieredManager(host, [disk], prefetch_chunks=2)
    m.prefetch([b"a1", b"a2", b"a3"], _ctx("a"))
    m.prefetch([b"b1", b"b2"], _ctx("b"))
    assert [k for _, k, _ in disk.log] == [b"a1", b"a2"]  # the cap: 2 chunks not yet loaded
    disk.finish()
    m.settle()
    assert [k for _, k, _ in disk.log] == [b"a1", b"a2"]  # landed, still not loaded: the cap holds
    m.prepare_load([b"a1", b"a2"], _ctx("a"))  # a is scheduled: its chunks no longer count, its rest
    assert [k for _, k, _ in disk.log] == [b"a1", b"a2", b"b1", b"b2"]  # is the scheduler's; b goes next
    m.on_request_finished(_ctx("b"))
    disk.full = True  # the tier's read queue is full: the prefetch waits and counts no recomputed key
    m.prefetch([b"c1"], _ctx("c"))
    assert [k for _, k, _ in disk.log][-1] == b"b2" and disk.stats.misses_cost == 0
    disk.full = False  # (a tier's queue drains with reads ending; here nothing ended: the retry)
    m.settle()
    assert [k for _, k, _ in disk.log][-1] == b"b2"  # vLLM calls in for every key: not every call moves it
    time.sleep(PREFETCH_RETRY_S + 0.01)
    m.settle()
    assert [k for _, k, _ in disk.log][-1] == b"c1"
    disk.finish()
    m.settle()
    assert disk.stats.prefetches == 5


def test_no_prefetch_without_a_cap_and_a_bad_cap_is_refused():
    host = CPUOffloadingManager(num_chunks=4)
    disk = MemTier("disk", keys={b"x"})
    m = TieredManager(host, [disk])
    m.prefetch([b"x"], _ctx("r"))
    assert disk.log == [] and disk.stats.prefetches == 0
    with pytest.raises(ValueError, match="prefetch_chunks=-1"):
        TieredManager(host, [disk], prefetch_chunks=-1)


def test_the_window_keeps_a_waiting_requests_history_in_host_and_reads_what_left_before_its_turn():
    """A later turn arrives with its history still in host, and the stores of the requests running
    while it waits would evict it (LRU). The window over the waiting requests, in arrival order, makes
    their keys in host recent; a request whose turn in the window comes after its keys left host has
    them read from the tier instead."""
    host = CPUOffloadingManager(num_chunks=4)
    disk = MemTier("disk")
    m = TieredManager(host, [disk], prefetch_chunks=1)

    def store(keys):
        m.complete_store(list(m.prepare_store(keys, CTX).keys_to_store), CTX)
        disk.finish()
        m.settle()

    store([b"k1", b"k2", b"k3", b"k4"])  # k1 least recently used; all four written to the tier too
    m.prefetch([b"k1"], _ctx("r1"))  # kept: now the most recent
    m.prefetch([b"k2"], _ctx("r2"))  # the window is full (1 chunk): r2 waits its turn
    assert m.kept == 1 and disk.stats.prefetches == 0
    store([b"x1"])  # a running request's store evicts the oldest: k2, not the kept k1
    assert hit(host.lookup(b"k1", CTX)) and not hit(host.lookup(b"k2", CTX))
    m.prepare_load([b"k1"], _ctx("r1"))  # r1 is scheduled: r2's turn; k2 left host, the tier has it
    m.complete_load([b"k1"], _ctx("r1"))
    assert [(op, k) for op, k, _ in disk.orders] == [(Op.READ, b"k2")] and disk.stats.prefetches == 0
    disk.finish()
    assert hit(m.lookup(b"k2", _ctx("r2"))) and disk.stats.prefetches == 1


def test_a_prefix_many_waiting_requests_share_takes_one_place_in_the_window():
    host = CPUOffloadingManager(num_chunks=8)
    disk = MemTier("disk", keys={b"a", b"b"})
    m = TieredManager(host, [disk], prefetch_chunks=2)
    m.complete_store(list(m.prepare_store([b"sys"], CTX).keys_to_store), CTX)
    disk.finish()
    m.settle()
    disk.log.clear()
    m.prefetch([b"sys", b"a"], _ctx("r1"))  # sys kept, a read: the window is full
    m.prefetch([b"sys", b"b"], _ctx("r2"))  # sys is held already; b waits for a place
    assert [k for _, k, _ in disk.log] == [b"a"] and m.kept == 2
    m.on_request_finished(_ctx("r1"))  # a's place frees; sys stays held for r2
    assert [k for _, k, _ in disk.log] == [b"a", b"b"]
    assert m._held == {b"sys": 1, b"b": 1}
    m.on_request_finished(_ctx("r2"))
    assert m._held == {}


def test_the_window_never_evicts_a_hit_between_its_lookup_and_its_load():
    """vLLM looks a request up key by key and pins the hits in ``prepare_load`` within the same step.
    A prefetch read takes a host chunk and may evict one, so the window must not move inside the
    lookups (a CPU soak once failed vLLM's ``Chunk ... not found in cache`` assertion there)."""
    host = CPUOffloadingManager(num_chunks=3)
    disk = MemTier("disk", keys={b"w"})
    m = TieredManager(host, [disk], prefetch_chunks=3)
    for k in (b"r1", b"r2", b"x"):  # r1 is the least recently used
        m.complete_store(list(m.prepare_store([k], CTX).keys_to_store), CTX)
    disk.finish()
    m.settle()
    disk.log.clear()
    disk.full = True
    m.prefetch([b"w"], _ctx("W"))  # W waits: the tier's read queue is full
    disk.full = False
    assert hit(m.lookup(b"r1", _ctx("R")))
    time.sleep(PREFETCH_RETRY_S + 0.01)  # the window is due again
    assert hit(m.lookup(b"r2", _ctx("R")))
    assert disk.log == []  # not inside the lookups
    m.prepare_load([b"r1", b"r2"], _ctx("R"))  # the hits are still there to pin
    assert [(op, k) for op, k, _ in disk.log] == [(Op.READ, b"w")]  # then the window moved: x made room
    assert not hit(host.lookup(b"x", CTX)) and hit(host.lookup(b"r1", CTX))


def _schedule_end(m):
    """vLLM's last manager call of a step (0.23: no argument; >= 0.25: the step's context)."""
    from vllm.v1.kv_offload import base

    ctx = getattr(base, "ScheduleEndContext", None)
    m.on_schedule_end(*([ctx((), ())] if ctx is not None else []))


def test_the_window_waits_for_a_tier_still_looking_keys_up_and_reads_at_the_end_of_a_step():
    """A store answers whether it holds a key asynchronously: the window waits for the answer (the
    step does not) and starts the read at a later safe point, at the latest vLLM's end of step."""
    host = CPUOffloadingManager(num_chunks=8)
    pool = MemTier("mooncake", keys={b"p1", b"p2"})
    pool.unknown = {b"p1", b"p2"}
    m = TieredManager(host, [pool], prefetch_chunks=4)
    m.prefetch([b"p1", b"p2"], _ctx("r"))
    _schedule_end(m)
    assert pool.log == []
    pool.unknown.clear()  # the existence checks answered
    time.sleep(PREFETCH_RETRY_S + 0.01)
    _schedule_end(m)
    assert [(op, k) for op, k, _ in pool.log] == [(Op.READ, b"p1"), (Op.READ, b"p2")]
    pool.finish()
    m.settle()
    assert pool.stats.prefetches == 2


class IoTier(MemTier):
    """Orders end on the tier's own threads, as the real tiers' do: a poll finds them done."""

    def poll(self):
        self.finish()
        return super().poll()


def _wait(cond, timeout_s: float = 5.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


@pytest.mark.idle_drain
def test_a_quiet_scheduler_still_gets_its_queued_writes_to_the_tier():
    """vLLM calls the manager only while its engine steps: the writes queued when the server goes
    quiet (room for one at a time here) reach the tier with no further call, on the drain thread."""
    host = CPUOffloadingManager(num_chunks=8)
    disk = IoTier("disk", room=1)
    m = TieredManager(host, [disk])
    try:
        keys = [bytes([i]) * 4 for i in range(6)]
        out = m.prepare_store(keys, CTX)
        m.complete_store(list(out.keys_to_store), CTX)  # the scheduler's last call
        assert len(disk.log) == 1  # one write had room; five wait in the queue
        assert _wait(lambda: disk.keys == set(keys)), f"{len(disk.keys)} of 6 written while the scheduler was quiet"
        assert m.idle_drains >= 5 and not len(m._waiting["disk"])
        # every chunk unpinned: the host can store over all of them again
        out = m.prepare_store([bytes([9 + i]) * 4 for i in range(8)], CTX)
        assert len(out.keys_to_store) == 8
    finally:
        m.shutdown()
    assert _wait(lambda: not m._drain.is_alive(), 1.0)  # the thread ends with the manager


@pytest.mark.idle_drain
def test_the_drain_thread_stays_out_while_the_scheduler_calls():
    host = CPUOffloadingManager(num_chunks=8)
    disk = IoTier("disk", room=1)
    m = TieredManager(host, [disk])
    try:
        out = m.prepare_store([b"a", b"b", b"c"], CTX)
        m.complete_store(list(out.keys_to_store), CTX)
        end = time.monotonic() + 0.4
        while time.monotonic() < end:  # a busy scheduler: calls far more often than IDLE_DRAIN_S
            m.lookup(b"zz", CTX)
            time.sleep(0.005)
        assert m.idle_drains == 0  # its own calls moved the writes along
        assert disk.keys == {b"a", b"b", b"c"}
    finally:
        m.shutdown()


def test_a_prefetch_counts_once_its_read_has_succeeded():
    """A read the window started that fails (a checksum, a timeout) is no prefetch: prefetched <= hits."""
    host = CPUOffloadingManager(num_chunks=8)
    disk = MemTier("disk", keys={b"a", b"b"})
    m = TieredManager(host, [disk], prefetch_chunks=4)
    m.prefetch([b"a", b"b"], _ctx("r"))
    assert [k for _, k, _ in disk.log] == [b"a", b"b"]
    disk.orders = []
    disk.ended = [Completion(b"a", Op.READ, True, 0), Completion(b"b", Op.READ, False, 1)]
    disk.stats.hits += 1
    m.settle()
    assert disk.stats.prefetches == 1 <= disk.stats.hits
    assert hit(m.lookup(b"a", _ctx("r"))) and not hit(m.lookup(b"b", _ctx("r")))
