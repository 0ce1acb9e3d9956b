"""NPUOffloadingConnector on the current vLLM API (no model run): register_kv_caches with
vLLM-Ascend-style K/V tuples, then byte-exact store/load through the spec's worker."""

import pytest
import torch

vllm = pytest.importorskip("vllm")

from kv_arena import ALIGN, Arena  # noqa: E402
from vllm_configs import (  # noqa: E402
    BLOCK,
    HEAD,
    HEADS,
    LAYERS,
    NB,
    PAGE,
    SPEC_EXTRA,
    stacked_caches,
    worker_connector,
)

from vllm_npu_offload.integration import compat  # noqa: E402

if compat.API == "handlers":
    pytest.skip("tests/vllm_api covers the 0.21-0.24 API", allow_module_level=True)


def _connector(tiny_model, cls):
    return worker_connector(tiny_model, cls, {"cpu_bytes_to_use": 8 * PAGE * len(LAYERS), **SPEC_EXTRA})


def test_connector_tuples_round_trip(tiny_model):
    from vllm_npu_offload.integration.connector import NPUOffloadingConnector
    from vllm_npu_offload.integration.workers import NPUOffloadingWorker

    conn, register = _connector(tiny_model, NPUOffloadingConnector)
    arena = Arena(6 * ALIGN)
    g = torch.Generator().manual_seed(0)
    caches = {}
    for n in LAYERS:
        k, v = arena.tensor((NB, BLOCK, HEADS, HEAD)), arena.tensor((NB, BLOCK, HEADS, HEAD))
        k.copy_(torch.randn(k.shape, generator=g))
        v.copy_(torch.randn(v.shape, generator=g))
        caches[n] = (k, v)
    register(caches)
    worker = conn.connector_worker.worker
    assert isinstance(worker, NPUOffloadingWorker)
    assert {d.base for d in worker.core.device_tensors} == {p.data_ptr() for kv in caches.values() for p in kv}

    parts = [p for kv in caches.values() for p in kv]
    snapshot = [p.clone() for p in parts]
    assert worker.submit_store(1, compat.GPULoadStoreSpec([2, 5, 7], [3], [0]), compat.CPULoadStoreSpec([4, 0, 6]))
    worker.wait({1})
    for p in parts:
        p.zero_()
    assert worker.submit_load(2, compat.CPULoadStoreSpec([0, 6]), compat.GPULoadStoreSpec([9, 10], [2], [0]))
    worker.wait({2})
    results = {r.job_id: r for r in worker.get_finished()}
    assert results[1].success and results[2].success and results[1].transfer_size == 3 * PAGE * len(LAYERS)
    for p, s in zip(parts, snapshot):
        assert torch.equal(p[9], s[5]) and torch.equal(p[10], s[7])
        assert int(p[[0, 1, 2, 3, 4, 5, 6, 7, 8, 11]].count_nonzero()) == 0
    assert arena.outside_untouched()
    conn.shutdown()


def test_connector_plain_tensors_take_upstream_path(tiny_model, monkeypatch):
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

    from vllm_npu_offload.integration.connector import NPUOffloadingConnector
    from vllm_npu_offload.integration.spec import NPUOffloadingSpec

    seen = []
    orig = NPUOffloadingSpec.get_worker
    monkeypatch.setattr(NPUOffloadingSpec, "get_worker", lambda self, kv: (seen.append(kv), orig(self, kv))[1])
    caches = stacked_caches()
    for cls in (OffloadingConnector, NPUOffloadingConnector):
        conn, register = _connector(tiny_model, cls)
        register(caches)
        conn.shutdown()
    a, b = seen
    def key(c):
        return [(t.tensor.data_ptr(), tuple(t.tensor.shape), t.tensor.stride(), t.page_size_bytes) for t in c.tensors]

    assert key(a) == key(b)
    assert a.group_data_refs == b.group_data_refs
