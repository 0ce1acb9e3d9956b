"""The staged round trip both native-library tests run (ACL emulation, fake CUDA driver): store
15 random blocks from sub-block 1 of 8 host chunks, check the host records byte for byte, zero
the device KV, load them into other blocks and compare."""

from __future__ import annotations

import numpy as np
import torch

from vllm_npu_offload.copy.base import Direction

CHUNKS = np.array([9, 3, 4, 5, 17, 0, 11, 20], np.int64)  # 15 blocks from sub-block 1 (bpc 2): 8 chunks


def store_then_load(core, kv: list[torch.Tensor], rng: np.random.Generator, blocks: int = 15) -> None:
    nblocks = kv[0].shape[0]
    ids = rng.choice(nblocks, blocks, replace=False).astype(np.int64)
    original = [t.clone() for t in kv]
    core.submit(1, Direction.D2H, ids, [blocks], [1], CHUNKS)
    core.wait([1])
    assert [(r.success, r.error) for r in core.poll()] == [(True, None)]
    host_ids = core._host_blocks(CHUNKS, 1, blocks)
    for i, t in enumerate(original):
        assert torch.equal(core.host_view(i)[host_ids], t[ids])
    for t in kv:
        t.zero_()
    back = rng.permutation(nblocks)[:blocks].astype(np.int64)
    core.submit(2, Direction.H2D, back, [blocks], [1], CHUNKS)
    core.wait([2])
    assert [(r.success, r.error) for r in core.poll()] == [(True, None)]
    for t, o in zip(kv, original):
        assert torch.equal(t[back], o[ids])
