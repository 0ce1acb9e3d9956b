"""The engine-step fast paths (issue #22) equal straightforward references on random inputs: staged
plans (block-major page descriptors, one contiguous range per slice; link runs), the memoised
slice layouts, block-major planning, the once-per-transfer device-id check, and the helpers."""

from __future__ import annotations

import bisect
import ctypes

import numpy as np
import pytest
import torch

from vllm_npu_offload import staging
from vllm_npu_offload.copy.base import DescriptorRange, Direction, SliceRanges, as_direction
from vllm_npu_offload.device_kv import DeviceKVTensor, GroupRef
from vllm_npu_offload.offload_worker import OffloadWorkerCore
from vllm_npu_offload.plan import BlockLayout, CopyPlanner, DescriptorPool, TensorPair, address, max_unsigned
from vllm_npu_offload.platform import CpuPlatform

DEV_BLOCKS, CHUNKS = 64, 48


@pytest.fixture(autouse=True)
def staged_on_cpu(monkeypatch):
    monkeypatch.setenv("NPU_OFFLOAD_STAGED", "1")
    monkeypatch.setattr(staging, "MIN_SLOT_BYTES", 0)  # small slots: many slices
    monkeypatch.setattr(staging, "MIN_SLICE_BYTES", 0)


def random_core(rng, groups: int, bpc: int, limits_differ: bool = False):
    """Random pages and padding over ``groups`` KV groups, tensors interleaved (partial spans) or
    in runs of layers; with ``limits_differ`` the last tensor has fewer blocks."""
    n_t = int(rng.integers(groups, groups + 5))
    pages = [int(rng.choice([64, 1000, 2048, 4096])) for _ in range(n_t)]
    rows = [DEV_BLOCKS - 8 * (limits_differ and i == n_t - 1) for i in range(n_t)]
    kv = [torch.empty(r, p + int(rng.choice([0, 64])), dtype=torch.uint8) for r, p in zip(rows, pages)]
    dev = [DeviceKVTensor.from_block_view(t, page_bytes=p) for t, p in zip(kv, pages)]
    order = list(range(n_t)) if rng.integers(0, 2) else [int(i) for i in rng.permutation(n_t)]
    refs = [[GroupRef(i, pages[i]) for i in order[g::groups]] for g in range(groups)]
    record = sum(-(-p // 64) * 64 for p in pages)
    return OffloadWorkerCore(dev, refs, bpc, CHUNKS, CpuPlatform(),
                             staging_bytes=2 * int(rng.integers(1, 4)) * bpc * record)


def random_transfer(rng, core):
    bpc, g = core.blocks_per_chunk, core.num_groups
    sizes = [int(rng.integers(0 if g > 1 else 1, 20)) for _ in range(g)]
    skips = [int(rng.integers(0, bpc)) for _ in range(g)]
    n_chunks = sum(-(-(s + k) // bpc) for s, k in zip(sizes, skips) if s)
    chunks = (rng.choice(CHUNKS, n_chunks, replace=False) if rng.integers(0, 2)
              else np.arange(n_chunks) + int(rng.integers(0, CHUNKS - n_chunks + 1))).astype(np.int64)
    dev = np.concatenate([rng.choice(DEV_BLOCKS - 8, s, replace=False) for s in sizes]).astype(np.int64)
    return dev, sizes, skips, chunks


def reference_positions(stager, n, direction):
    """(slice edges, staging record of each block), from ``slice_sizes`` alone."""
    g = stager.geometry
    edges = [0, *np.cumsum(stager.slice_sizes(n, direction)).tolist()]
    pos = [(s % g.slots) * g.slot_blocks + b - edges[s] for s in range(len(edges) - 1)
           for b in range(edges[s], edges[s + 1])]
    return edges, pos


def reference_plan(core, direction, parts):
    """Page descriptors (group by group, block by block in ascending host order, pair by pair), each
    slice's first, and the link runs, one block at a time in plain Python."""
    stager, rec = core.stager, core.layout.record_bytes
    by_host = [(g, *zip(*sorted(zip(dev.tolist(), host.tolist()), key=lambda pair: pair[1])))
               for g, dev, host in parts]
    groups = [(g, dev, host) for g, dev, host in by_host if core._staged[(g, direction)] is not None]
    n = sum(len(dev) for _, dev, _ in groups)
    edges, pos = reference_positions(stager, n, direction)
    local, first_of_block, runs, b = [], [], [], 0
    for g, dev, host in groups:
        planner, (lo, hi) = core._staged[(g, direction)], core._spans[g]
        partial = (lo, hi) != (0, core.layout.pages_end) and lo != hi  # both directions: one copy per block
        for j in range(len(dev)):
            first_of_block.append(len(local))
            for p in planner.pairs:
                s_id, d_id = (dev[j], pos[b]) if direction is Direction.D2H else (pos[b], dev[j])
                local.append((p.src.base + s_id * p.src.block_stride, p.dst.base + d_id * p.dst.block_stride,
                              p.page_bytes))
            joins = runs and not partial and j > 0 and b not in edges and host[j] == host[j - 1] + 1
            if joins:
                runs[-1][1] += 1
            else:
                runs.append([b, 1, int(host[j]), lo, hi])
            b += 1
    first_of_block.append(len(local))
    link = []
    for b0, count, h0, lo, hi in runs:
        stg, hst = stager.base[direction] + pos[b0] * rec + lo, stager.host_base + h0 * rec + lo
        link.append((*((stg, hst) if direction is Direction.D2H else (hst, stg)), (count - 1) * rec + hi - lo))
    starts = [r[0] for r in runs]
    return local, [first_of_block[e] for e in edges], link, [bisect.bisect_left(starts, e) for e in edges]


def triples(d):
    return list(zip(d.src.tolist(), d.dst.tolist(), d.sizes.tolist()))


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("groups", [1, 2, 3])
def test_staged_plan_equals_the_reference(seed, groups):
    rng = np.random.default_rng(100 * groups + seed)
    core = random_core(rng, groups, bpc=int(rng.choice([1, 2, 4])))
    for direction in Direction:
        for _ in range(3):
            dev, sizes, skips, chunks = random_transfer(rng, core)
            if not sum(sizes):
                continue
            plan = core.plan(direction, dev, sizes, skips, chunks, staged=True).plan
            local, bounds, link, link_bounds = reference_plan(core, direction, core.split_groups(dev, sizes, skips,
                                                                                                  chunks))
            assert triples(plan.local) == local
            assert isinstance(plan.local_ranges, SliceRanges)
            assert [r for s in plan.local_ranges for r in s] == [
                DescriptorRange(a, b - a) for a, b in zip(bounds, bounds[1:])]
            assert triples(plan.link) == link and plan.link_bounds.tolist() == link_bounds
            assert plan.link.total_bytes == sum(s for _, _, s in link)
            core.pool.release(plan.buffers)
    core.shutdown()


def test_slice_layout_memo_equals_the_uncached_layout():
    rng = np.random.default_rng(5)
    core = random_core(rng, 1, 2)
    stager = core.stager
    for n in [*rng.integers(1, 400, 40).tolist(), 1, 2, 399]:
        for direction in Direction:
            lay = stager.slice_layout(n, direction)
            assert stager.slice_layout(n, int(direction)) is lay  # memoised, also for the enum's value
            fresh = stager._slice_layout(n, direction)
            edges, pos = reference_positions(stager, n, direction)
            assert lay.edges == fresh.edges == tuple(edges) and lay.n == n
            assert lay.pos.tolist() == fresh.pos.tolist() == pos
            assert lay.edge_array.tolist() == edges
            assert np.flatnonzero(lay.first_of_slice).tolist() == edges[:-1]
            assert lay.staging_addr.tolist() == [stager.base[direction] + p * core.layout.record_bytes for p in pos]
            for a in (lay.edge_array, lay.first_of_slice, lay.pos, lay.staging_addr):
                assert not a.flags.writeable  # shared by every transfer of that size
    for n in range(1000, 1000 + staging.SLICE_LAYOUTS + 8):
        stager.slice_layout(n, Direction.H2D)
    assert stager.slice_layout.cache_info().currsize == staging.SLICE_LAYOUTS
    core.shutdown()


@pytest.mark.parametrize("uniform", [True, False])
def test_plan_blocks_into_is_plan_into_transposed(uniform):
    rng = np.random.default_rng(int(uniform))
    m, k = 5, 17
    strides = [4096] * m if uniform else rng.choice([4096, 8192], m).tolist()
    pairs = [TensorPair(BlockLayout(1 << 30 + 0, s, 64), BlockLayout((i + 1) << 24, 9000, 50), 4000 - i)
             for i, s in enumerate(strides)]
    planner = CopyPlanner(pairs, merge=False)
    src, dst = rng.choice(64, k, replace=False), rng.choice(50, k, replace=False)
    by_tensor, by_block = [np.empty(m * k, np.int64) for _ in range(3)], [np.empty(m * k, np.int64) for _ in range(3)]
    assert planner.plan_into(src, dst, *by_tensor) == planner.plan_blocks_into(src, dst, *by_block) == (
        m * k, k * sum(p.page_bytes for p in pairs))
    for t, b in zip(by_tensor, by_block):
        assert np.array_equal(t.reshape(m, k).T, b.reshape(k, m))
    with pytest.raises(ValueError, match=r"src block id 64 out of range \[0, 64\)"):
        planner.plan_blocks_into([64], [0], *by_block)
    unchecked = CopyPlanner(pairs, merge=False, check=())
    assert unchecked.plan_blocks_into([64], [0], *by_block)[0] == m  # its caller checks
    with pytest.raises(ValueError, match="check names sides"):
        CopyPlanner(pairs, check=("host",))


@pytest.mark.parametrize("staged", [True, False])
@pytest.mark.parametrize("limits_differ", [False, True])
def test_device_ids_are_checked_once_per_transfer(staged, limits_differ):
    rng = np.random.default_rng(3)
    core = random_core(rng, 2, 2, limits_differ=limits_differ)
    assert all(not any(p._check) for p in [*core._direct.values(), *core._staged.values()] if p is not None)
    assert (core._device_limit is None) == limits_differ
    free = core.pool.num_free
    small = min(core._group_limits)
    for direction, side in ((Direction.D2H, "src"), (Direction.H2D, "dst")):
        for bad in (-1, DEV_BLOCKS):
            with pytest.raises(ValueError, match=f"{side} block id {bad} out of range"):
                core.plan(direction, [0, 1, bad], [2, 1], [0, 0], [0, 1], staged=staged)
        if limits_differ:  # a block id that only the group holding the shorter tensor cannot take
            short = [g for g, refs in enumerate(core.group_refs)
                     if any(r.tensor_idx == len(core.device_tensors) - 1 for r in refs)]
            for g in range(2):
                sizes = [int(h == g) for h in range(2)]
                if g in short:
                    with pytest.raises(ValueError, match=f"{side} block id {small} out of range \\[0, {small}\\)"):
                        core.plan(direction, [small], sizes, [0, 0], [0], staged=staged)
                else:
                    core.pool.release(core.plan(direction, [small], sizes, [0, 0], [0], staged=staged).buffers)
    assert core.pool.num_free >= free
    core.shutdown()


def test_max_unsigned_address_and_direction():
    rng = np.random.default_rng(0)
    for n in (1, 5, 32, 33, 300):
        ids = rng.integers(0, 1000, n)
        assert max_unsigned(ids) == int(ids.max())
        ids[n // 2] = -3  # negatives count as huge: one comparison with the limit catches them
        assert max_unsigned(ids) == 2**64 - 3
    a = np.arange(12, dtype=np.int64)
    for arr in (a, a[3:], a[::2], a.reshape(3, 4).T, np.empty(0, np.int64)):
        assert address(arr) == arr.ctypes.data
    a.flags.writeable = False
    assert address(a) == a.ctypes.data and ctypes.sizeof(ctypes.c_char) == 1
    assert as_direction(1) is Direction.D2H and as_direction(Direction.H2D) is Direction.H2D


def test_slice_ranges_and_pool_order():
    ranges = SliceRanges(np.array([0, 3, 3, 10]))
    assert len(ranges) == 3 and list(ranges) == [[DescriptorRange(0, 3)], [DescriptorRange(3, 0)],
                                                 [DescriptorRange(3, 7)]]
    assert ranges[-1] == [DescriptorRange(3, 7)]
    with pytest.raises(IndexError):
        ranges[3]
    pool = DescriptorPool(CpuPlatform(), min_capacity=8)
    sets = [pool.acquire(n) for n in (100, 8, 30, 8, 100)]
    pool.release([sets[4], sets[1]])
    pool.release([sets[0], sets[2], sets[3]])
    # kept by capacity; of equal capacities the last to come back first (a set in use stays in use)
    assert pool._free == [sets[3], sets[1], sets[2], sets[0], sets[4]]
    assert pool.acquire(20) is sets[2]
    assert pool.acquire(8) is sets[3]
    pool.release([sets[3]])
    assert pool.acquire(8) is sets[3]  # the same set again, not the older sets[1]
