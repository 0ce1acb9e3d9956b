"""Staged transfers (gather on the device, few large host copies) are byte-exact.

Run on the CPU platform with ``NPU_OFFLOAD_STAGED=1`` (staging is normally off on CPU,
where it would only add a memmove): the planner, the slice pipeline and the block-first
host layout are the same code as on CUDA/NPU; only the copy paths differ.
"""

import time

import numpy as np
import pytest
import torch

from staged_round_trip import settle

from vllm_npu_offload import staging, staging_choice
from vllm_npu_offload.copy.base import Direction
from vllm_npu_offload.errors import OffloadConfigError
from vllm_npu_offload.device_kv import DeviceKVTensor, GroupRef
from vllm_npu_offload.offload_worker import OffloadWorkerCore
from vllm_npu_offload.platform import CpuPlatform

DEV_BLOCKS, CHUNKS = 48, 40


@pytest.fixture(autouse=True)
def staged_on_cpu(monkeypatch):
    monkeypatch.setenv("NPU_OFFLOAD_STAGED", "1")
    monkeypatch.setattr(staging, "MIN_SLOT_BYTES", 0)  # small slots: many slices, slot reuse
    monkeypatch.setattr(staging, "MIN_SLICE_BYTES", 0)


def _platform(device):
    if device == "cpu":
        return None
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from vllm_npu_offload.platform import get_platform

    return get_platform("cuda")


def random_core(seed, bpc, staging_chunks, threaded=False, groups=1, device="cpu"):
    """Random pages (odd sizes, padded strides, unequal K/V-like parts) of random bytes."""
    platform = _platform(device) or CpuPlatform(threaded_streams=threaded)
    rng = np.random.default_rng(seed)
    n_t = int(rng.integers(1, 6))
    pages = [int(rng.choice([16, 24, 1000, 1024, 2304, 4096])) for _ in range(n_t)]
    pads = [int(rng.choice([0, 0, 16, 48])) for _ in range(n_t)]
    tensors = [torch.from_numpy(rng.integers(0, 256, (DEV_BLOCKS, p + pad), dtype=np.uint8)).to(device)
               for p, pad in zip(pages, pads)]
    dev = [DeviceKVTensor.from_block_view(t, page_bytes=p) for t, p in zip(tensors, pages)]
    if groups == 1:
        refs = [[GroupRef(i, pages[i] - int(rng.integers(0, 2)) * 8) for i in range(n_t)]]
    else:  # round-robin tensors over groups; a group may share none
        refs = [[GroupRef(i, pages[i]) for i in range(n_t) if i % groups == g] for g in range(groups)]
    record = sum(-(-p // 64) * 64 for p in pages)
    core = OffloadWorkerCore(dev, refs, bpc, CHUNKS, platform,
                             staging_bytes=2 * staging_chunks * bpc * record + 32)
    return core, tensors, refs, rng


def chunks_for(rng, n_blocks, skip, bpc):
    return rng.choice(CHUNKS, -(-(n_blocks + skip) // bpc), replace=False).astype(np.int64)


def expected_host(core, refs, tensors, dev_ids, host_ids):
    return {(ref.tensor_idx, int(h)): tensors[ref.tensor_idx][d, : ref.page_bytes].clone()
            for group in refs for ref in group for d, h in zip(dev_ids, host_ids)}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("bpc", [1, 2, 3, 8])
def test_staged_store_direct_load_and_back(seed, bpc, device):
    core, tensors, refs, rng = random_core(seed, bpc, staging_chunks=int(1 + seed % 3), device=device)
    assert core.stager is not None and core.stager.geometry.slots >= 1
    n = int(rng.integers(1, 33))
    skip = int(rng.integers(0, bpc))  # partial first chunk
    dev_ids = rng.choice(DEV_BLOCKS, n, replace=False).astype(np.int64)
    chunks = chunks_for(rng, n, skip, bpc)
    host_ids = core._host_blocks(chunks, skip, n)
    want = expected_host(core, refs, tensors, dev_ids, host_ids)
    core.submit(1, Direction.D2H, dev_ids, [n], [skip], chunks, staged=True)
    settle(core, [1])
    for (t, h), page in want.items():
        assert torch.equal(core.host_view(t)[h][: len(page)], page.cpu()), (t, h)
    # Load back staged into other blocks, and direct into a third set: both equal the originals.
    for job, staged in ((2, True), (3, False)):
        back = rng.choice(DEV_BLOCKS, n, replace=False).astype(np.int64)
        for t in tensors:
            t[back] = 0xAB
        core.submit(job, Direction.H2D, back, [n], [skip], chunks, staged=staged)
        settle(core, [job])
        for group in refs:
            for ref in group:
                t = tensors[ref.tensor_idx]
                got = t[back][:, : ref.page_bytes]
                exp = torch.stack([want[(ref.tensor_idx, int(h))] for h in host_ids])
                assert torch.equal(got, exp), (job, ref)
    core.shutdown()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("groups", [2, 3])
def test_staged_groups_write_only_their_tensors(groups, device):
    core, tensors, refs, rng = random_core(7, 2, staging_chunks=2, groups=groups, device=device)
    sizes = [int(rng.integers(0, 9)) for _ in refs]
    dev_ids = rng.choice(DEV_BLOCKS, sum(sizes), replace=False).astype(np.int64)
    skips = [int(rng.integers(0, 2)) for _ in refs]
    n_chunks = sum(-(-(s + k) // 2) for s, k in zip(sizes, skips) if s)
    chunks = rng.choice(CHUNKS, n_chunks, replace=False).astype(np.int64)
    core.submit(1, Direction.D2H, dev_ids, sizes, skips, chunks, staged=True)
    settle(core, [1])
    originals = [t.clone() for t in tensors]
    for t in tensors:
        t.zero_()
    core.submit(2, Direction.H2D, dev_ids, sizes, skips, chunks, staged=True)
    settle(core, [2])
    off = 0
    for g, (size, group) in enumerate(zip(sizes, refs)):
        ids = dev_ids[off:off + size]
        off += size
        for ref in group:
            assert torch.equal(tensors[ref.tensor_idx][ids][:, : ref.page_bytes],
                               originals[ref.tensor_idx][ids][:, : ref.page_bytes]), (g, ref)
    # A group's load writes only its own tensors: other groups' blocks stay zero there.
    bounds = np.cumsum([0] + sizes)
    for g, group in enumerate(refs):
        others = np.concatenate([dev_ids[bounds[h]:bounds[h + 1]] for h in range(len(refs)) if h != g])
        for ref in group:
            assert (tensors[ref.tensor_idx][others] == 0).all(), (g, ref)
    core.shutdown()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("only_one", [False, True])
def test_groups_sharing_chunks_store_only_their_pages(device, only_one):
    """Groups whose blocks share host chunks (layer groups of one model for layer-wise loads; vLLM
    0.23's own groups use per-group offload keys and so separate chunks). Interleaved tensors as in
    Gemma-2. A staged store used to copy a run of consecutive records whole, writing the other
    group's pages of the records in between with stale staging bytes. Now records are group-major
    and a partial-span group's store copies block by block: a store of one group (or of both)
    leaves the other's host pages intact."""
    platform = _platform(device) or CpuPlatform()
    rng = np.random.default_rng(17)
    pages, bpc, n = [2048] * 8, 4, 8
    tensors = [torch.from_numpy(rng.integers(0, 256, (DEV_BLOCKS, p), dtype=np.uint8)).to(platform.device)
               for p in pages]
    refs = [[GroupRef(i, pages[i]) for i in range(g, len(pages), 2)] for g in range(2)]  # interleaved layers
    core = OffloadWorkerCore([DeviceKVTensor.from_block_view(t) for t in tensors], refs, bpc, CHUNKS, platform,
                             staging_bytes=2 * 3 * bpc * sum(pages))
    assert [core.layout.group_span([r.tensor_idx for r in g]) for g in refs] == [(0, 4 * 2048), (4 * 2048, 8 * 2048)]
    chunks = rng.choice(CHUNKS, n // bpc, replace=False).astype(np.int64)
    ids = [rng.choice(DEV_BLOCKS, n, replace=False).astype(np.int64) for _ in refs]
    core.submit(1, Direction.D2H, np.concatenate(ids), [n, n], [0, 0], np.tile(chunks, 2), staged=True)
    settle(core, [1])
    host_ids = core._host_blocks(chunks, 0, n)
    first = {t: core.host_view(t)[host_ids].clone() for t in range(len(pages))}
    for g, group in enumerate(refs):
        for r in group:
            assert torch.equal(first[r.tensor_idx][:, : r.page_bytes].cpu(), tensors[r.tensor_idx][ids[g]].cpu()), r
    # store group 1 again from other device blocks (or both groups): group 0's host pages must not change
    new1 = rng.choice(DEV_BLOCKS, n, replace=False).astype(np.int64)
    sizes, dev = ([0, n], new1) if only_one else ([n, n], np.concatenate([ids[0], new1]))
    core.submit(2, Direction.D2H, dev, sizes, [0, 0], chunks if only_one else np.tile(chunks, 2), staged=True)
    settle(core, [2])
    for r in refs[0]:
        assert torch.equal(core.host_view(r.tensor_idx)[host_ids], first[r.tensor_idx]), r
    for r in refs[1]:
        assert torch.equal(core.host_view(r.tensor_idx)[host_ids][:, : r.page_bytes].cpu(),
                           tensors[r.tensor_idx][new1].cpu()), r
    core.shutdown()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_pipeline_reuses_slots_across_many_slices(device):
    """Byte-exact through more slices than slots."""
    core, tensors, refs, rng = random_core(5, 1, staging_chunks=3, device=device)
    g = core.stager.geometry
    assert g.slots == 3 and g.slot_blocks == 1
    dev_ids = rng.choice(DEV_BLOCKS, 20, replace=False).astype(np.int64)
    chunks = rng.choice(CHUNKS, 20, replace=False).astype(np.int64)
    plan = core._staged_plan(Direction.D2H, core.split_groups(dev_ids, [20], [0], chunks))  # the Python planner
    assert plan.num_slices == 20 and len(plan.link) == 20  # slot-sized slices: 1 block each
    core.pool.release(plan.buffers)
    original = [t.clone() for t in tensors]
    core.submit(1, Direction.D2H, dev_ids, [20], [0], chunks, staged=True)
    settle(core, [1])
    for t in tensors:
        t.zero_()
    core.submit(2, Direction.H2D, dev_ids, [20], [0], chunks, staged=True)
    settle(core, [2])
    for ref in refs[0]:
        i, p = ref.tensor_idx, ref.page_bytes
        assert torch.equal(tensors[i][dev_ids][:, :p], original[i][dev_ids][:, :p])
    core.shutdown()


def test_many_staged_jobs_in_flight_threaded():
    core, tensors, refs, rng = random_core(11, 4, staging_chunks=1, threaded=True)
    originals = [t.clone() for t in tensors]
    jobs, plans = [], []
    free_chunks = list(rng.permutation(CHUNKS))
    for j in range(8):  # stores of disjoint chunks, all in flight at once
        n = int(rng.integers(1, 9))
        dev_ids = rng.choice(DEV_BLOCKS, n, replace=False).astype(np.int64)
        chunks = np.array([free_chunks.pop() for _ in range(-(-n // 4))], np.int64)
        core.submit(100 + j, Direction.D2H, dev_ids, [n], [0], chunks, staged=bool(j % 2))
        jobs.append(100 + j)
        plans.append((dev_ids, chunks))
    settle(core, jobs)
    for t in tensors:
        t.zero_()
    jobs = []
    for j, (dev_ids, chunks) in enumerate(plans):
        core.submit(200 + j, Direction.H2D, dev_ids, [len(dev_ids)], [0], chunks, staged=not j % 2)
        jobs.append(200 + j)
    settle(core, jobs)
    for group in refs:
        for ref in group:
            for dev_ids, _ in plans:
                assert torch.equal(tensors[ref.tensor_idx][dev_ids][:, : ref.page_bytes],
                                   originals[ref.tensor_idx][dev_ids][:, : ref.page_bytes])
    core.shutdown()


def test_link_copies_are_few_and_merged(monkeypatch):
    """Adjacent chunks become one host copy; the gather has one descriptor per page."""
    monkeypatch.setattr(staging, "MIN_SLICE_BYTES", 1 << 40)  # one slice
    core, tensors, refs, rng = random_core(3, 2, staging_chunks=16)
    plan = core.plan(Direction.D2H, np.arange(8), [8], [0], np.array([5, 6, 7, 20]), staged=True).plan
    n_pages = 8 * len(refs[0])
    assert len(plan.local) == n_pages
    assert plan.num_slices == 1 and len(plan.link) == 2  # chunks 5-7 merge, chunk 20 alone
    assert plan.link.sizes.tolist() == [6 * core.layout.record_bytes, 2 * core.layout.record_bytes]
    core.pool.release(plan.buffers)
    core.shutdown()


@pytest.mark.parametrize("direction", [Direction.D2H, Direction.H2D])
def test_host_blocks_in_reverse_still_make_one_link_copy(monkeypatch, direction):
    """vLLM's CPU manager hands reused chunks out last-freed first (descending ids): the plan
    sorts the pairs by host block, so a reversed or shuffled run is still one link copy."""
    monkeypatch.setattr(staging, "MIN_SLICE_BYTES", 1 << 40)  # one slice
    core, tensors, refs, rng = random_core(3, 2, staging_chunks=16)
    rec = core.layout.record_bytes
    for chunks, sizes in (([7, 6, 5, 4], [8]), ([5, 7, 4, 6], [8]), ([9, 8, 3, 2], [4, 4])):
        plan = core.plan(direction, np.arange(8), [8], [0], np.array(chunks), staged=True).plan
        assert plan.link.sizes.tolist() == [n * rec for n in sizes], chunks
        core.pool.release(plan.buffers)
    core.shutdown()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("staged", [True, False])
@pytest.mark.parametrize("bpc", [1, 3])
def test_reversed_host_chunks_round_trip_byte_exact(device, staged, bpc):
    """Descending chunks (vLLM's reuse order), stored from some device blocks and loaded into others:
    every page lands in its own host block and comes back to the block it was asked for (shuffled
    chunks: the random round trips above)."""
    core, tensors, refs, rng = random_core(11, bpc, staging_chunks=4, device=device)
    n, skip = 13, 1 if bpc > 1 else 0
    dev_ids = rng.choice(DEV_BLOCKS, n, replace=False).astype(np.int64)
    k = -(-(n + skip) // bpc)
    chunks = np.arange(20, 20 + k, dtype=np.int64)[::-1].copy()
    host_ids = core._host_blocks(chunks, skip, n)
    want = expected_host(core, refs, tensors, dev_ids, host_ids)
    core.submit(1, Direction.D2H, dev_ids, [n], [skip], chunks, staged=staged)
    settle(core, [1])
    for (t_idx, h), page in want.items():
        assert torch.equal(core.host_view(t_idx)[h, : page.shape[0]], page.cpu()), (t_idx, h)
    originals = [t.clone() for t in tensors]
    for t in tensors:
        t.zero_()
    back = rng.permutation(DEV_BLOCKS)[:n].astype(np.int64)
    core.submit(2, Direction.H2D, back, [n], [skip], chunks, staged=staged)
    settle(core, [2])
    for group in refs:
        for ref in group:
            p = ref.page_bytes
            assert torch.equal(tensors[ref.tensor_idx][back][:, :p], originals[ref.tensor_idx][dev_ids][:, :p])
    core.shutdown()


def test_staging_smaller_than_a_chunk_names_the_key():
    tensors = [torch.zeros(8, 4096, dtype=torch.uint8)]
    dev = [DeviceKVTensor.from_block_view(t) for t in tensors]
    with pytest.raises(OffloadConfigError, match=r"'staging_bytes'.*less than one host chunk.*at least 32768"):
        OffloadWorkerCore(dev, [[GroupRef(0, 4096)]], 4, 4, CpuPlatform(), staging_bytes=16384)


def test_staged_mode_env_is_checked(monkeypatch):
    monkeypatch.setenv("NPU_OFFLOAD_STAGED", "yes")
    tensors = [torch.zeros(8, 64, dtype=torch.uint8)]
    with pytest.raises(ValueError, match="NPU_OFFLOAD_STAGED='yes'; allowed"):
        OffloadWorkerCore([DeviceKVTensor.from_block_view(tensors[0])], [[GroupRef(0, 64)]], 1, 4, CpuPlatform())


def test_cpu_default_is_direct(monkeypatch):
    monkeypatch.delenv("NPU_OFFLOAD_STAGED")
    tensors = [torch.zeros(8, 64, dtype=torch.uint8)]
    core = OffloadWorkerCore([DeviceKVTensor.from_block_view(tensors[0])], [[GroupRef(0, 64)]], 1, 4, CpuPlatform())
    assert core.stager is None and not core.uses_staging(Direction.D2H, 1000)
    with pytest.raises(ValueError, match="no staging"):
        core.submit(1, Direction.D2H, np.array([0]), [1], [0], np.array([0]), staged=True)
    core.shutdown()


def test_direct_stores_keep_loads_staged(monkeypatch):
    """NPU_OFFLOAD_STAGED_STORES=0: every store direct (no device gather beside the model),
    loads still staged; what a direct store wrote loads back staged, byte-exact."""
    monkeypatch.setenv("NPU_OFFLOAD_STAGED_STORES", "0")
    core, tensors, refs, rng = random_core(3, 2, staging_chunks=2)
    assert core.staged_min_blocks == {Direction.H2D: 1, Direction.D2H: staging_choice.NEVER}
    assert core.uses_staging(Direction.H2D, 8) and not core.uses_staging(Direction.D2H, 10_000)
    n = 16
    dev_ids = rng.choice(DEV_BLOCKS, n, replace=False).astype(np.int64)
    chunks = chunks_for(rng, n, 0, 2)
    want = expected_host(core, refs, tensors, dev_ids, core._host_blocks(chunks, 0, n))
    core.submit(1, Direction.D2H, dev_ids, [n], [0], chunks)
    settle(core, [1])
    back = rng.choice(DEV_BLOCKS, n, replace=False).astype(np.int64)
    for t in tensors:
        t[back] = 0xCD
    core.submit(2, Direction.H2D, back, [n], [0], chunks)
    settle(core, [2])
    for group in refs:
        for ref in group:
            exp = torch.stack([want[(ref.tensor_idx, int(h))] for h in core._host_blocks(chunks, 0, n)])
            assert torch.equal(tensors[ref.tensor_idx][back][:, : ref.page_bytes], exp)
    core.shutdown()


@pytest.mark.parametrize("kind,pages,staged_stores,staged,direct", [
    ("cuda", [32 << 10] * 64, None, None, True),  # vLLM-Ascend's per-layer 8B shape on CUDA: direct
    ("cuda", [64 << 10, 32 << 10], None, None, True),
    ("cuda", [32 << 10, 2 << 10], None, None, False),  # a small page: staged (per-page DMA is slow there)
    ("cuda", [16 << 10], None, None, False),
    ("cuda", [32 << 10], True, None, False),  # NPU_OFFLOAD_STAGED_STORES=1: staged from the measured size
    ("cuda", [32 << 10], None, True, False),  # NPU_OFFLOAD_STAGED=1: everything staged
    ("cuda", [2 << 10], False, None, True),  # NPU_OFFLOAD_STAGED_STORES=0: always direct
    ("npu", [32 << 10] * 64, None, None, False),  # Ascend keeps staged stores (measured on CUDA only)
    ("npu", [32 << 10], False, None, True),
    ("cuda", [], None, None, False),
])
def test_which_stores_go_direct(kind, pages, staged_stores, staged, direct):
    assert staging_choice.stores_direct(kind, pages, staged_stores, staged) is direct


@pytest.mark.gpu
@pytest.mark.parametrize("page,direct", [(32 << 10, True), (2 << 10, False)])
def test_cuda_default_stores_direct_from_32k_pages_byte_exact(page, direct, monkeypatch):
    """On CUDA with nothing set, a core of 32 KiB pages stores direct (no gather) and loads
    staged; one of 2 KiB pages keeps staged stores. A store then load is byte-exact either way."""
    platform = _platform("cuda")
    monkeypatch.delenv("NPU_OFFLOAD_STAGED")
    monkeypatch.setenv("NPU_OFFLOAD_CALIBRATE", "0")
    rng = np.random.default_rng(3)
    tensors = [torch.from_numpy(rng.integers(0, 256, (DEV_BLOCKS, page), dtype=np.uint8)).cuda() for _ in range(4)]
    refs = [[GroupRef(i, page) for i in range(4)]]
    core = OffloadWorkerCore([DeviceKVTensor.from_block_view(t) for t in tensors], refs, 2, CHUNKS, platform)
    assert core.stager is not None
    assert (core.staged_min_blocks[Direction.D2H] == staging_choice.NEVER) is direct
    n = 24
    dev_ids = rng.choice(DEV_BLOCKS, n, replace=False).astype(np.int64)
    chunks = chunks_for(rng, n, 0, 2)
    want = [t[dev_ids].clone() for t in tensors]
    core.submit(1, Direction.D2H, dev_ids, [n], [0], chunks)
    settle(core, [1])
    for t in tensors:
        t[dev_ids] = 0
    core.submit(2, Direction.H2D, dev_ids, [n], [0], chunks, staged=True)
    settle(core, [2])
    assert all(torch.equal(t[dev_ids], w) for t, w in zip(tensors, want))
    core.shutdown()


def _native_order_core(monkeypatch, n_tensors: int):
    """A CUDA worker core over ``n_tensors`` 4 KiB-page tensors whose staged transfers the library
    plans and orders; (core, tensors, refs, page, 12 blocks per transfer)."""
    platform = _platform("cuda")
    monkeypatch.setenv("NPU_OFFLOAD_STAGED", "1")
    monkeypatch.setenv("NPU_OFFLOAD_CALIBRATE", "0")
    page = 4096
    tensors = [torch.zeros((DEV_BLOCKS, page), dtype=torch.uint8, device="cuda") for _ in range(n_tensors)]
    refs = [[GroupRef(i, page) for i in range(n_tensors)]]
    core = OffloadWorkerCore([DeviceKVTensor.from_block_view(t) for t in tensors], refs, 1, CHUNKS, platform)
    assert core.stager.plans_natively and core.stager.orders_natively
    return core, tensors, refs, page, 12


def _stored_then_cleared(core, tensors, page: int, n: int, seed: int):
    """``n`` random blocks of random pages stored to host by job 1, then zeroed on the device:
    (device ids, host chunks, the pages a load must bring back)."""
    rng = np.random.default_rng(seed)
    dev_ids = rng.choice(DEV_BLOCKS, n, replace=False).astype(np.int64)
    chunks = chunks_for(rng, n, 0, 1)
    want = [torch.from_numpy(rng.integers(0, 256, (n, page), dtype=np.uint8)).cuda() for _ in tensors]
    for t, w in zip(tensors, want):
        t[dev_ids] = w
    core.submit(1, Direction.D2H, dev_ids, [n], [0], chunks, staged=True)
    settle(core, [1])
    for t in tensors:
        t.zero_()
    return dev_ids, chunks, want


@pytest.mark.gpu
def test_cuda_native_order_waits_for_the_model_stream(monkeypatch):
    """On CUDA a staged transfer takes the engine's stream order inside its one native call
    (compute-stream wait, the previous job's end, start/end events): a store reads what the model's
    still-busy stream writes just before the submit, and two loads back to back (on the ring, the
    second after the first's end) land byte-exact after what the busy stream writes into their blocks
    before the submit, each reported once with its bytes."""
    core, tensors, _, page, n = _native_order_core(monkeypatch, 6)
    rng = np.random.default_rng(8)
    dev_ids = rng.choice(DEV_BLOCKS, 2 * n, replace=False).astype(np.int64)
    chunks = chunks_for(rng, 2 * n, 0, 1)
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)  # the model's stream is busy; the writes below land after it
    want = [torch.from_numpy(rng.integers(0, 256, (2 * n, page), dtype=np.uint8)).cuda(non_blocking=True)
            for _ in tensors]
    for t, w in zip(tensors, want):
        t[dev_ids] = w
    core.submit(1, Direction.D2H, dev_ids, [2 * n], [0], chunks, staged=True)
    settle(core, [1])
    for i, w in enumerate(want):
        assert torch.equal(core.host_view(i)[chunks], w.cpu()), i
    torch.cuda._sleep(50_000_000)
    for t in tensors:  # the model's step in flight still writes the blocks the loads reuse: the
        t.fill_(0x5A)  # loads' scatters (not their link copies) wait for it, so they land last
    core.submit(2, Direction.H2D, dev_ids[:n], [n], [0], chunks[:n], staged=True)
    core.submit(3, Direction.H2D, dev_ids[n:], [n], [0], chunks[n:], staged=True)
    core.wait([2, 3])
    res = {r.job_id: r for r in core.poll()}
    assert [res[j].success for j in (2, 3)] == [True, True], res
    assert res[2].num_bytes == res[3].num_bytes == n * 6 * page
    assert all(torch.equal(t[dev_ids], w) for t, w in zip(tensors, want))
    core.shutdown()


@pytest.mark.gpu
def test_cuda_first_transfers_do_not_wait_for_the_model_stream(monkeypatch):
    """vLLM submits between steps while the step's kernels still run: a fresh worker's first store
    and first load return while the model's stream is busy (their pair tables were uploaded at the
    worker's start; uploaded at the first submit, that pageable copy waited out the step)."""
    core, tensors, _, page, n = _native_order_core(monkeypatch, 4)
    rng = np.random.default_rng(11)
    dev_ids, chunks = rng.choice(DEV_BLOCKS, n, replace=False).astype(np.int64), chunks_for(rng, n, 0, 1)
    busy = torch.cuda.current_stream()
    for job, direction in ((1, Direction.D2H), (2, Direction.H2D)):
        torch.cuda.synchronize()
        torch.cuda._sleep(1_000_000_000)
        core.submit(job, direction, dev_ids, [n], [0], chunks, staged=True)
        assert not busy.query(), f"the first {direction.name} waited for the model's stream"
        settle(core, [job])
    core.shutdown()


@pytest.mark.gpu
def test_cuda_poll_reports_a_load_behind_a_busy_stream_once_when_done(monkeypatch):
    """The engine's poll: a load behind a busy stream is not reported while it runs, then once,
    byte-exact, with the device time torch's events give for it."""
    core, tensors, _, page, n = _native_order_core(monkeypatch, 4)
    dev_ids, chunks, want = _stored_then_cleared(core, tensors, page, n, 10)
    torch.cuda.synchronize()
    busy = torch.cuda.current_stream()
    t0 = time.perf_counter()
    torch.cuda._sleep(1_000_000_000)  # the model's step (~0.5 s): the load's scatters wait for it
    core.submit(2, Direction.H2D, dev_ids, [n], [0], chunks, staged=True)
    item = core.engine._queues[Direction.H2D][0]
    seen = (f"{(time.perf_counter() - t0) * 1e3:.1f} ms after the sleep's launch: model stream done "
            f"{busy.query()}, torch end {item.end.query()}, torch start {item.start.query()}")
    assert core.poll() == [] and core.engine.in_flight() == 1, seen
    item.end.synchronize()
    (res,) = core.poll()
    assert res.job_id == 2 and res.success and res.num_bytes == n * len(tensors) * page, res
    assert res.seconds == pytest.approx(item.start.elapsed_time(item.end) * 1e-3, rel=1e-6), res
    assert res.seconds > 0 and core.poll() == []
    assert all(torch.equal(t[dev_ids], w) for t, w in zip(tensors, want))
    core.shutdown()


@pytest.mark.gpu
def test_cuda_load_scatters_follow_the_model_stream(monkeypatch):
    """A natively ordered load's link copies start at once, its scatters only after the model's
    stream: the model's step in flight writes the load's blocks last thing (a kernel after a long
    sleep), and the load lands over that write, byte-exact, with the scatters' block ids in their
    launch parameters (where no upload orders them)."""
    core, tensors, _, page, n = _native_order_core(monkeypatch, 4)
    dev_ids, chunks, want = _stored_then_cleared(core, tensors, page, n, 11)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # the model's step ...
    idx = torch.from_numpy(dev_ids).cuda()
    for t in tensors:  # ... which writes the blocks at its end (after the submit below returns)
        t.index_fill_(0, idx, 0xEE)
    core.submit(2, Direction.H2D, dev_ids, [n], [0], chunks, staged=True)
    settle(core, [2])
    assert all(torch.equal(t[dev_ids], w) for t, w in zip(tensors, want))
    core.shutdown()


def _fresh_room_and_a_busy_block(monkeypatch):
    """A natively ordered core with job 1 stored and the device zeroed, the pool holding one room
    whose device mirror is not made yet, and a block of that mirror's size which the model's
    stream, busy for ~25 ms, still reads: (core, tensors, n, dev_ids, chunks, want, room, block,
    seen), ``seen`` the stream's copy of the block as it reads it."""
    core, tensors, _, page, n = _native_order_core(monkeypatch, 4)
    dev_ids, chunks, want = _stored_then_cleared(core, tensors, page, n, 9)
    while core.pool.num_free:  # the load's room is the one made below, its device mirror not yet made
        core.pool.acquire(0)
    room = core.pool.acquire(core.stager.native_room(n, n * len(tensors)))
    torch.cuda.synchronize()
    block = torch.full((3 * room.capacity,), 0x0123456789ABCDEF, dtype=torch.int64, device="cuda")
    torch.cuda._sleep(50_000_000)  # the model's step in flight ...
    seen = block.clone()  # ... still reads the block
    return core, tensors, n, dev_ids, chunks, want, room, block, seen


@pytest.mark.gpu
def test_cuda_native_load_ids_wait_for_memory_the_model_stream_still_reads(monkeypatch):
    """A natively ordered load starts its link copies at once but writes its block ids only after
    the model's stream is through, whatever memory their device mirror is: given a mirror that the
    busy model stream still reads (as one allocated on that stream could be: vLLM 0.23's serving
    crashed with an illegal address when the ids were written at once), what the stream reads from
    it is unchanged, and the load lands byte-exact."""
    core, tensors, n, dev_ids, chunks, want, room, freed, seen = _fresh_room_and_a_busy_block(monkeypatch)
    room.device_cols, room.device_addr = freed, freed.data_ptr()  # the mirror takes it (as if freed meanwhile)
    core.pool.release([room])
    core.submit(2, Direction.H2D, dev_ids, [n], [0], chunks, staged=True)
    assert room.device_cols is freed  # the load took that room
    settle(core, [2])
    assert bool((seen == 0x0123456789ABCDEF).all()), "the load wrote its block ids before the model's stream read them"
    assert all(torch.equal(t[dev_ids], w) for t, w in zip(tensors, want))
    core.shutdown()


@pytest.mark.gpu
def test_cuda_native_load_ids_never_take_memory_the_model_stream_freed(monkeypatch):
    """A room's device mirror of the block ids is made at its first use, on a stream of ours:
    torch's allocator hands a stream only blocks freed on that stream, so the mirror is never memory
    that the model's stream freed while a kernel of its step in flight still reads it (vLLM 0.23's
    async scheduling: its serving crashed with an illegal address when the mirror came from the
    model's stream and the ids were written at once): what the busy stream reads from its freed
    block is unchanged, and the load lands byte-exact."""
    core, tensors, n, dev_ids, chunks, want, room, freed, seen = _fresh_room_and_a_busy_block(monkeypatch)
    ptr = freed.data_ptr()
    del freed  # the model's stream frees the block it still reads
    again = torch.empty(3 * room.capacity, dtype=torch.int64, device="cuda")
    assert again.data_ptr() == ptr, "the allocator did not hand the model's stream its freed block (the premise)"
    del again
    core.pool.release([room])
    core.submit(2, Direction.H2D, dev_ids, [n], [0], chunks, staged=True)
    assert room.device_addr and room.device_addr != ptr, "the ids' mirror is the block the model's stream freed"
    settle(core, [2])
    assert bool((seen == 0x0123456789ABCDEF).all()), "the load wrote its block ids into memory the model's stream read"
    assert all(torch.equal(t[dev_ids], w) for t, w in zip(tensors, want))
    core.shutdown()


def test_cuda_ids_mirror_is_made_on_a_stream_of_ours():
    """CudaStagedPipeline makes a room's device mirror inside the given stream's context (one of
    ours), once per room: made on the model's stream, it could be memory a kernel of the step in
    flight still reads, where a transfer writes the ids."""
    from contextlib import contextmanager

    from vllm_npu_offload.copy.cuda_pipeline import CudaStagedPipeline
    from vllm_npu_offload.plan import DescriptorBuffers
    from vllm_npu_offload.platform import CpuPlatform

    seen = []

    class Platform(CpuPlatform):
        @contextmanager
        def stream_context(self, stream):
            seen.append(("enter", stream))
            yield
            seen.append(("exit", stream))

    class Lib:
        def create_events(self, n):
            return [0] * n

        def gather_load(self):
            pass

    plat = Platform()
    pipe = CudaStagedPipeline(Lib(), plat, 2, {d: 1 for d in Direction}, 1024)
    bufs, ours = DescriptorBuffers(plat, 16), object()
    addr = pipe._device_ids(bufs, ours)
    assert seen == [("enter", ours), ("exit", ours)] and addr == bufs.device_cols.data_ptr() != 0
    assert bufs.device_cols.numel() == 3 * 16
    assert pipe._device_ids(bufs, object()) == addr and len(seen) == 2  # made once, kept with the set


def test_slices_ramp_small_then_slot_sized(monkeypatch):
    core, tensors, refs, rng = random_core(2, 1, staging_chunks=64)
    slot = core.stager.geometry.slot_blocks
    assert slot == 16
    monkeypatch.setattr(staging, "RAMP", 8)
    monkeypatch.setattr(staging, "MIN_SLICE_BYTES", 0)
    monkeypatch.setattr(staging, "GROWTH", 4)
    assert core.stager.slice_sizes(40, Direction.D2H) == [5, 16, 16, 3]  # small slice first for stores
    assert core.stager.slice_sizes(40, Direction.H2D) == [3, 16, 16, 5]  # ... and last for loads
    assert core.stager.slice_sizes(3, Direction.D2H) == [1, 2]
    monkeypatch.setattr(staging, "GROWTH", 2)
    assert core.stager.slice_sizes(40, Direction.D2H) == [5, 10, 16, 9]  # growing up to the slot size
    assert core.stager.slice_sizes(18, Direction.D2H) == [3, 6, 9]  # a small remainder joins its neighbour
    monkeypatch.setattr(staging, "GROWTH", 4)
    monkeypatch.setattr(staging, "MIN_SLICE_BYTES", 6 * core.layout.record_bytes)
    assert core.stager.slice_sizes(40, Direction.D2H) == [6, 16, 16, 2]
    assert core.stager.slice_sizes(4, Direction.D2H) == [4]
    plan = core.plan(Direction.D2H, np.arange(40), [40], [0], np.arange(40), staged=True).plan
    assert plan.num_slices == 4 and len(plan.link) == 4  # consecutive host blocks: one run per slice
    assert plan.link.sizes.tolist() == [r * core.layout.record_bytes for r in (6, 16, 16, 2)]
    core.pool.release(plan.buffers)
    core.shutdown()


def test_crossover_follows_the_cost_lines():
    """Staged = fixed cost + link per block; direct = more per block. The threshold is where the
    two lines cross, inside or beyond the sizes measured, and one disturbed point does not
    move it (the H200 calibration that sent every store of < 128 blocks down the direct path)."""
    from vllm_npu_offload.staging_choice import NEVER, crossover

    sizes = [1, 2, 4, 8, 16, 32, 64, 128]
    direct = [10.0 * n for n in sizes]
    assert crossover(sizes, direct, [50 + 8.0 * n for n in sizes]) == 25
    assert crossover(sizes, direct, [200 + 9.0 * n for n in sizes]) == 200  # beyond the sizes measured
    assert crossover(sizes, direct, [1000 + 9.9 * n for n in sizes]) == 10000
    assert crossover(sizes, direct, [9.0 * n if n != 8 else 99 for n in sizes]) == 1  # one slow point: no matter
    disturbed = [20 + 5.0 * n for n in sizes]
    disturbed[-1] = 2000.0  # slower than direct at the largest size only
    assert crossover(sizes, direct, disturbed) == 4
    assert crossover(sizes, direct, [5 + 11.0 * n for n in sizes]) == NEVER  # dearer per block, never faster
    assert crossover(sizes, direct, list(direct)) == 1  # same line: staged is never slower
    assert crossover(sizes, direct, [t + 1 for t in direct]) == NEVER  # parallel and above: never faster
    assert crossover([64], [1.0], [2.0]) == NEVER and crossover([64], [2.0], [1.0]) == 64  # one size: no line


def test_calibration_measures_every_size_and_both_paths(monkeypatch, tmp_path):
    """The crossover measurement runs real direct and staged transfers (here on CPU, with
    two KV groups) and caches its result; a cached entry is reused without measuring."""
    from vllm_npu_offload import calibration, staging_choice

    monkeypatch.setenv("NPU_OFFLOAD_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibration, "_MEMO", {})
    core, tensors, refs, rng = random_core(4, 2, staging_chunks=8, groups=2)
    target = core.calibration_target()
    assert target.key.endswith("|plan=python")  # the planner is part of the key: switching it re-measures
    entry = staging_choice.measure(target)
    assert entry["sizes"] == [1, 2, 4, 8, 16, 32]  # not 64: the rig has 48 device blocks
    for d in ("H2D", "D2H"):
        assert len(entry["direct"][d]) == len(entry["staged"][d]) == 6
        assert all(t > 0 for t in entry["direct"][d] + entry["staged"][d])
        assert entry["min_blocks"][d] == staging_choice.crossover(entry["sizes"], entry["direct"][d],
                                                                  entry["staged"][d])
    assert set(staging_choice.measure(target, (Direction.H2D,))["min_blocks"]) == {"H2D"}
    monkeypatch.delenv("NPU_OFFLOAD_STAGED")
    calls = []
    monkeypatch.setattr(staging_choice, "measure", lambda c, dirs: calls.append((c, dirs)) or entry)
    first = staging_choice.staged_thresholds(target)
    assert calls == [(target, tuple(Direction))] and staging_choice.staged_thresholds(target) == first
    assert len(calls) == 1
    assert (tmp_path / calibration.CACHE_FILE).exists()
    # stores that always go direct: only loads are measured (a cache entry of its own), stores NEVER
    loads_only = staging_choice.staged_thresholds(target, (Direction.H2D,))
    assert calls[1:] == [(target, (Direction.H2D,))]
    assert loads_only == {Direction.H2D: first[Direction.H2D], Direction.D2H: staging_choice.NEVER}
    assert staging_choice.staged_thresholds(target, ()) == dict.fromkeys(Direction, staging_choice.NEVER)
    assert len(calls) == 2  # nothing to measure
    core.shutdown()
