"""Layer-wise loads, piece by piece (docs/layerwise.md): the layer-group mapping, which hits go
synchronous, the keys, the result router, the worker-side loader on a real worker core (CPU
streams, a copy stream held by a gate so that a missing wait would be seen), and the
scheduler-side bookkeeping against a stand-in for upstream's scheduler. The same pieces under a
release's real Scheduler: tests/vllm_api/test_api_layerwise.py; in a real engine:
tests/integration/test_layerwise_engine.py."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_npu_offload.copy.base import Direction
from vllm_npu_offload.device_kv import DeviceKVTensor, GroupRef
from vllm_npu_offload.engine import TransferResult
from vllm_npu_offload.errors import OffloadConfigError
from vllm_npu_offload.integration.job_router import ResultRouter
from vllm_npu_offload.integration.layer_groups import split_layer_groups
from vllm_npu_offload.integration.layerwise_policy import sync_hit
from vllm_npu_offload.integration.options import (
    AUTO_MIN_NEW_TOKENS,
    AUTO_MIN_TOKENS,
    LayerwiseOptions,
    check_layerwise_owner,
    layerwise_options,
    npu_connector_context,
)
from vllm_npu_offload.offload_worker import OffloadWorkerCore
from vllm_npu_offload.platform import CpuPlatform

pytest.importorskip("vllm")

from vllm_npu_offload.integration import compat  # noqa: E402
from vllm_npu_offload.integration.layerwise_worker import LayerwiseLoader, LoadJob  # noqa: E402


def names(indices) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in indices]


# -- layer groups ------------------------------------------------------------------------


def test_layers_split_in_execution_order_into_nearly_equal_groups():
    listed = names([10, 2, 0, 1, 3, 4, 5, 6, 7, 8, 9])  # not in order; 10 must sort after 9, not after 1
    refs = [GroupRef(i, 100 + i) for i in range(len(listed))]  # ref i belongs to listed[i]
    lg = split_layer_groups(listed, refs, 3)
    assert lg.count == 3
    by_group = [[int(n.split(".")[2]) for n in listed if lg.of_layer[n] == g] for g in range(3)]
    assert [sorted(g) for g in by_group] == [[0, 1, 2], [3, 4, 5, 6], [7, 8, 9, 10]]
    pos = {n: i for i, n in enumerate(listed)}
    assert [[r.tensor_idx for r in g] for g in lg.refs] == [
        [pos[n] for n in names(ix)] for ix in ([0, 1, 2], [3, 4, 5, 6], [7, 8, 9, 10])]


def test_kv_tuples_keep_both_pages_and_more_groups_than_layers_gives_one_per_layer():
    refs = [GroupRef(i, 64) for i in range(6)]  # K and V of each of 3 layers
    lg = split_layer_groups(names(range(3)), refs, 8)
    assert lg.count == 3 and [[r.tensor_idx for r in g] for g in lg.refs] == [[0, 1], [2, 3], [4, 5]]


def test_a_page_of_several_layers_cannot_be_split():
    with pytest.raises(OffloadConfigError, match=r"1 KV pages per block for 4 layers.*cannot be loaded layer by "
                                                 r"layer.*set 'layerwise_load' to false"):
        split_layer_groups(names(range(4)), [GroupRef(0, 4096)], 2)


def test_layers_sharing_a_tensor_load_it_once_per_group():
    lg = split_layer_groups(names(range(4)), [GroupRef(0, 64), GroupRef(0, 64), GroupRef(1, 64), GroupRef(2, 64)], 2)
    assert [[r.tensor_idx for r in g] for g in lg.refs] == [[0], [1, 2]]


# -- which hits -------------------------------------------------------------------------


@pytest.mark.parametrize("num_tokens, computed, hit, min_tokens, want", [
    (100, 0, 96, 32, 96),  # 4 tokens left: the whole hit, synchronously
    (300, 64, 192, 32, 192),  # after a local hit
    (96, 0, 96, 32, 80),  # the whole block-aligned prompt: its last block is computed instead
    (97, 0, 96, 32, 80),  # one token left is not enough (a uniform decode step)
    (98, 0, 96, 32, 96),  # two are
    (100, 0, 96, 128, None),  # short: asynchronous
    (96, 0, 96, 96, None),  # short once trimmed
    (100, 0, 99, 32, None),  # ends inside a block with 1 left: vLLM's own handling
    (16, 0, 16, 1, None),  # trimming leaves nothing
    (100, 0, 0, 1, None),
])
def test_sync_hit(num_tokens, computed, hit, min_tokens, want):
    assert sync_hit(num_tokens, computed, hit, 16, min_tokens) == want


@pytest.mark.parametrize("num_tokens, hit, min_left, want", [
    (1120, 96, 512, 96),  # 1,024 tokens to compute beside the hit: enough forward to hide it under
    (600, 96, 512, None),  # 504: too little
    (608, 96, 512, 96),  # exactly 512
    (96, 96, 512, None),  # a bare reload (its trimmed block is all the step computes)
    (98, 96, 1, 96),  # below two counts as two
    (97, 96, 1, 80),  # and one left still trims the last block
])
def test_sync_hit_wants_enough_new_tokens(num_tokens, hit, min_left, want):
    assert sync_hit(num_tokens, 0, hit, 16, 32, min_left=min_left) == want


def test_a_hit_whose_end_is_pinned_is_not_trimmed():
    assert sync_hit(96, 0, 96, 16, 32, trim=False) is None  # stays asynchronous
    assert sync_hit(100, 0, 96, 16, 32, trim=False) == 96


# -- keys --------------------------------------------------------------------------------


def test_layerwise_options_defaults_and_errors():
    assert layerwise_options({}) == LayerwiseOptions(False, 256, 4)
    assert layerwise_options({"layerwise_load": True, "layerwise_min_tokens": 64, "layerwise_groups": 8}) == \
        LayerwiseOptions(True, 64, 8)
    for bad in ("yes", 1, "Auto", "true"):
        with pytest.raises(OffloadConfigError, match=rf"\['layerwise_load'\]={bad!r} must be true, false "
                                                     r"\(JSON booleans\) or \"auto\""):
            layerwise_options({"layerwise_load": bad})
    for key in ("layerwise_min_tokens", "layerwise_min_new_tokens", "layerwise_groups"):
        for bad in (0, -2, 1.5, True, "x"):
            with pytest.raises(OffloadConfigError, match=rf"\['{key}'\]=.* must be a positive integer"):
                layerwise_options({key: bad})


def test_auto_mode_defaults_to_long_hits_and_keeps_a_set_threshold():
    auto = layerwise_options({"layerwise_load": "auto"})
    assert auto == LayerwiseOptions(True, AUTO_MIN_TOKENS, 4, True, AUTO_MIN_NEW_TOKENS) and auto.mode == "auto"
    assert (AUTO_MIN_TOKENS, AUTO_MIN_NEW_TOKENS) == (4096, 512)
    assert layerwise_options({"layerwise_load": "auto", "layerwise_min_tokens": 512}).min_tokens == 512
    assert layerwise_options({"layerwise_load": "auto", "layerwise_min_new_tokens": 64}).min_new_tokens == 64
    assert layerwise_options({"layerwise_load": True}).min_new_tokens == 2  # true: any hit with a step to run
    assert layerwise_options({"layerwise_load": True}).mode is True
    assert layerwise_options({}).mode is False


def test_layerwise_keys_belong_to_npu_offloading_connector():
    check_layerwise_owner({"cpu_bytes_to_use": 1})
    with pytest.raises(OffloadConfigError, match=r"\['layerwise_groups'\]=2 is read only by NPUOffloadingConnector "
                                                 r"\(\"kv_connector\": \"NPUOffloadingConnector\""):
        check_layerwise_owner({"layerwise_groups": 2})
    with npu_connector_context():
        check_layerwise_owner({"layerwise_load": True, "layerwise_groups": 2})
    with pytest.raises(OffloadConfigError):
        check_layerwise_owner({"layerwise_load": False})


def test_other_releases_refuse_layerwise_load(monkeypatch):
    monkeypatch.setattr(compat, "VLLM_RELEASE", (0, 26, 0))
    monkeypatch.setattr(compat, "VLLM_VERSION", "0.26.0")
    assert compat.layerwise_unsupported() == (
        "kv_connector_extra_config['layerwise_load']=True is supported on vLLM 0.23.x and 0.32.x (where its "
        "scheduler bookkeeping was read and tested), not on the installed vLLM 0.26.0; set it to false")
    monkeypatch.setattr(compat, "VLLM_RELEASE", (0, 23, 1))
    assert compat.layerwise_unsupported() is None


# -- result router -----------------------------------------------------------------------


def test_router_keeps_our_jobs_from_vllm_and_vllms_for_their_poll():
    def res(job, d):
        return TransferResult(job, d, True, 1, 0.0)

    queue = [[res(3, Direction.D2H), res(-7, Direction.H2D), res(4, Direction.H2D)], [res(-8, Direction.H2D)]]
    core = SimpleNamespace(poll=lambda direction=None: queue.pop(0) if queue else [])
    router = ResultRouter(core)
    assert [r.job_id for r in router.poll(Direction.D2H)] == [3]  # the load result waits for the load poll
    assert set(router.take_own([-8, -7, -9])) == {-7, -8}
    assert [r.job_id for r in router.poll(Direction.H2D)] == [4]
    assert router.take_own([-7]) == {} and router.poll() == []


# -- worker side on a real core ----------------------------------------------------------

LAYERS, PAGE, BLOCKS, CHUNKS, G = 4, 256, 16, 16, 2


@pytest.fixture
def rig():
    """A core over 4 one-tensor layers with vLLM's group (0) and 2 layer groups (1, 2); blocks 0-5
    stored to host chunks 10-15, then the device KV zeroed; the load stream is held by a gate."""
    platform = CpuPlatform(threaded_streams=True)
    kv = [torch.randint(0, 256, (BLOCKS, PAGE), dtype=torch.uint8) for _ in range(LAYERS)]
    refs = [GroupRef(i, PAGE) for i in range(LAYERS)]
    lg = split_layer_groups(names(range(LAYERS)), refs, G)
    core = OffloadWorkerCore([DeviceKVTensor.from_block_view(t) for t in kv], [refs, *lg.refs], 1, CHUNKS, platform)
    stored = np.arange(6, dtype=np.int64)
    chunks = np.arange(10, 16, dtype=np.int64)
    core.submit(1, Direction.D2H, stored, [6, 0, 0], [0, 0, 0], chunks)
    core.wait([1])
    assert [r.success for r in core.poll()] == [True]
    want = [t[stored].clone() for t in kv]
    for t in kv:
        t.zero_()
    gate = threading.Event()
    core.engine.stream(Direction.H2D).submit(gate.wait)
    loader = LayerwiseLoader(ResultRouter(core), lg, first_group=1)
    back = np.arange(8, 14, dtype=np.int64)  # load into other device blocks
    yield SimpleNamespace(core=core, kv=kv, want=want, gate=gate, loader=loader, lg=lg,
                          job=LoadJob(42, back, 0, chunks), back=back)
    gate.set()
    core.shutdown()


def loaded(rig, layer: int) -> bool:
    return torch.equal(rig.kv[layer][rig.back], rig.want[layer])


def release_later(gate: threading.Event, seconds: float = 0.2) -> None:
    threading.Timer(seconds, gate.set).start()


def test_compute_waits_for_the_layer_group_then_the_step_reports_done(rig):
    rig.loader.start([rig.job], full_graph=False)
    assert not any(loaded(rig, i) for i in range(LAYERS))  # held: the forward must not read yet
    release_later(rig.gate)
    rig.loader.wait_layer(names([0])[0])  # the first layer's attention: waits for group 0 only
    assert loaded(rig, 0) and loaded(rig, 1)
    for name in names(range(1, LAYERS)):
        rig.loader.wait_layer(name)
    assert all(loaded(rig, i) for i in range(LAYERS))
    out = rig.loader.finish()
    assert out.done == {42} and not out.invalid_blocks
    assert out.loaded == [(6 * LAYERS * PAGE, out.loaded[0][1])]
    assert rig.loader.finish().done == set()  # the step's state is gone
    assert (rig.loader.stats.loads, rig.loader.stats.steps, rig.loader.stats.failed_loads) == (1, 1, 0)


def test_one_transfer_per_layer_group_naming_only_its_group(rig):
    """(That such a transfer writes only its layers: tests/core/test_layer_groups.py.)"""
    jobs = []
    submit = rig.core.submit
    rig.core.submit = lambda job, d, dev, sizes, idx, ch: (jobs.append(list(sizes)), submit(job, d, dev, sizes, idx, ch))
    rig.loader.start([rig.job], full_graph=False)
    assert jobs == [[0, 6, 0], [0, 0, 6]]
    rig.gate.set()
    rig.loader.wait_layer(names([LAYERS - 1])[0])  # the last group: by stream order, all of them
    assert all(loaded(rig, i) for i in range(LAYERS))
    assert not rig.loader.finish().invalid_blocks


def test_full_graph_step_waits_for_everything_at_the_start(rig):
    release_later(rig.gate)
    rig.loader.start([rig.job], full_graph=True)  # no hook will run: the compute stream waits now
    assert all(loaded(rig, i) for i in range(LAYERS))
    assert not rig.loader.finish().invalid_blocks
    assert rig.loader.stats.full_graph_steps == 1


def test_a_layer_group_never_waited_for_makes_the_loads_invalid(rig):
    rig.loader.start([rig.job], full_graph=False)
    rig.gate.set()
    rig.loader.wait_layer(names([0])[0])  # layers 2-3 (group 1) never call the hook
    out = rig.loader.finish()
    assert out.done == {42} and out.invalid_blocks == set(rig.back.tolist()) and not out.loaded
    assert (rig.loader.stats.unwaited_steps, rig.loader.stats.failed_loads) == (1, 1)


def test_a_failed_layer_group_makes_the_loads_invalid(rig):
    submit = rig.core.submit

    def failing(job, d, dev, sizes, idx, ch):
        if sizes[2]:
            raise RuntimeError("injected: group 1 cannot be planned")
        return submit(job, d, dev, sizes, idx, ch)

    rig.core.submit = failing
    rig.loader.start([rig.job], full_graph=False)
    rig.gate.set()
    for name in names(range(LAYERS)):
        rig.loader.wait_layer(name)
    out = rig.loader.finish()
    assert out.done == {42} and out.invalid_blocks == set(rig.back.tolist())


# -- scheduler side against a stand-in for upstream's OffloadingConnectorScheduler ---------


class FakeUpstream:
    """The private state compat's layer-wise helpers read, as 0.23 names it; ``alloc`` does what
    upstream's update_state_after_alloc does for a load."""

    def __init__(self, workers: int = 1):
        self.config = SimpleNamespace(kv_group_configs=[SimpleNamespace(offloaded_block_size=64, gpu_block_size=16)])
        self.completed: list = []
        self.manager = SimpleNamespace(complete_load=lambda keys, ctx: self.completed.append((set(keys), ctx)))
        self._current_batch_load_jobs: dict = {}
        self._jobs: dict = {}
        self._req_status: dict = {}
        self._blocks_being_loaded: set = set()
        self.workers = workers
        self.seen_blocks = None

    def alloc(self, req_id: str, job_id: int, keys: set, blocks) -> None:
        self.seen_blocks = blocks
        self._current_batch_load_jobs[job_id] = SimpleNamespace(req_id=req_id)
        self._jobs[job_id] = SimpleNamespace(req_id=req_id, keys=set(keys), pending_count=self.workers)
        self._req_status.setdefault(req_id, SimpleNamespace(transfer_jobs=set(), req_context=f"ctx-{req_id}"))
        self._req_status[req_id].transfer_jobs.add(job_id)
        self._blocks_being_loaded |= keys


def block(i: int):
    return SimpleNamespace(block_id=i, is_null=False, block_hash=f"h{i}")


def allocate(sched, up: FakeUpstream, req, job_id: int, keys: set, hit: int, num_blocks: int):
    """What vLLM's scheduler does around update_state_after_alloc: the blocks upstream sees."""
    view = sched.before_alloc(req, SimpleNamespace(blocks=([block(i) for i in range(num_blocks)],)), hit)
    before = sched.jobs_before_alloc()
    up.alloc(req.request_id, job_id, keys, view)
    sched.after_alloc(req, before)
    return view


def test_scheduler_takes_the_job_over_and_releases_it_when_every_worker_finished():
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingConnectorMetadata

    from vllm_npu_offload.integration.layerwise_meta import LayerwiseWorkerMetadata
    from vllm_npu_offload.integration.layerwise_scheduler import LayerwiseScheduler

    up = FakeUpstream(workers=2)
    sched = LayerwiseScheduler(up, LayerwiseOptions(True, 128, 4))
    req = SimpleNamespace(request_id="r1", num_tokens=300)
    assert sched.matched(req, 64, 192, True) == (192, False)
    view = allocate(sched, up, req, 7, {"k1", "k2"}, 192, 19)
    # blocks 4..15 (tokens 64..256) are what the hit loads: shown without a hash, the rest as they were
    assert [b.block_hash is None for b in view.blocks[0]] == [False] * 4 + [True] * 12 + [False] * 3
    assert 7 not in up._jobs and up._req_status["r1"].transfer_jobs == set()  # out of upstream's books
    meta = sched.ship(OffloadingConnectorMetadata(load_jobs=dict(up._current_batch_load_jobs), store_jobs={}),
                      SimpleNamespace())
    assert meta.layerwise_jobs == {7} and set(meta.load_jobs) == {7}
    assert sched.ship(OffloadingConnectorMetadata(load_jobs={}, store_jobs={}), SimpleNamespace()).layerwise_jobs == set()
    one = LayerwiseWorkerMetadata.extend(None, {7: 1})
    sched.on_output(one)
    assert up.completed == [] and up._blocks_being_loaded == {"k1", "k2"}  # one of two workers
    sched.on_output(one)
    assert up.completed == [({"k1", "k2"}, "ctx-r1")] and not up._blocks_being_loaded and not sched.pending
    sched.on_output(one)  # a late or repeated report of a released job changes nothing
    assert len(up.completed) == 1


def test_scheduler_leaves_short_and_async_declined_hits_to_upstream():
    from vllm_npu_offload.integration.layerwise_scheduler import LayerwiseScheduler

    up = FakeUpstream()
    sched = LayerwiseScheduler(up, LayerwiseOptions(True, 256, 4))
    req = SimpleNamespace(request_id="r2", num_tokens=300)
    assert sched.matched(req, 0, 128, True) == (128, True)  # short
    assert sched.matched(req, 0, None, False) == (None, False)  # lookup deferred
    up._req_status["r9"] = SimpleNamespace(partial_tail_boundary=288)  # 0.32: the hit must end there
    assert sched.matched(SimpleNamespace(request_id="r9", num_tokens=289), 0, 288, True) == (288, True)
    assert sched.matched(SimpleNamespace(request_id="r9", num_tokens=290), 0, 288, True) == (288, False)
    view = allocate(sched, up, req, 3, {"k"}, 128, 8)
    assert all(b.block_hash for b in view.blocks[0])  # upstream sees vLLM's blocks as they are
    assert 3 in up._jobs and not sched.pending  # an ordinary asynchronous load, upstream's to complete


def test_auto_goes_layer_by_layer_only_while_no_other_request_runs():
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingConnectorMetadata

    from vllm_npu_offload.integration.layerwise_scheduler import LayerwiseScheduler

    def meta():
        return OffloadingConnectorMetadata(load_jobs={}, store_jobs={})

    up = FakeUpstream()
    sched = LayerwiseScheduler(up, LayerwiseOptions(True, 128, 4, auto=True))
    req = SimpleNamespace(request_id="r1", num_tokens=300)
    step = SimpleNamespace(num_scheduled_tokens={"other": 1, "r1": 16})
    assert sched.matched(req, 0, 192, True) == (192, False)  # nothing ran yet: layer by layer
    sched.ship(meta(), step)  # "other" decodes in this step
    assert sched.matched(req, 0, 192, True) == (192, True) and sched.auto_declined == 1  # it would wait for us
    assert sched.matched(req, 0, 64, True) == (64, True) and sched.auto_declined == 1  # short: never layer-wise
    sched.finished("other")  # finished after that step: the engine is ours alone
    assert sched.matched(req, 0, 192, True) == (192, False)
    sched.ship(meta(), SimpleNamespace(num_scheduled_tokens={"r1": 16}))  # only the request itself ran
    assert sched.matched(req, 0, 192, True) == (192, False)
    sched.ship(meta(), step)
    always = LayerwiseScheduler(up, LayerwiseOptions(True, 128, 4))
    always.ship(meta(), step)
    assert always.matched(req, 0, 192, True) == (192, False)  # layerwise_load true: whatever runs


def test_reset_cache_drops_pending_loads():
    from vllm_npu_offload.integration.layerwise_meta import LayerwiseWorkerMetadata
    from vllm_npu_offload.integration.layerwise_scheduler import LayerwiseScheduler

    up = FakeUpstream()
    sched = LayerwiseScheduler(up, LayerwiseOptions(True, 64, 4))
    req = SimpleNamespace(request_id="r3", num_tokens=200)
    sched.matched(req, 0, 128, True)
    allocate(sched, up, req, 5, {"k"}, 128, 13)
    assert 5 in sched.pending
    sched.reset()
    sched.on_output(LayerwiseWorkerMetadata.extend(None, {5: 1}))
    assert up.completed == []  # the manager forgot the blocks: nothing to release


def test_worker_metadata_sums_over_workers_beside_upstreams_fields():
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata

    from vllm_npu_offload.integration.layerwise_meta import LayerwiseWorkerMetadata

    upstream = OffloadingWorkerMetadata()
    upstream.mark_completed(3)
    a = LayerwiseWorkerMetadata.extend(None, {1: 1})
    b = LayerwiseWorkerMetadata.extend(upstream, {1: 1, 2: 1})
    both = a.aggregate(b)
    assert isinstance(both, LayerwiseWorkerMetadata)
    assert both.layerwise_done == {1: 2, 2: 1} and both.completed_jobs == {3: 1}
    assert b.aggregate(upstream).layerwise_done == {1: 1, 2: 1}
