"""Transfer engine: order, exactly-once completion, failures, wait and shutdown."""

import threading
import time

import numpy as np
import pytest
import torch

from vllm_npu_offload.copy import BackendChoice, CopyPath, Direction, NPUDmaCopyBackend, register_path
from vllm_npu_offload.copy.host import HostCopyPath
from vllm_npu_offload.engine import TransferEngine
from vllm_npu_offload.plan import BlockLayout, CopyPlanner, DescriptorPool, TensorPair
from vllm_npu_offload.platform import CpuPlatform
from vllm_npu_offload.transfer import DirectTransfer


class Engine(TransferEngine):
    """The engine over one backend, taking descriptors as the tests plan them (direct transfers)."""

    def __init__(self, platform, backend, pool=None, streams=None):
        super().__init__(platform, pool) if streams is None else super().__init__(platform, pool, streams)
        self.backend = backend

    def submit(self, job_id, direction, descriptors):
        super().submit(job_id, DirectTransfer(Direction(direction), descriptors, self.backend))


@pytest.fixture(params=[False, True], ids=["inline", "threaded"])
def platform(request):
    return CpuPlatform(threaded_streams=request.param)


def planner(src, dst, page):
    return CopyPlanner([TensorPair(BlockLayout(src.data_ptr(), page, src.shape[0]),
                                   BlockLayout(dst.data_ptr(), page, dst.shape[0]), page)])


def test_streams_are_made_when_the_engine_starts(platform):
    """Submit makes no stream: making one is a driver call that may wait for the device, and vLLM
    submits while the model's step runs."""
    made = []
    new_stream = platform.new_stream
    platform.new_stream = lambda: made.append(1) or new_stream()
    dev = torch.arange(32 * 16, dtype=torch.uint8).reshape(32, 16)
    host = torch.zeros((32, 16), dtype=torch.uint8)
    eng = Engine(platform, NPUDmaCopyBackend(platform))
    n = len(made)
    assert n == 2 * len(eng.streams(Direction.H2D)) > 0
    for job, (d, a, b) in enumerate(((Direction.D2H, dev, host), (Direction.H2D, host, dev)), 1):
        eng.submit(job, d, planner(a, b, 16).plan(np.arange(8), np.arange(8)))
        eng.wait([job])
    assert len(made) == n and [r.success for r in eng.poll()] == [True, True]


def test_in_order_exactly_once_and_bytes(platform):
    rng = np.random.default_rng(0)
    dev = torch.from_numpy(rng.integers(0, 256, (64, 96), dtype=np.uint8))
    host = torch.zeros((64, 96), dtype=torch.uint8)
    pool = DescriptorPool(platform)
    eng = Engine(platform, NPUDmaCopyBackend(platform), pool)
    store, load = planner(dev, host, 96), planner(host, dev, 96)
    # store blocks to host, wipe the device, load them back: the load must see the store
    eng.submit(1, Direction.D2H, store.plan(np.arange(32), np.arange(32) + 32, pool))
    expected = dev.clone()
    eng.wait([1])
    dev.zero_()
    eng.submit(2, Direction.H2D, load.plan(np.arange(32) + 32, np.arange(32), pool))
    eng.wait([2])
    seen = []
    for _ in range(3):
        seen += eng.poll()
    assert sorted(r.job_id for r in seen) == [1, 2]
    assert all(r.success and r.num_bytes == 32 * 96 and r.seconds >= 0 for r in seen)
    assert torch.equal(dev[:32], expected[:32])
    assert pool.num_free >= 1, "descriptor buffers come back after completion"


def test_a_jobs_seconds_are_its_events_span():
    """A job's seconds are the span between its start and end events (the copies' own time), not
    the host's time from its submit to the poll that reports it."""
    platform = CpuPlatform(threaded_streams=False)
    src = torch.ones((8, 16), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    eng = Engine(platform, NPUDmaCopyBackend(platform))
    t0 = time.perf_counter()
    eng.submit(1, Direction.D2H, planner(src, dst, 16).plan([0, 1], [0, 1]))
    eng.wait([1])
    time.sleep(0.02)  # the copy is done; the poll that reports it comes 20 ms later
    (res,) = eng.poll()
    wall = time.perf_counter() - t0
    assert res.success and torch.equal(dst[:2], src[:2])
    assert 0 <= res.seconds < 0.02 <= wall, res.seconds


def test_cuda_completion_query_asks_the_events():
    """CudaPlatform's poll query: None while the end event is pending, else the events' elapsed
    time in seconds (no GPU: stub events)."""
    from vllm_npu_offload.platform import CudaPlatform

    class Ev:
        def __init__(self, done=True):
            self.done = done

        def query(self):
            return self.done

        def elapsed_time(self, end):
            return 3.0

    query = CudaPlatform().completion_query()
    assert query(Ev(), Ev()) == 3e-3
    assert query(Ev(), Ev(done=False)) is None


def test_a_failing_completion_query_fails_its_job_not_the_poll(platform):
    """The device reports an error at a job's end event (torch's query raises, or the library's):
    that job is reported failed, with the error, and the poll goes on; the next job is unaffected."""
    src = torch.arange(64, dtype=torch.uint8).repeat(4, 1)
    dst = torch.zeros_like(src)
    eng = Engine(platform, NPUDmaCopyBackend(platform))
    pl = planner(src, dst, 64)
    eng.submit(1, Direction.D2H, pl.plan([0], [0]))
    eng.wait([1])
    real = eng._query

    def failing(start, end):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    eng._query = failing
    (res,) = eng.poll()
    eng._query = real
    assert res.job_id == 1 and not res.success and res.num_bytes == 0 and "illegal memory access" in res.error
    eng.submit(2, Direction.D2H, pl.plan([1], [1]))
    eng.wait([2])
    (res,) = eng.poll()
    assert res.success and torch.equal(dst[1], src[1])


def test_many_jobs_from_threads_complete_once(platform):
    src = torch.arange(256, dtype=torch.uint8).repeat(128, 1)
    dst = torch.zeros_like(src)
    eng = Engine(platform, NPUDmaCopyBackend(platform))
    pl = planner(src, dst, 256)
    ids = iter(range(10_000))
    lock = threading.Lock()
    results = []

    def producer():
        for _ in range(200):
            with lock:
                j = next(ids)
            eng.submit(j, Direction.D2H, pl.plan([j % 128], [j % 128]))
            results.extend(eng.poll())

    threads = [threading.Thread(target=producer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    eng.shutdown()
    results += eng.poll()
    jobs = [r.job_id for r in results]
    assert len(jobs) == 800 and len(set(jobs)) == 800
    assert torch.equal(dst, src)
    assert eng.poll() == []


class _FailOnThird(CopyPath):
    name = "fail_third"

    def __init__(self):
        self.calls = 0

    def copy(self, src, dst, sizes, direction, stream, buffers=None):
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError("injected copy failure")
        from vllm_npu_offload.copy.host import HostCopyPath

        HostCopyPath().copy(src, dst, sizes, direction, stream, buffers)


def test_failed_copy_is_reported_not_raised(platform):
    register_path("fail_third", lambda p, pages: _FailOnThird())
    src = torch.ones((8, 16), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    eng = Engine(platform, NPUDmaCopyBackend(platform, choice=BackendChoice("fail_third", "fail_third")))
    pl = planner(src, dst, 16)
    for j in range(5):
        eng.submit(j, Direction.D2H, pl.plan([j], [j]))
    eng.wait(range(5))
    res = {r.job_id: r for r in eng.poll()}
    assert sorted(res) == [0, 1, 2, 3, 4]
    assert not res[2].success and "injected copy failure" in res[2].error and res[2].num_bytes == 0
    assert all(res[j].success for j in (0, 1, 3, 4))
    assert (dst[2] == 0).all() and (dst[[0, 1, 3, 4]] == 1).all()


def test_async_stream_error_reaches_the_right_job():
    platform = CpuPlatform(threaded_streams=True)
    src = torch.ones((4, 16), dtype=torch.uint8)
    eng = Engine(platform, NPUDmaCopyBackend(platform))
    bad = CopyPlanner([TensorPair(BlockLayout(0, 16, 4), BlockLayout(src.data_ptr(), 16, 4), 16)])  # null source
    dst = torch.zeros_like(src)  # keep a reference: the engine copies into raw addresses
    good = planner(src, dst, 16)
    eng.submit(1, Direction.H2D, good.plan([0], [0]))
    eng.submit(2, Direction.H2D, bad.plan([0], [1]))
    eng.submit(3, Direction.H2D, good.plan([2], [2]))
    eng.shutdown()
    res = {r.job_id: r for r in eng.poll()}
    assert res[1].success and res[3].success
    assert not res[2].success and "null address" in res[2].error


def test_bad_submissions(platform):
    src = torch.ones((4, 16), dtype=torch.uint8)
    eng = Engine(platform, NPUDmaCopyBackend(platform))
    dst = torch.zeros_like(src)
    pl = planner(src, dst, 16)
    eng.submit(7, Direction.D2H, pl.plan([0], [0]))
    if platform.threaded_streams:
        eng.wait([7])
    eng.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        eng.submit(8, Direction.D2H, pl.plan([0], [0]))
    with pytest.raises(ValueError, match="NPU_OFFLOAD_COPY_PATH"):
        import os

        os.environ["NPU_OFFLOAD_COPY_PATH"] = "warp"
        try:
            NPUDmaCopyBackend(platform)
        finally:
            del os.environ["NPU_OFFLOAD_COPY_PATH"]


def test_duplicate_job_id_rejected():
    platform = CpuPlatform(threaded_streams=True)
    src = torch.ones((4, 16), dtype=torch.uint8)
    eng = Engine(platform, NPUDmaCopyBackend(platform))
    dst = torch.zeros_like(src)
    pl = planner(src, dst, 16)
    gate = threading.Event()
    stream_block = platform.new_event()
    # hold the stream so job 1 stays in flight
    eng.stream(Direction.D2H).submit(gate.wait)  # the stream job 1 takes
    eng.submit(1, Direction.D2H, pl.plan([0], [0]))
    with pytest.raises(ValueError, match="job id 1 is already in flight"):
        eng.submit(1, Direction.D2H, pl.plan([1], [1]))
    assert stream_block.query()
    gate.set()
    eng.shutdown()


@pytest.mark.parametrize("ring", [1, 4])
def test_jobs_take_a_fixed_ring_of_streams_in_turn_and_stay_in_order(ring):
    """Jobs of one direction take that direction's streams in turn (made once, however many jobs:
    ``streams`` per direction), each after the previous job: a job held on its stream holds every
    later one of its direction, on whichever stream, and not the other's."""
    platform = CpuPlatform(threaded_streams=True)
    made = []
    new_stream = platform.new_stream
    platform.new_stream = lambda: made.append(new_stream()) or made[-1]
    src = torch.arange(64, dtype=torch.uint8).view(4, 16)
    dst = torch.zeros_like(src)
    eng = Engine(platform, NPUDmaCopyBackend(platform), streams=ring)
    pl = planner(src, dst, 16)
    gate = threading.Event()
    eng.stream(Direction.D2H).submit(gate.wait)  # the stream the first store takes
    taken = []
    for job in range(12):
        d = Direction.D2H if job % 3 else Direction.H2D
        taken.append(eng.stream(d))
        eng.submit(job, d, pl.plan([job % 4], [job % 4]))
    eng.wait([0, 3, 6, 9])  # the loads: not held by the stores
    time.sleep(0.05)
    assert sorted(r.job_id for r in eng.poll()) == [0, 3, 6, 9]  # every store waits for the first
    assert not any(it.end.query() for it in eng._queues[Direction.D2H])  # none ran, on any stream
    gate.set()
    eng.drain()
    res = eng.poll()
    assert [r.job_id for r in res] == [j for j in range(12) if j % 3] and all(r.success for r in res)
    assert len(made) == 2 * ring and len({id(s) for s in taken}) == min(2 * ring, 12)
    assert torch.equal(dst, src)
    eng.shutdown()


def test_poll_of_one_direction_keeps_the_others_results(platform):
    dev = torch.arange(8 * 16, dtype=torch.uint8).view(8, 16)
    host = torch.zeros(8, 16, dtype=torch.uint8)
    eng = Engine(platform, NPUDmaCopyBackend(platform))
    eng.submit(1, Direction.D2H, planner(dev, host, 16).plan([0], [0]))
    eng.submit(2, Direction.H2D, planner(host, dev, 16).plan([1], [1]))
    eng.drain()
    assert [r.job_id for r in eng.poll(Direction.H2D)] == [2]
    assert eng.poll(Direction.H2D) == []
    assert [r.job_id for r in eng.poll()] == [1]  # kept for its own direction's poll
    eng.shutdown()


def test_end_event_orders_a_consumer_stream_after_the_copy():
    """A consumer stream that waits on a job's end event runs after the copy: the compute stream
    of a layer-wise load reads only bytes that landed. None once the job has been reported."""
    platform = CpuPlatform(threaded_streams=True)
    dev = torch.zeros(4, 16, dtype=torch.uint8)
    host = torch.arange(4 * 16, dtype=torch.uint8).view(4, 16)
    gate = threading.Event()

    class GatedPath(CopyPath):  # the copy starts only when the test opens the gate
        name = "gated"

        def copy(self, src, dst, sizes, direction, stream, buffers=None):
            stream.submit(lambda: gate.wait(5))
            HostCopyPath().copy(src, dst, sizes, direction, stream)

    register_path("gated", lambda p, pages: GatedPath())
    eng = Engine(platform, NPUDmaCopyBackend(platform, choice=BackendChoice("gated", "gated")))
    eng.submit(7, Direction.H2D, planner(host, dev, 16).plan([2], [1]))
    ev = eng.end_event(7)
    assert ev is not None and eng.end_event(8) is None
    consumer, seen = platform.new_stream(), []
    consumer.wait_event(ev)
    consumer.submit(lambda: seen.append(dev[1].clone()))
    threading.Event().wait(0.2)
    assert seen == []  # held behind the copy, which waits for the gate
    gate.set()
    consumer.synchronize()
    assert torch.equal(seen[0], host[2])  # the consumer saw the copied bytes, not zeros
    eng.drain()
    assert eng.end_event(7) is None and [r.job_id for r in eng.poll()] == [7]
    eng.shutdown()


def test_totals_count_every_reported_job_when_read(monkeypatch):
    """The poll leaves a finished job's numbers in TOTALS.pending (no lock on the poll that makes a
    completion visible); reading the totals counts them first, reset drops them, and the engine
    folds them itself once stats.FOLD_EVERY wait (a server nobody reads keeps no growing list)."""
    from vllm_npu_offload import engine as engine_mod
    from vllm_npu_offload import stats

    platform = CpuPlatform(threaded_streams=False)
    totals = stats.TransferTotals()
    monkeypatch.setattr(engine_mod, "TOTALS", totals)
    monkeypatch.setattr(stats, "FOLD_EVERY", 3)
    dev = torch.zeros((8, 64), dtype=torch.uint8)
    host = torch.zeros((8, 64), dtype=torch.uint8)
    pool = DescriptorPool(platform)
    eng = Engine(platform, NPUDmaCopyBackend(platform), pool)
    store, load = planner(dev, host, 64), planner(host, dev, 64)
    eng.submit(1, Direction.D2H, store.plan(np.arange(2), np.arange(2), pool))
    eng.submit(2, Direction.H2D, load.plan(np.arange(3), np.arange(3), pool))
    eng.wait([1, 2])
    assert len(eng.poll()) == 2 and len(totals.pending) == 2 and totals.load.jobs == totals.store.jobs == 0
    load_t, store_t = totals.snapshot()
    assert (load_t.jobs, load_t.bytes, store_t.jobs, store_t.bytes) == (1, 3 * 64, 1, 2 * 64) and not totals.pending
    totals.pending.append((True, False, 10, 1.0, 0.0))
    totals.reset()
    assert totals.snapshot()[0].jobs == 0 and not totals.pending  # reset drops what was pending too
    for job in range(3, 8):
        eng.submit(job, Direction.D2H, store.plan(np.arange(1), np.arange(1), pool))
        eng.wait([job])
        eng.poll()
    assert len(totals.pending) <= 3 and totals.store.jobs >= 2  # folded by the engine past FOLD_EVERY
    assert totals.snapshot()[1].jobs == 5
