"""vLLM's own CPU manager hands reused host chunks out in reverse: once its cache is full, the
chunks of a new store are the evicted ones, last-freed first. The worker core plans such a
transfer as one link copy per run of consecutive chunks, not one per chunk (``plan.host_ordered``)."""

import dataclasses

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")
from vllm.v1.kv_offload.base import ReqContext, make_offload_key
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

from vllm_npu_offload import staging
from vllm_npu_offload.copy.base import Direction
from vllm_npu_offload.device_kv import DeviceKVTensor, GroupRef
from vllm_npu_offload.offload_worker import OffloadWorkerCore
from vllm_npu_offload.platform import CpuPlatform

CHUNKS, BLOCKS, LAYERS, PAGE = 16, 8, 32, 1024


def _store(manager, name: str, n: int) -> np.ndarray:
    has_id = "req_id" in {f.name for f in dataclasses.fields(ReqContext)}  # 0.21-0.22 have no req_id
    ctx = ReqContext(req_id=name) if has_id else ReqContext()
    keys = [make_offload_key(f"{name}{i}".encode().ljust(32, b"."), 0) for i in range(n)]
    out = manager.prepare_store(keys, ctx)
    assert out is not None and len(out.keys_to_store) == n
    manager.complete_store(keys, ctx)
    return np.asarray(out.store_spec.block_ids, np.int64)


def test_reused_chunks_come_back_reversed_and_plan_as_one_copy(monkeypatch):
    manager = CPUOffloadingManager(CHUNKS)
    first = _store(manager, "a", CHUNKS)  # fills the cache: fresh chunks, ascending
    assert first.tolist() == list(range(CHUNKS))
    reused = _store(manager, "b", BLOCKS)  # evicts a's oldest 8 chunks and takes them back
    assert reused.tolist() == list(range(BLOCKS))[::-1]

    monkeypatch.setenv("NPU_OFFLOAD_STAGED", "1")
    monkeypatch.setattr(staging, "MIN_SLICE_BYTES", 1 << 40)  # one slice: only host order splits runs
    kv = [torch.zeros(2 * BLOCKS, PAGE, dtype=torch.uint8) for _ in range(2 * LAYERS)]
    core = OffloadWorkerCore([DeviceKVTensor.from_block_view(t) for t in kv],
                             [[GroupRef(i, PAGE) for i in range(len(kv))]], 1, CHUNKS, CpuPlatform(),
                             staging_bytes=4 * BLOCKS * len(kv) * PAGE)
    try:
        for direction in Direction:
            plan = core.plan(direction, np.arange(BLOCKS), [BLOCKS], [0], reused, staged=True).plan
            assert plan.link.sizes.tolist() == [BLOCKS * core.layout.record_bytes]
            core.pool.release(plan.buffers)
    finally:
        core.shutdown()
