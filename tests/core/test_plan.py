"""Planner: byte-exact round trips over random block ids, merging, errors."""

import numpy as np
import pytest
import torch

from vllm_npu_offload.copy.host import memmove_batch
from vllm_npu_offload.plan import BlockLayout, CopyPlanner, DescriptorPool, TensorPair
from vllm_npu_offload.platform import get_platform

POISON = 0xAB


def make_side(num_tensors, num_blocks, stride, rng, fill=None):
    ts = []
    for _ in range(num_tensors):
        t = torch.from_numpy(rng.integers(0, 256, (num_blocks, stride), dtype=np.uint8)) if fill is None else \
            torch.full((num_blocks, stride), fill, dtype=torch.uint8)
        ts.append(t)
    return ts


def pairs_for(src, dst, page):
    return [
        TensorPair(BlockLayout(s.data_ptr(), s.stride(0), s.shape[0]), BlockLayout(d.data_ptr(), d.stride(0), d.shape[0]), page)
        for s, d in zip(src, dst)
    ]


def execute(planner, src_ids, dst_ids):
    d = planner.plan(src_ids, dst_ids)
    memmove_batch(d.src.tolist(), d.dst.tolist(), d.sizes.tolist())
    return d


@pytest.mark.parametrize("page", [1, 7, 13, 100, 4097, 32768])
@pytest.mark.parametrize("padding", [0, 5])
@pytest.mark.parametrize("contiguous_ids", [False, True])
def test_round_trip_random_ids(page, padding, contiguous_ids):
    rng = np.random.default_rng(page * 31 + padding)
    stride = page + padding
    n_src, n_dst, n = 40, 57, 25
    src = make_side(3, n_src, stride, rng)
    dst = make_side(3, n_dst, stride, rng, fill=POISON)
    if contiguous_ids:
        src_ids = np.arange(5, 5 + n)
        dst_ids = np.concatenate([np.arange(30, 40), np.arange(2, 17)])
    else:
        src_ids = rng.choice(n_src, n, replace=False)
        dst_ids = rng.choice(n_dst, n, replace=False)
    planner = CopyPlanner(pairs_for(src, dst, page))
    d = execute(planner, src_ids, dst_ids)
    assert d.total_bytes == 3 * n * page
    untouched = np.setdiff1d(np.arange(n_dst), dst_ids)
    for s, t in zip(src, dst):
        assert torch.equal(t[dst_ids][:, :page], s[src_ids][:, :page])
        assert (t[untouched] == POISON).all(), "a block outside the transfer was written"
        if padding:
            assert (t[dst_ids][:, page:] == POISON).all() or contiguous_ids  # merged runs may carry padding
    if contiguous_ids:
        assert len(d) == 3 * 2, "two runs per tensor should merge into two descriptors"


def test_merging_respects_stride_mismatch():
    rng = np.random.default_rng(0)
    src = make_side(2, 16, 64, rng)
    dst = make_side(2, 16, 80, rng, fill=0)  # different stride: cannot merge
    planner = CopyPlanner(pairs_for(src, dst, 64))
    d = execute(planner, np.arange(8), np.arange(8))
    assert len(d) == 16 and (d.sizes == 64).all()
    for s, t in zip(src, dst):
        assert torch.equal(t[:8, :64], s[:8])


def test_mixed_mergeable_and_not():
    rng = np.random.default_rng(1)
    a_src, a_dst = make_side(1, 10, 32, rng), make_side(1, 10, 32, rng, fill=0)
    b_src, b_dst = make_side(1, 10, 48, rng), make_side(1, 10, 40, rng, fill=0)
    pairs = pairs_for(a_src, a_dst, 32) + pairs_for(b_src, b_dst, 40)
    planner = CopyPlanner(pairs)
    ids = np.array([1, 2, 3, 7])
    assert planner.count(ids, ids) == 2 + 4
    execute(planner, ids, ids)
    assert torch.equal(a_dst[0][ids], a_src[0][ids])
    assert torch.equal(b_dst[0][ids][:, :40], b_src[0][ids][:, :40])


def test_bad_input_errors():
    rng = np.random.default_rng(2)
    src, dst = make_side(1, 4, 16, rng), make_side(1, 4, 16, rng)
    planner = CopyPlanner(pairs_for(src, dst, 16))
    with pytest.raises(ValueError, match=r"src block id 4 out of range \[0, 4\)"):
        planner.plan([4], [0])
    with pytest.raises(ValueError, match=r"dst block id -1"):
        planner.plan([0], [-1])
    with pytest.raises(ValueError, match="equal length"):
        planner.plan([0, 1], [0])
    with pytest.raises(ValueError, match="page_bytes must be > 0"):
        TensorPair(BlockLayout(1, 16, 4), BlockLayout(2, 16, 4), 0)
    with pytest.raises(ValueError, match="smaller than page_bytes"):
        TensorPair(BlockLayout(1, 8, 4), BlockLayout(2, 16, 4), 16)
    with pytest.raises(ValueError, match="at least one tensor pair"):
        CopyPlanner([])
    assert len(planner.plan([], [])) == 0


def test_pool_reuses_buffers_only_after_release():
    pool = DescriptorPool(get_platform("cpu"), min_capacity=8)
    a = pool.acquire(10)
    b = pool.acquire(10)
    assert a is not b and a.capacity >= 10
    pool.release([a])
    assert pool.acquire(5) is a
    big = pool.acquire(10_000)
    assert big.capacity >= 10_000
