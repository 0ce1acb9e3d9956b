"""Simple-offload worker core without vLLM: exactly-once launch and reporting."""

from __future__ import annotations

import random
import threading
from collections import Counter

import numpy as np
import pytest
import torch

from simple_fakes import ManualTransport, NaiveWorker, ThreadedTransport, _NaiveEvent
from vllm_npu_offload.copy import register_path
from vllm_npu_offload.copy.backend import BackendChoice, NPUDmaCopyBackend
from vllm_npu_offload.copy.base import CopyPath, Direction
from vllm_npu_offload.copy.host import HostCopyPath
from vllm_npu_offload.errors import CopyError, OffloadConfigError
from vllm_npu_offload.device_kv import DeviceKVTensor, dedupe_segments, placement_segments, tensor_segments
from vllm_npu_offload.platform import get_platform
from vllm_npu_offload.simple_core import (
    Completion,
    CoreTransport,
    SimpleOffloadCore,
    StepPlan,
)

H2D, D2H = Direction.H2D, Direction.D2H


def load_plan(ev, reqs, n=1, mapping=None):
    return StepPlan(load_event=ev, load_host_blocks=list(range(n)), load_device_blocks=list(range(n)),
                    load_event_to_reqs={ev: list(reqs)} if mapping is None else mapping)


# -- defects of the naive design -----------------------------------------------------------
def test_get_finished_twice_launches_once():
    """vLLM may call get_finished several times per step (no-forward steps, deferred
    finalize). Naive design: it launches the bound transfers inside get_finished, so the
    second call submits the same blocks again (launch count 2). Ours launches only from
    start_load_kv / wait_for_save and accepts each event index once."""
    plan = load_plan(0, ["r0"])
    naive = NaiveWorker()
    naive.bind(plan)
    naive.get_finished()
    naive.get_finished()
    assert naive.launches[(H2D, 0)] == 2  # the defect this test detects

    t = ManualTransport()
    core = SimpleOffloadCore(t)
    core.bind(plan)
    core.collect()
    core.launch(H2D)
    core.collect()
    core.launch(H2D)  # hook run twice
    core.bind(plan)  # same metadata bound again
    core.launch(H2D)
    core.collect()
    assert t.launches == Counter({(H2D, 0): 1})
    assert core.stats.ignored_binds == 1


def test_load_finishing_two_steps_later_is_reported():
    """Naive design maps finished load events to requests with the *current* step's
    metadata; vLLM-Ascend's scheduler sends only the new event's mapping, so a load that
    completes two steps after it was issued maps to nothing and its request hangs.
    Ours keeps its own event -> requests map until the event is reported."""
    steps = [load_plan(0, ["r0"]), StepPlan(), load_plan(1, ["r1"])]

    naive = NaiveWorker()
    ev0 = _NaiveEvent()
    for i, p in enumerate(steps):
        naive.bind(p)
        if i == 0:
            naive.copy_thread_append(0, ev0)
        naive.get_finished()
    ev0.done = True
    assert "r0" not in naive.get_finished()  # the defect: r0 is never reported

    t = ManualTransport()
    core = SimpleOffloadCore(t)
    reported = Counter()
    for p in steps:
        core.bind(p)
        core.launch(H2D)
        reported.update(core.collect()[0])
    t.finish(H2D, 0)
    reported.update(core.collect()[0])
    t.finish(H2D, 1)
    reported.update(core.collect()[0])
    assert reported == Counter({"r0": 1, "r1": 1})
    assert core.is_idle()


def test_concurrent_append_during_flush_is_not_lost():
    """Naive design: the copy thread appends (event_idx, event) to a list that the engine
    thread iterates and then clear()s in flush; an append landing during the iteration is
    wiped by clear() and that load is never reported (hang). Reproduced deterministically
    by letting the copy thread append between flush's loop and its clear().
    Ours: finished copies are taken from the transport's locked poll, never from a shared list."""
    naive = NaiveWorker()

    class RacyList(list):  # schedules the copy thread exactly in the race window
        def clear(self):
            th = threading.Thread(target=naive.copy_thread_append, args=(1, _NaiveEvent()))
            th.start()
            th.join()
            super().clear()

    naive.load_events = RacyList()
    naive.copy_thread_append(0, _NaiveEvent())
    flushed = naive.flush()
    assert flushed == {0} and naive.load_events == []  # the defect: event 1 is lost

    # ours: copy threads finish events while the engine thread flushes; every one is reported
    t = ThreadedTransport(producers=4, fail_rate=0.0, seed=3)
    core = SimpleOffloadCore(t)
    reported = Counter()
    try:
        for ev in range(5000):
            core.bind(load_plan(ev, [f"r{ev}"]))
            core.launch(H2D)
            if ev % 97 == 0:
                core.flush()
            reported.update(core.collect()[0])
        core.flush()
        reported.update(core.collect()[0])
    finally:
        t.shutdown()
    assert reported == Counter(f"r{ev}" for ev in range(5000))
    assert core.is_idle()


# -- stress ------------------------------------------------------------------------------
def test_stress_threads_random_order_exactly_once():
    """Several producer threads finish 10k+ load/store events in random order at random
    steps; get_finished is called 0-3 times per step; some steps flush (preemption) and
    some resend stale mappings. Every request and store is reported exactly once."""
    rng = random.Random(1234)
    t = ThreadedTransport(producers=4, fail_rate=0.05, seed=7)
    core = SimpleOffloadCore(t)
    reqs_of: dict[int, list[str]] = {}
    reported, failed_reqs = Counter(), Counter()
    stores_ok, stores_bad = Counter(), Counter()
    error_blocks: set[int] = set()

    def gather(collects: int) -> None:
        """``collects`` get_finished calls, then the step's load errors and store results."""
        nonlocal error_blocks
        for _ in range(collects):
            fin, failed = core.collect()
            reported.update(fin)
            failed_reqs.update(failed)
        error_blocks |= core.take_load_errors()
        ok, bad = core.take_store_results()
        stores_ok.update(ok)
        stores_bad.update(bad)

    load_ev = store_ev = 0
    steps = 6000
    try:
        for step in range(steps):
            if rng.random() < 0.02:
                core.flush()  # need_flush: handle_preemptions runs before bind
            plan_kw = {}
            if rng.random() < 0.9:
                reqs = [f"r{load_ev}.{j}" for j in range(rng.randint(1, 3))]
                reqs_of[load_ev] = reqs
                mapping = {load_ev: reqs}
                if rng.random() < 0.3 and load_ev > 0:  # stale resend of an older event
                    old = rng.randrange(load_ev)
                    mapping[old] = reqs_of[old]
                plan_kw.update(load_event=load_ev, load_host_blocks=[load_ev], load_device_blocks=[load_ev],
                               load_event_to_reqs=mapping)
                load_ev += 1
            if rng.random() < 0.9:
                plan_kw.update(store_event=store_ev, store_device_blocks=[1], store_host_blocks=[2])
                store_ev += 1
            core.bind(StepPlan(**plan_kw))
            for _ in range(rng.randint(0, 3)):
                fin, failed = core.collect()
                reported.update(fin)
                failed_reqs.update(failed)
            core.launch(H2D)
            core.launch(D2H)
            gather(rng.randint(0, 3))
        core.flush()
        gather(1)
    finally:
        t.shutdown()
    assert load_ev + store_ev >= 10_000
    all_reqs = [r for rs in reqs_of.values() for r in rs]
    assert reported == Counter(all_reqs)  # zero lost, zero duplicated
    assert set(t.launches.values()) == {1} and len(t.launches) == load_ev + store_ev
    failed_loads = {e for d, e in t.failed if d is H2D}
    assert set(failed_reqs) == {r for e in failed_loads for r in reqs_of[e]}
    assert error_blocks == failed_loads
    assert set(stores_bad) == {e for d, e in t.failed if d is D2H}
    assert stores_ok + stores_bad == Counter(range(store_ev))
    assert core.is_idle()


def test_duplicate_and_unknown_completions_are_ignored():
    t = ManualTransport()
    core = SimpleOffloadCore(t)
    core.bind(load_plan(0, ["a"]))
    core.launch(H2D)
    t.ready += [Completion(H2D, 0, True), Completion(H2D, 0, True), Completion(D2H, 9, True)]
    assert core.collect() == ({"a"}, set())
    assert core.stats.ignored_completions == 2


def test_flush_launches_bound_but_unsubmitted_work():
    t = ManualTransport()
    core = SimpleOffloadCore(t)
    core.bind(StepPlan(store_event=0, store_device_blocks=[3], store_host_blocks=[4]))
    core.flush()  # wait_for_save has not run yet
    assert t.launches[(D2H, 0)] == 1 and not t.outstanding
    core.launch(D2H)
    assert t.launches[(D2H, 0)] == 1
    core.collect()
    assert core.take_store_results() == ({0}, set())


def test_launch_error_becomes_failed_completion():
    class Broken(ManualTransport):
        def launch(self, *a):
            raise RuntimeError("boom")

    core = SimpleOffloadCore(Broken())
    core.bind(load_plan(0, ["a"], n=2))
    core.launch(H2D)
    assert core.collect() == ({"a"}, {"a"})
    assert core.take_load_errors() == {0, 1}
    assert core.is_idle()


def test_unlaunched_step_is_launched_at_next_bind():
    t = ManualTransport()
    core = SimpleOffloadCore(t)
    core.bind(StepPlan(store_event=0, store_device_blocks=[1], store_host_blocks=[1]))
    core.bind(StepPlan(store_event=1, store_device_blocks=[2], store_host_blocks=[2]))
    assert t.launches[(D2H, 0)] == 1


def test_mismatched_block_lists_rejected():
    core = SimpleOffloadCore(ManualTransport())
    with pytest.raises(ValueError, match="2 host blocks vs 1 device blocks"):
        core.bind(StepPlan(load_event=0, load_host_blocks=[1, 2], load_device_blocks=[1]))


# -- layouts -----------------------------------------------------------------------------
def test_tensor_segments_kv_stack_and_tuple_parts():
    kv = torch.zeros(2, 8, 4, 2, 3)  # (K/V, blocks, block_size, heads, dim)
    segs = tensor_segments(kv, 8)
    assert len(segs) == 2
    assert segs[1].base - segs[0].base == kv.stride(0) * 4
    assert segs[0].block_stride == segs[0].page_bytes == 4 * 2 * 3 * 4
    k, v = torch.zeros(8, 16), torch.zeros(8, 4, dtype=torch.float16)  # MLA-like unequal parts
    assert [s.page_bytes for s in tensor_segments(k, 8) + tensor_segments(v, 8)] == [64, 8]
    grouped = tensor_segments(torch.zeros(16, 5), 8)  # 2 kernel blocks per block
    assert grouped[0].block_stride == grouped[0].page_bytes == 40
    with pytest.raises(OffloadConfigError, match="num_blocks=7"):
        tensor_segments(torch.zeros(8, 5), 7)


def test_placement_and_dedupe():
    lo = placement_segments(1000, 10_000, 0, layer_stride=2 * 4 * 100, block_stride=100, num_layers=2, num_blocks=4)
    assert [s.base for s in lo] == [1000, 1400, 1800, 2200]
    bo = placement_segments(1000, 10_000, 0, layer_stride=50, block_stride=100, num_layers=2, num_blocks=4)
    assert len(bo) == 1 and bo[0].block_stride == 100
    with pytest.raises(OffloadConfigError, match="allocation has 100"):
        placement_segments(0, 100, 0, 400, 100, 1, 4)
    a = DeviceKVTensor(0, 100, 4, 100)
    assert dedupe_segments([a, a]) == [a]
    with pytest.raises(OffloadConfigError, match="different block strides"):
        dedupe_segments([a, DeviceKVTensor(50, 60, 4, 60)])


# -- real copies on the CPU platform -----------------------------------------------------
class _FailLoads(CopyPath):
    name = "test-fail-loads"

    def __init__(self):
        self.host = HostCopyPath()

    def copy(self, src, dst, sizes, direction, stream, buffers=None):
        if direction is Direction.H2D:
            raise CopyError("injected load failure", "test")
        self.host.copy(src, dst, sizes, direction, stream, buffers)


register_path("test-fail-loads", lambda platform, pages: _FailLoads())


def _cpu_core(kv, backend=None):
    plat = get_platform("cpu")
    tr = CoreTransport.from_segments(tensor_segments(kv, kv.shape[1]), 16, plat, backend)
    return SimpleOffloadCore(tr), tr


def test_core_transport_roundtrip_on_cpu():
    kv = torch.randn(2, 8, 4, 2, 8)
    core, tr = _cpu_core(kv)
    ref = kv.clone()
    core.bind(StepPlan(store_event=0, store_device_blocks=[1, 2, 5], store_host_blocks=[10, 11, 3]))
    core.launch(D2H)
    core.flush()
    core.collect()
    assert core.take_store_results() == ({0}, set())
    kv.zero_()
    core.bind(StepPlan(load_event=0, load_host_blocks=[10, 11, 3], load_device_blocks=[6, 7, 0],
                       load_event_to_reqs={0: ["a"]}))
    core.launch(H2D)
    core.flush()
    assert core.collect() == ({"a"}, set())
    for src, dst in ((1, 6), (2, 7), (5, 0)):
        assert torch.equal(kv[:, dst], ref[:, src])
    assert torch.count_nonzero(kv[:, 1]) == 0
    core.shutdown()
    assert core.is_idle()


def test_injected_copy_failure_reports_requests_and_blocks():
    kv = torch.randn(2, 8, 4, 2, 8)
    backend = NPUDmaCopyBackend(get_platform("cpu"), choice=BackendChoice("test-fail-loads", "host"))
    core, tr = _cpu_core(kv, backend)
    core.bind(StepPlan(load_event=0, load_host_blocks=[1, 2], load_device_blocks=[3, 4],
                       load_event_to_reqs={0: ["a", "b"]},
                       store_event=0, store_device_blocks=[0], store_host_blocks=[0]))
    core.launch(H2D)
    core.launch(D2H)
    core.flush()
    assert core.collect() == ({"a", "b"}, {"a", "b"})
    assert core.take_load_errors() == {3, 4}
    assert core.take_store_results() == ({0}, set())  # the other direction is unaffected
    core.shutdown()
    assert core.is_idle()


def test_out_of_range_block_fails_cleanly():
    kv = torch.randn(2, 8, 4, 2, 8)
    core, _ = _cpu_core(kv)
    core.bind(StepPlan(store_event=0, store_device_blocks=[1], store_host_blocks=[999]))
    core.launch(D2H)
    core.collect()
    assert core.take_store_results() == (set(), {0})
    core.shutdown()
    assert np.all(core.in_flight() == (0, 0))


def test_many_steps_on_cpu_engine_do_not_deadlock():
    """Regression: the engine recycles end events; a CPU stream that waited on a
    recycled event waited for its *next* record and deadlocked after ~100 steps."""
    kv = torch.randn(2, 16, 4, 2, 8)
    core, tr = _cpu_core(kv)

    def run():
        for i in range(300):
            ids = [i % 16, (i + 3) % 16]
            core.bind(StepPlan(load_event=i, load_host_blocks=ids, load_device_blocks=ids,
                               load_event_to_reqs={i: [f"r{i}"]},
                               store_event=i, store_device_blocks=ids, store_host_blocks=ids))
            core.launch(H2D)
            core.launch(D2H)
            core.collect()
        core.flush()
        core.collect()
        core.take_load_errors()
        core.take_store_results()

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(60)
    assert not th.is_alive(), "transfers deadlocked"
    assert core.is_idle()
    core.shutdown()


def test_simple_core_does_not_import_vllm():
    import subprocess
    import sys

    code = "import sys, vllm_npu_offload.simple_core; sys.exit('vllm' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
