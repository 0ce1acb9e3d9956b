"""NPUOffloadingSpec / NPUOffloadingConnector against the installed vLLM's real code (CPU tensors, no model).

Store and load jobs go through that vLLM's Scheduler (scheduler-role OffloadingConnector with
the real CPUOffloadingManager) and a worker-role connector; bytes are checked block by block.
Runs on every release from 0.21 (venvs from scripts/dev/setup_vllm.sh VERSION; all of them:
scripts/dev/version_matrix.sh).
"""

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from harness import (  # noqa: E402
    BLOCK,
    HEAD,
    HEADS,
    LAYERS,
    NB,
    PAGE,
    PROMPT,
    Engine,
    block_bytes,
    host_block,
    kv_cache_config,
    make_spec,
    parts_of,
    placed_layers,
    register_attention_layers,
    stacked_caches,
    vllm_config,
)
from kv_arena import ALIGN, Arena  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector  # noqa: E402

from vllm_npu_offload.copy.base import Direction  # noqa: E402
from vllm_npu_offload.errors import OffloadConfigError  # noqa: E402
from vllm_npu_offload.integration import compat  # noqa: E402
from vllm_npu_offload.integration.connector import NPUOffloadingConnector  # noqa: E402
from vllm_npu_offload.integration.spec import NPUOffloadingSpec  # noqa: E402



def expected_api() -> str:
    """The offloading API generation each release has (vllm_upstream.md): get_handlers before 0.25,
    get_worker in 0.25, OffloadingConfig from 0.26."""
    rel = compat.VLLM_RELEASE
    assert rel is not None, compat.VLLM_VERSION
    return "handlers" if rel < (0, 25) else "worker" if rel < (0, 26) else "config"


def test_api_generation():
    assert compat.API == expected_api()
    if compat.API == "handlers":
        assert compat.OffloadingHandler is not None and compat.OffloadingWorker is None
    else:
        assert compat.OffloadingWorker is not None and compat.OffloadingHandler is None


# -- helpers ----------------------------------------------------------------------------


def round_trip(eng: Engine, kv_caches: dict, bpc: int) -> None:
    """Store PROMPT, wipe the device KV and the prefix cache, run PROMPT again: loads must restore the bytes."""
    parts = parts_of(kv_caches)
    eng.run(PROMPT)
    stores = [j for j in eng.jobs if j.direction is Direction.D2H]
    assert stores and all(j.direction is Direction.D2H for j in eng.jobs)
    stored = {}  # host block -> device bytes it must hold
    for job in stores:
        for i, dev in enumerate(job.device_blocks):
            stored[host_block(job.chunks, i, bpc)] = block_bytes(parts, dev)
    assert len(stored) == len(PROMPT) // BLOCK
    core = eng.core
    for idx, dt in enumerate(core.device_tensors):
        (part,) = [p for p in parts if p.data_ptr() == dt.base]
        pi = next(i for i, p in enumerate(parts) if p is part)
        for hb, want in stored.items():  # the host buffer itself holds the stored blocks
            assert torch.equal(core.host_view(idx)[hb][: want[pi].numel()], want[pi])

    for p in parts:
        p.zero_()
    eng.reset_device_prefix_cache()
    n_store = len(eng.jobs)
    eng.run(PROMPT)
    loads = [j for j in eng.jobs[n_store:] if j.direction is Direction.H2D]
    assert loads, "nothing was loaded from host"
    loaded = set()
    for job in loads:
        for i, dev in enumerate(job.device_blocks):
            want = stored[host_block(job.chunks, i, bpc)]
            got = block_bytes(parts, dev)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), f"device block {dev} differs after load"
            loaded.add(dev)
    assert len(loaded) == len(PROMPT) // BLOCK
    for b in set(range(NB)) - loaded:  # nothing else was written
        assert all(int(x.count_nonzero()) == 0 for x in block_bytes(parts, b))

    # vLLM's own transfer stats carry exactly the bytes moved (every layer's page of every block)
    blocks = len(PROMPT) // BLOCK
    assert eng.moved == {"store": blocks * sum(p[0].nbytes for p in parts),
                         "load": blocks * sum(p[0].nbytes for p in parts)}


# -- spec inside the upstream OffloadingConnector ---------------------------------------


@pytest.mark.parametrize(
    "extra, bpc, num_blocks",
    [
        ({"cpu_bytes_to_use": 32 * PAGE * 2}, 1, 32),
        ({"cpu_bytes_to_use": 32 * PAGE * 2, "blocks_per_chunk": 2}, 2, 16),
        ({"num_cpu_blocks": 12, "block_size": 2 * BLOCK}, 2, 12),
    ],
    ids=["cpu_bytes", "blocks_per_chunk", "legacy_num_cpu_blocks"],
)
def test_store_load_through_real_scheduler(tiny_model, extra, bpc, num_blocks):
    vc = vllm_config(tiny_model, extra)
    user_extra = dict(vc.kv_transfer_config.kv_connector_extra_config)
    kcc = kv_cache_config(NB, LAYERS, HEADS, HEAD, PAGE)
    caches = stacked_caches()
    eng = Engine.build(vc, kcc, caches, OffloadingConnector)
    assert isinstance(eng.spec, NPUOffloadingSpec)
    assert eng.spec.geometry == (bpc, num_blocks)
    sched_cfg = eng.sched.connector.connector_scheduler.config  # built from the scheduler-side spec
    assert getattr(sched_cfg, "block_size_factor", None) or sched_cfg.blocks_per_chunk == bpc
    assert type(eng.manager).__name__ == "CPUOffloadingManager"
    assert vc.kv_transfer_config.kv_connector_extra_config == user_extra  # never edited in place
    assert eng.core.num_chunks == num_blocks and eng.core.blocks_per_chunk == bpc
    round_trip(eng, caches, bpc)
    core, calls = eng.core, []
    shutdown = core.shutdown
    core.shutdown = lambda: (calls.append(1), shutdown())
    eng.worker.shutdown()
    assert calls and core.closed  # the one core behind both directions is shut down


def canonical(caches: dict):
    """``CanonicalKVCaches`` as upstream's worker builds them: one int8 (blocks, page) view per layer."""
    return compat.CanonicalKVCaches(
        tensors=[compat.CanonicalKVCacheTensor(t.view(torch.int8).view(NB, PAGE), PAGE) for t in caches.values()],
        group_data_refs=[[compat.CanonicalKVCacheRef(0, PAGE), compat.CanonicalKVCacheRef(1, PAGE)]],
    )


def spec_and_canonical(tiny_model):
    vc = vllm_config(tiny_model, {"cpu_bytes_to_use": 8 * PAGE * 2})
    spec = make_spec(NPUOffloadingSpec, vc, kv_cache_config(NB, LAYERS, HEADS, HEAD, PAGE))
    caches = stacked_caches()
    return spec, caches, canonical(caches)


@pytest.mark.skipif(compat.API != "handlers", reason="get_handlers is the 0.21-0.24 API; "
                    "test_worker_reports_each_job_once covers get_worker (>= 0.25)")
def test_handlers_report_only_their_direction(tiny_model):
    from vllm.v1.kv_offload.worker.worker import OffloadingHandler

    spec, caches, canon = spec_and_canonical(tiny_model)
    (s_src, s_dst, store), (l_src, l_dst, load) = list(spec.get_handlers(canon))
    assert (s_src, s_dst, l_src, l_dst) == (
        compat.GPULoadStoreSpec, compat.CPULoadStoreSpec, compat.CPULoadStoreSpec, compat.GPULoadStoreSpec,
    )
    assert isinstance(store, OffloadingHandler) and isinstance(load, OffloadingHandler)
    gpu = compat.GPULoadStoreSpec([3, 4], group_sizes=[2], block_indices=[0])
    assert store.transfer_async(10, (gpu, compat.CPULoadStoreSpec([5, 1])))
    assert load.transfer_async(11, (compat.CPULoadStoreSpec([5]), compat.GPULoadStoreSpec([9], [1], [0])))
    store.wait({10})
    load.wait({10, 11})  # both handlers may be asked for every id (OffloadingWorker fans out)
    (lr,) = load.get_finished()
    assert (lr.job_id, lr.success, lr.transfer_type, lr.transfer_size) == (11, True, ("CPU", "GPU"), 2 * PAGE)
    (sr,) = store.get_finished()
    assert (sr.job_id, sr.transfer_type, sr.transfer_size) == (10, ("GPU", "CPU"), 4 * PAGE)
    assert store.get_finished() == [] and load.get_finished() == []
    for t in caches.values():
        assert torch.equal(t[9], t[3])
    store.shutdown()
    load.shutdown()  # the shared core shuts down once


@pytest.mark.skipif(compat.API == "handlers", reason="get_worker is the >= 0.25 API; "
                    "test_handlers_report_only_their_direction covers get_handlers (0.21-0.24)")
def test_worker_reports_each_job_once(tiny_model):
    spec, caches, canon = spec_and_canonical(tiny_model)
    worker = spec.get_worker(canon)
    assert isinstance(worker, compat.OffloadingWorker) and spec.get_worker(canon) is worker
    gpu = compat.GPULoadStoreSpec([3, 4], group_sizes=[2], block_indices=[0])
    assert worker.submit_store(10, gpu, compat.CPULoadStoreSpec([5, 1]))
    worker.wait({10})
    assert worker.submit_load(11, compat.CPULoadStoreSpec([5]), compat.GPULoadStoreSpec([9], [1], [0]))
    worker.wait({10, 11})
    done = sorted(worker.get_finished(), key=lambda r: r.job_id)
    assert [(r.job_id, r.success, r.transfer_size) for r in done] == [(10, True, 4 * PAGE), (11, True, 2 * PAGE)]
    assert worker.get_finished() == []  # each result is reported once
    for t in caches.values():
        assert torch.equal(t[9], t[3])
        assert not torch.equal(t[9], t[4])
    worker.shutdown()


@pytest.mark.parametrize(
    "extra, match",
    [
        ({}, "needs 'cpu_bytes_to_use'"),
        ({"cpu_bytes_to_use": 0}, r"\['cpu_bytes_to_use'\]=0 must be a positive integer"),
        ({"cpu_bytes_to_use": -5}, r"\['cpu_bytes_to_use'\]=-5 must be a positive integer"),
        ({"cpu_bytes_to_use": "lots"}, r"\['cpu_bytes_to_use'\]='lots' must be a positive integer"),
        ({"num_cpu_blocks": 0}, r"\['num_cpu_blocks'\]=0 must be a positive integer"),
        ({"num_cpu_blocks": 4, "cpu_bytes_to_use": 1 << 30}, "give only one"),
        ({"cpu_bytes_to_use": 1 << 30, "block_size": 24}, r"\['block_size'\]=24 must be a multiple of the engine"),
        ({"cpu_bytes_to_use": 1 << 30, "block_size": 32, "blocks_per_chunk": 2}, "only one of 'block_size'"),
        ({"cpu_bytes_to_use": 1 << 30, "eviction_policy": "mru"}, r"\['eviction_policy'\]='mru' is not one of"),
        ({"cpu_bytes_to_use": 100}, "smaller than one offloaded block"),
    ],
)
def test_bad_config_errors(tiny_model, extra, match):
    vc = vllm_config(tiny_model, extra)
    if compat.API == "config" and "block_size" in extra:
        # >= 0.26 checks 'block_size' itself (build_offloading_config) before any spec is built.
        with pytest.raises((AssertionError, ValueError)):
            make_spec(NPUOffloadingSpec, vc, kv_cache_config(NB, LAYERS, HEADS, HEAD, PAGE))
        return
    with pytest.raises(OffloadConfigError, match=match):
        make_spec(NPUOffloadingSpec, vc, kv_cache_config(NB, LAYERS, HEADS, HEAD, PAGE))


def test_legacy_num_cpu_blocks_sizing(tiny_model):
    kcc = kv_cache_config(NB, LAYERS, HEADS, HEAD, PAGE)
    spec = make_spec(NPUOffloadingSpec, vllm_config(tiny_model, {"num_cpu_blocks": 10}), kcc)
    assert spec.geometry == (1, 10)
    assert spec.extra_config["cpu_bytes_to_use"] == 10 * PAGE * len(LAYERS)
    assert "num_cpu_blocks" not in spec.extra_config
    assert spec.get_manager() is spec.get_manager()
    if compat.API == "config":
        return  # >= 0.26 builds the spec only once the KV size is known (OffloadingConfig)
    # 0.21-0.25: the scheduler side before the KV size is known: a placeholder, no error
    no_kv_yet = kv_cache_config(0, LAYERS, HEADS, HEAD, PAGE)
    empty = NPUOffloadingSpec(vllm_config(tiny_model, {"num_cpu_blocks": 10}), no_kv_yet)
    assert empty.geometry[1] == 0


# -- NPUOffloadingConnector with vLLM-Ascend-style K/V tuples ---------------------------


def ascend_caches(arena: Arena, kind: str) -> dict:
    if kind == "kv":  # K and V as separate tensors
        shapes = [(NB, BLOCK, HEADS, HEAD), (NB, BLOCK, HEADS, HEAD)]
    else:  # MLA: nope 512 + rope 64, different page sizes
        shapes = [(NB, BLOCK, 1, 512), (NB, BLOCK, 1, 64)]
    g = torch.Generator().manual_seed(2)
    out = {}
    for n in LAYERS:
        parts = tuple(arena.tensor(s) for s in shapes)
        for p in parts:
            p.copy_(torch.randn(p.shape, generator=g))
        out[n] = parts
    return out


@pytest.mark.parametrize("kind", ["kv", "mla"])
def test_connector_canonicalises_ascend_tuples(tiny_model, kind):
    heads, head = (HEADS, HEAD) if kind == "kv" else (1, 576)
    page = 2 * BLOCK * HEADS * HEAD * 4 if kind == "kv" else BLOCK * 576 * 4
    vc = vllm_config(
        tiny_model,
        {"cpu_bytes_to_use": 16 * page * len(LAYERS)},
        connector="NPUOffloadingConnector",
        module="vllm_npu_offload.integration.connector",
    )
    kcc = kv_cache_config(NB, LAYERS, heads, head, page)
    arena = Arena(10 * ALIGN)
    caches = ascend_caches(arena, kind)
    eng = Engine.build(vc, kcc, caches, NPUOffloadingConnector)
    assert isinstance(eng.sched.connector, NPUOffloadingConnector)  # loaded via kv_connector_module_path
    assert len(eng.core.device_tensors) == 2 * len(LAYERS)
    assert {d.base for d in eng.core.device_tensors} == {p.data_ptr() for p in parts_of(caches)}
    round_trip(eng, caches, 1)
    assert arena.outside_untouched()
    eng.worker.shutdown()


def test_upstream_connector_rejects_tuples(tiny_model):
    """Why NPUOffloadingConnector exists: upstream's worker reads one tensor per attention layer."""
    vc = vllm_config(tiny_model, {"cpu_bytes_to_use": 1 << 20})
    kcc = kv_cache_config(NB, LAYERS, HEADS, HEAD, PAGE)
    caches = ascend_caches(Arena(10 * ALIGN), "kv")
    with pytest.raises((AssertionError, AttributeError)):  # asserts a tensor (< 0.32) / reads .shape (0.32)
        Engine.build(vc, kcc, caches, OffloadingConnector)


def test_connector_plain_tensors_take_upstream_path(tiny_model, monkeypatch):
    """Plain tensors go through upstream's register_kv_caches unchanged (same CanonicalKVCaches)."""
    seen = []
    entry = "get_handlers" if compat.API == "handlers" else "get_worker"
    orig = getattr(NPUOffloadingSpec, entry)

    def spy(self, kv_caches):
        seen.append(kv_caches)
        return orig(self, kv_caches)

    monkeypatch.setattr(NPUOffloadingSpec, entry, spy)
    vc = vllm_config(tiny_model, {"cpu_bytes_to_use": 1 << 20})
    kcc = kv_cache_config(NB, LAYERS, HEADS, HEAD, PAGE)
    caches = stacked_caches()
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    register_attention_layers(vc, LAYERS)
    for cls in (OffloadingConnector, NPUOffloadingConnector):
        with set_current_vllm_config(vc):
            cls(vc, KVConnectorRole.WORKER, kcc).register_kv_caches(caches)
    a, b = seen
    assert [(t.tensor.data_ptr(), t.tensor.shape, t.page_size_bytes) for t in a.tensors] == [
        (t.tensor.data_ptr(), t.tensor.shape, t.page_size_bytes) for t in b.tensors
    ]
    assert a.group_data_refs == b.group_data_refs


def test_connector_rejects_bad_layer_values(tiny_model):
    vc = vllm_config(tiny_model, {"cpu_bytes_to_use": 1 << 20})
    kcc = kv_cache_config(NB, LAYERS, HEADS, HEAD, PAGE)
    caches = {n: (torch.zeros(NB, BLOCK, HEADS, HEAD), "v") for n in LAYERS}
    with pytest.raises(OffloadConfigError, match="allowed: a tensor or a non-empty tuple/list of tensors"):
        Engine.build(vc, kcc, caches, NPUOffloadingConnector)
    wrong = {n: (torch.zeros(NB - 1, BLOCK, HEADS, HEAD),) * 2 for n in LAYERS}
    with pytest.raises(OffloadConfigError, match=f"leading dimension must be num_blocks={NB}"):
        Engine.build(vc, kcc, wrong, NPUOffloadingConnector)
