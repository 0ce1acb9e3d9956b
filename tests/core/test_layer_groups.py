"""Layer groups as worker-core groups, the groundwork of layer-wise reload (docs/layerwise.md):
a uniform model's layers split into G groups over the same device blocks and host chunks. A
store of every group loads back group by group; each group's transfer writes only its own
layers, and together they equal the stored bytes, direct and staged."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from staged_round_trip import settle

from vllm_npu_offload import staging
from vllm_npu_offload.copy.base import Direction
from vllm_npu_offload.device_kv import DeviceKVTensor, GroupRef
from vllm_npu_offload.offload_worker import OffloadWorkerCore
from vllm_npu_offload.platform import CpuPlatform

LAYERS, PAGE, BLOCKS, BPC, CHUNKS = 8, 1024, 32, 2, 16


@pytest.mark.parametrize("staged", ["0", "1"])
@pytest.mark.parametrize("groups", [2, 4])
@pytest.mark.parametrize("layers, page", [(LAYERS, PAGE), (32, 32768)])  # and Llama-3-8B, K and V apart
def test_group_by_group_load_equals_the_store(monkeypatch, staged, groups, layers, page):
    monkeypatch.setenv("NPU_OFFLOAD_STAGED", staged)
    monkeypatch.setattr(staging, "MIN_SLOT_BYTES", 0)
    monkeypatch.setattr(staging, "MIN_SLICE_BYTES", 0)
    rng = np.random.default_rng(groups)
    kv = [torch.from_numpy(rng.integers(0, 256, (BLOCKS, page), dtype=np.uint8)).clone() for _ in range(2 * layers)]
    per = 2 * layers // groups  # K and V of layers / groups layers
    refs = [[GroupRef(i, page) for i in range(g * per, (g + 1) * per)] for g in range(groups)]
    core = OffloadWorkerCore([DeviceKVTensor.from_block_view(t) for t in kv], refs, BPC, CHUNKS, CpuPlatform(),
                             staging_bytes=2 * 2 * BPC * 2 * layers * page)
    assert (core.stager is not None) == (staged == "1")
    n = 6
    ids = rng.choice(BLOCKS, n, replace=False).astype(np.int64)
    chunks = rng.choice(CHUNKS, n // BPC, replace=False).astype(np.int64)
    # one store of every group: the same blocks and chunks for each
    core.submit(1, Direction.D2H, np.tile(ids, groups), [n] * groups, [0] * groups, np.tile(chunks, groups))
    settle(core, [1])
    want = [t[ids].clone() for t in kv]
    back = rng.choice(np.setdiff1d(np.arange(BLOCKS), ids), n, replace=False).astype(np.int64)
    for t in kv:
        t[back] = 0
    for g in range(groups):  # what a layer-wise load submits: group g alone
        core.submit(10 + g, Direction.H2D, back, [n if j == g else 0 for j in range(groups)], [0] * groups, chunks)
        settle(core, [10 + g])
        for i, t in enumerate(kv):
            if i // per <= g:
                assert torch.equal(t[back], want[i]), (g, i)
            else:
                assert not t[back].any(), (g, i)  # later groups untouched
    core.shutdown()


def test_gemma2_shape_two_groups_round_trip(monkeypatch):
    """The real shape of the multigroup yardstick model (Gemma-2-9B: 42 layers alternating sliding
    window / global, one 128 KiB K+V page per layer and 16-token block, 4 blocks per host chunk),
    staged, each vLLM group under its own offload keys (its own chunks, as vLLM hands them): the
    group-major record puts each group's 21 pages in one span; stores copy it block by block,
    loads whole runs; every block comes back byte-exact."""
    monkeypatch.setenv("NPU_OFFLOAD_STAGED", "1")
    page, layers, blocks, bpc, chunks = 128 << 10, 42, 16, 4, 8
    rng = np.random.default_rng(42)
    kv = [torch.from_numpy(rng.integers(0, 256, (blocks, page), dtype=np.uint8)) for _ in range(layers)]
    refs = [[GroupRef(i, page) for i in range(g, layers, 2)] for g in range(2)]
    core = OffloadWorkerCore([DeviceKVTensor.from_block_view(t) for t in kv], refs, bpc, chunks, CpuPlatform(),
                             staging_bytes=2 * 2 * bpc * layers * page)
    assert [core.layout.group_span([r.tensor_idx for r in g]) for g in refs] == [(0, 21 * page), (21 * page, 42 * page)]
    n = 8
    ids = [rng.choice(blocks, n, replace=False).astype(np.int64) for _ in refs]
    ch = rng.permutation(chunks).astype(np.int64)  # group 0: chunks ch[:2], group 1: ch[2:4]
    plan = core.plan(Direction.D2H, np.concatenate(ids), [n, n], [0, 0], ch[:4], staged=True).plan
    assert len(plan.link) == 2 * n  # partial spans: one link copy per block
    core.pool.release(plan.buffers)
    core.submit(1, Direction.D2H, np.concatenate(ids), [n, n], [0, 0], ch[:4])
    settle(core, [1])
    want = [t.clone() for t in kv]
    for t in kv:
        t.zero_()
    core.submit(2, Direction.H2D, np.concatenate(ids), [n, n], [0, 0], ch[:4])
    settle(core, [2])
    for g, group in enumerate(refs):
        for r in group:
            assert torch.equal(kv[r.tensor_idx][ids[g]], want[r.tensor_idx][ids[g]]), (g, r)
            others = np.setdiff1d(np.arange(blocks), ids[g])
            assert not kv[r.tensor_idx][others].any(), (g, r)  # a group's load writes only its blocks
    core.shutdown()


def test_layer_group_load_moves_only_its_span(monkeypatch):
    """A staged load of one layer group copies that group's span of each record, one link copy per
    block (a whole run of records would move every other group's bytes too: G times the bytes)."""
    monkeypatch.setenv("NPU_OFFLOAD_STAGED", "1")
    monkeypatch.setattr(staging, "MIN_SLOT_BYTES", 0)
    monkeypatch.setattr(staging, "MIN_SLICE_BYTES", 1 << 40)  # one slice
    kv = [torch.zeros(BLOCKS, PAGE, dtype=torch.uint8) for _ in range(2 * LAYERS)]
    whole = [GroupRef(i, PAGE) for i in range(2 * LAYERS)]
    halves = [whole[:LAYERS], whole[LAYERS:]]
    core = OffloadWorkerCore([DeviceKVTensor.from_block_view(t) for t in kv], [whole, *halves], BPC, CHUNKS,
                             CpuPlatform(), staging_bytes=2 * 2 * 8 * BPC * 2 * LAYERS * PAGE)
    n, span = 6, LAYERS * PAGE
    ids, chunks = np.arange(n, dtype=np.int64), np.arange(3, dtype=np.int64)  # consecutive host blocks
    plan = core.plan(Direction.H2D, ids, [0, 0, n], [0, 0, 0], chunks, staged=True).plan
    assert len(plan.link) == n and plan.link.sizes.tolist() == [span] * n
    assert plan.link.src.tolist() == [core.host.base + b * core.layout.record_bytes + span for b in range(n)]
    core.pool.release(plan.buffers)
    whole_plan = core.plan(Direction.H2D, ids, [n, 0, 0], [0, 0, 0], chunks, staged=True).plan
    assert len(whole_plan.link) == 1 and whole_plan.link.sizes.tolist() == [n * core.layout.record_bytes]
    core.pool.release(whole_plan.buffers)
    core.shutdown()
