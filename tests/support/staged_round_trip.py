"""The staged round trips the native-library tests run (ACL emulation, fake CUDA driver): store
random blocks (from sub-block 1 of their host chunks: a partial first chunk), check the host
records byte for byte, zero the device KV, load them into other blocks and compare. One KV group
(``store_then_load``) or several (``store_then_load_groups``)."""

from __future__ import annotations

import numpy as np
import torch

from vllm_npu_offload.copy.base import Direction

CHUNKS = np.array([9, 3, 4, 5, 17, 0, 11, 20], np.int64)  # 15 blocks from sub-block 1 (bpc 2): 8 chunks


def settle(core, jobs) -> None:
    """Wait for ``jobs``; each is reported exactly once, and succeeded."""
    core.wait(jobs)
    res = {r.job_id: r for r in core.poll()}
    assert sorted(res) == sorted(jobs) and all(r.success for r in res.values()), res


def store_then_load(core, kv: list[torch.Tensor], rng: np.random.Generator, blocks: int = 15) -> None:
    nblocks = kv[0].shape[0]
    ids = rng.choice(nblocks, blocks, replace=False).astype(np.int64)
    original = [t.clone() for t in kv]
    core.submit(1, Direction.D2H, ids, [blocks], [1], CHUNKS)
    settle(core, [1])
    host_ids = core._host_blocks(CHUNKS, 1, blocks)
    for i, t in enumerate(original):
        assert torch.equal(core.host_view(i)[host_ids], t[ids])
    for t in kv:
        t.zero_()
    back = rng.permutation(nblocks)[:blocks].astype(np.int64)
    core.submit(2, Direction.H2D, back, [blocks], [1], CHUNKS)
    settle(core, [2])
    for t, o in zip(kv, original):
        assert torch.equal(t[back], o[ids])


def store_then_load_groups(core, kv: list[torch.Tensor], refs, rng: np.random.Generator, sizes: list[int],
                           skip: int = 1, jobs: tuple[int, int] = (1, 2)) -> list:
    """As ``store_then_load`` for ``len(refs)`` KV groups at once: group g stores ``sizes[g]``
    blocks of its own tensors (``refs[g]``: GroupRefs) from sub-block ``skip`` of fresh chunks.
    Returns the store's ``(group, device ids, host ids)`` parts."""
    bpc, nblocks = core.blocks_per_chunk, kv[0].shape[0]
    n_chunks = [-(-(n + skip) // bpc) for n in sizes]
    chunks = rng.choice(core.num_chunks, sum(n_chunks), replace=False).astype(np.int64)
    ids = rng.choice(nblocks, sum(sizes), replace=False).astype(np.int64)
    original = [t.clone() for t in kv]
    core.submit(jobs[0], Direction.D2H, ids, sizes, [skip] * len(sizes), chunks)
    settle(core, [jobs[0]])
    parts = core.split_groups(ids, sizes, [skip] * len(sizes), chunks)
    for g, dev, host in parts:
        for ref in refs[g]:
            view = core.host_view(ref.tensor_idx)[host][:, : ref.page_bytes]
            assert torch.equal(view, original[ref.tensor_idx][dev][:, : ref.page_bytes]), (g, ref)
    for t in kv:
        t.zero_()
    back = rng.permutation(nblocks)[: sum(sizes)].astype(np.int64)
    core.submit(jobs[1], Direction.H2D, back, sizes, [skip] * len(sizes), chunks)
    settle(core, [jobs[1]])
    at = 0
    for g, n in enumerate(sizes):
        for ref in refs[g]:
            got = kv[ref.tensor_idx][back[at:at + n]][:, : ref.page_bytes]
            assert torch.equal(got, original[ref.tensor_idx][ids[at:at + n]][:, : ref.page_bytes]), (g, ref)
        at += n
    return parts
