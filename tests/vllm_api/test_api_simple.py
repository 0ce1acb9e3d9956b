"""NPUSimpleCPUOffloadConnector against the installed vLLM's real code (CPU tensors, no model).

That vLLM's Scheduler runs our connector's scheduler role (vLLM's SimpleCPUOffloadScheduler
underneath); a worker-role connector runs our NPUSimpleCPUOffloadWorker on CPU "device" KV.
Runs on every release from 0.21 (scripts/dev/setup_vllm.sh VERSION; all: scripts/dev/version_matrix.sh).
"""

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from simple_fakes import failing_copies  # noqa: E402
from harness import BLOCK, Engine, block_bytes, kv_cache_config, parts_of, stacked_caches, vllm_config  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402
from vllm.v1.simple_kv_offload.manager import SimpleCPUOffloadScheduler  # noqa: E402
from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadMetadata  # noqa: E402

from vllm_npu_offload.copy.base import Direction  # noqa: E402
from vllm_npu_offload.integration import compat  # noqa: E402
from vllm_npu_offload.integration.simple_connector import NPUSimpleCPUOffloadConnector  # noqa: E402
from vllm_npu_offload.integration.simple_worker import NPUSimpleCPUOffloadWorker  # noqa: E402

NB = 24
HEADS, HEAD = 2, 32
PAGE = 2 * BLOCK * HEADS * HEAD * 4
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
PROMPT = list(range(1, 101))  # 100 tokens: 6 full blocks
MODULE = "vllm_npu_offload.integration.simple_connector"


def simple_config(model: str, policy: str | None = None):
    vc = vllm_config(model, {"cpu_bytes_to_use": 32 * PAGE * len(LAYERS)}, "NPUSimpleCPUOffloadConnector",
                     MODULE, spec=False)
    if policy is not None:
        vc.kv_transfer_config.kv_load_failure_policy = policy
    return vc


def build(model: str, policy: str | None = None):
    caches = stacked_caches(LAYERS, NB, HEADS, HEAD)
    eng = Engine.build(simple_config(model, policy), kv_cache_config(NB, LAYERS, HEADS, HEAD, PAGE), caches,
                       NPUSimpleCPUOffloadConnector)
    launches = []  # (direction, event, src ids, dst ids) as the worker core handed them to the transport
    transport = eng.worker.worker_handler.transport
    launch = transport.launch

    def recording(direction, event_idx, src_ids, dst_ids):
        launches.append((direction, event_idx, [int(b) for b in src_ids], [int(b) for b in dst_ids]))
        return launch(direction, event_idx, src_ids, dst_ids)

    transport.launch = recording
    return eng, parts_of(caches), launches


def of(launches, direction):
    return [x for x in launches if x[0] is direction]


REL = compat.VLLM_RELEASE or (99, 0, 0)
# 0.30 is the first release whose engine reports failed loads per request (failed_recving), 0.24
# the first with an abandoned-store set (read from the sdists).
HAS_FAILED_RECVING = REL >= (0, 30)
FAILED_STORE_MODE = "abandon" if REL >= (0, 24) else "release"


def test_imports_and_constructs_both_roles(tiny_model):
    assert compat.SIMPLE_HAS_FAILED_RECVING is HAS_FAILED_RECVING
    vc = simple_config(tiny_model)
    kcc = kv_cache_config(NB, LAYERS, HEADS, HEAD, PAGE)
    worker = NPUSimpleCPUOffloadConnector(vc, KVConnectorRole.WORKER, kcc)
    assert isinstance(worker.worker_handler, NPUSimpleCPUOffloadWorker) and worker.scheduler_manager is None
    sched = NPUSimpleCPUOffloadConnector(vc, KVConnectorRole.SCHEDULER, kcc)
    assert isinstance(sched.scheduler_manager, SimpleCPUOffloadScheduler) and sched.worker_handler is None
    # before 0.24 there is no abandoned-store set: failed stores are released by the connector itself
    assert compat.simple_failed_store_mode(sched.scheduler_manager) == FAILED_STORE_MODE
    assert (sched._store_releaser is not None) is (FAILED_STORE_MODE == "release")
    assert sched._can_abandon is (FAILED_STORE_MODE == "abandon")


def test_store_then_load_round_trip_byte_exact(tiny_model):
    eng, parts, launches = build(tiny_model)
    assert isinstance(eng.sched.connector, NPUSimpleCPUOffloadConnector)
    first = eng.run(PROMPT)
    assert first.status == RequestStatus.FINISHED_LENGTH_CAPPED
    stores = of(launches, Direction.D2H)
    assert stores and not of(launches, Direction.H2D)
    stored = {}  # host block -> the device bytes it must hold
    for _, _, dev, host in stores:
        for d, h in zip(dev, host):
            stored[h] = block_bytes(parts, d)
    assert len(stored) == len(PROMPT) // BLOCK
    assert eng.sched.connector.scheduler_manager.cpu_block_pool.cached_block_hash_to_block  # loadable now

    for p in parts:
        p.zero_()
    eng.reset_device_prefix_cache()
    n = len(launches)
    second = eng.run(PROMPT)
    assert second.status == RequestStatus.FINISHED_LENGTH_CAPPED
    loads = of(launches[n:], Direction.H2D)
    assert len(loads) == 1, "one load event from host"
    _, _, host, dev = loads[0]
    assert sorted(host) == sorted(stored) and len(dev) == len(stored)
    for h, d in zip(host, dev):
        assert all(torch.equal(a, b) for a, b in zip(block_bytes(parts, d), stored[h])), f"device block {d}"
    core = eng.worker.worker_handler.core
    assert core.stats.failed == 0 and core.is_idle()


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_failed_load_is_reported_never_hangs(tiny_model, policy):
    """A failed host load is reported (per-block load errors with one KV-cache group): the
    scheduler fails the request (policy "fail") or recomputes it; it must neither hang nor run
    on unloaded KV."""
    eng, parts, launches = build(tiny_model, policy)
    eng.run(PROMPT)
    for p in parts:
        p.zero_()
    eng.reset_device_prefix_cache()
    w = eng.worker.worker_handler
    n = len(launches)
    with failing_copies(w, Direction.H2D):
        req = eng.run(PROMPT)  # raises if it does not finish within max_steps
    assert len(of(launches[n:], Direction.H2D)) == 1  # one failed attempt, not re-tried forever
    assert w.core.stats.failed == 1 and w.core.is_idle()
    if policy == "fail":
        assert req.status == RequestStatus.FINISHED_ERROR
    else:
        assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    # The host copy is intact: a later request loads it normally.
    assert eng.run(PROMPT).status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert w.core.stats.failed == 1


def test_failed_store_is_never_loadable_and_released(tiny_model):
    eng, parts, launches = build(tiny_model)
    w = eng.worker.worker_handler
    conn = eng.sched.connector
    manager = conn.scheduler_manager
    free_before = manager.cpu_block_pool.get_num_free_blocks()
    with failing_copies(w, Direction.D2H):
        assert eng.run(PROMPT).status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert of(launches, Direction.D2H) and w.core.stats.failed >= 1
    assert not manager.cpu_block_pool.cached_block_hash_to_block  # nothing became loadable
    assert not manager._store_event_to_blocks
    if conn._store_releaser is not None:  # before 0.24: the connector's own releaser
        assert not conn._store_releaser.events
    else:  # vLLM's abandoned set has released them
        assert not manager._abandoned_store_event_to_blocks
    assert manager.cpu_block_pool.get_num_free_blocks() == free_before  # CPU refs released
    eng.reset_device_prefix_cache()  # asserts every device block is free again (refs released)
    n = len(launches)
    eng.run(PROMPT)  # nothing to load; this time the store succeeds
    assert not of(launches[n:], Direction.H2D) and of(launches[n:], Direction.D2H)
    assert manager.cpu_block_pool.cached_block_hash_to_block


def test_failed_load_with_several_kv_groups_is_never_finished(tiny_model):
    """With several KV-cache groups, block ids cannot name the failure: from 0.30 the request is
    reported in failed_recving; before, vLLM can map neither block ids nor requests to a failure,
    so the worker raises instead of finishing the request on unloaded KV."""
    vc = simple_config(tiny_model)
    kcc = kv_cache_config(NB, LAYERS, HEADS, HEAD, PAGE)
    conn = NPUSimpleCPUOffloadConnector(vc, KVConnectorRole.WORKER, kcc)
    conn.register_kv_caches(stacked_caches(LAYERS, NB, HEADS, HEAD))
    w = conn.worker_handler
    w.report_block_errors = False  # what several KV-cache groups set
    meta = SimpleCPUOffloadMetadata(load_event=0, load_gpu_blocks=[3], load_cpu_blocks=[1],
                                    load_event_to_reqs={0: ["r1"]})
    with failing_copies(w, Direction.H2D):
        conn.bind_connector_metadata(meta)
        conn.start_load_kv(None)
        w.core.flush()
        if HAS_FAILED_RECVING:
            res = conn.get_transfer_results(set())
            # finished and failed: the scheduler then recomputes it instead of using its KV
            assert res.failed_recving == {"r1"} and res.finished_recving == {"r1"}
            assert conn.get_block_ids_with_load_errors() == set()  # reported per request instead
        else:
            with pytest.raises(RuntimeError, match="r1"):
                conn.get_finished(set())
    conn.clear_connector_metadata()
    conn.shutdown()
