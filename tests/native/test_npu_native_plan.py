"""The native page-form planner (``npu_offload_acl_staged_plan`` / ``_submit``, csrc_npu/staged_plan.c)
against the Python planner it replaces (``Stager.plan``): the same page descriptors, link copies and
slice bounds, value for value, over one and two KV groups (whole and partial record spans, equal and
unequal pages per block, group pages smaller than their tensor's), 1-3 blocks per host chunk,
consecutive, descending and shuffled host chunks, one and many slices, both directions; and a bad
request fails whole with a message naming the call and the values. (Round trips with either planner:
test_npu_pipeline.py.)"""

# ruff: noqa: F811  (pytest fixtures imported from _npu_build_support are parameters by design)
from __future__ import annotations

import itertools
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from _npu_build_support import INCLUDE, SKIP_REASON, STREAM, built, emu, fake_npu_platform  # noqa: F401

from vllm_npu_offload import staging
from vllm_npu_offload._native import acl
from vllm_npu_offload.copy.base import Direction
from vllm_npu_offload.device_kv import DeviceKVTensor, GroupRef
from vllm_npu_offload.offload_worker import OffloadWorkerCore
from vllm_npu_offload.plan import DescriptorBuffers
from vllm_npu_offload.transfer import NativeStagedTransfer

pytestmark = pytest.mark.skipif(INCLUDE is None, reason=SKIP_REASON)

PAGES = [256, 512, 128, 384]
DEVICE_BLOCKS, CHUNKS = 96, 90
REFS = {  # KV group -> its tensors (and the bytes of their pages it owns)
    "one": [[GroupRef(i, q) for i, q in enumerate(PAGES)]],
    "two": [[GroupRef(0, 256), GroupRef(1, 512)], [GroupRef(2, 128), GroupRef(3, 384)]],
    "uneven": [[GroupRef(0, 256)], [GroupRef(1, 512), GroupRef(2, 100), GroupRef(3, 300)]],
    "sub": [[GroupRef(0, 200), GroupRef(1, 512), GroupRef(2, 128), GroupRef(3, 300)]],
}
MIN_SLICES = {"many": 0, "one": 1 << 30, "mid": 3 * sum(PAGES)}  # MIN_SLICE_BYTES: slices of 1+, all, 3+ blocks


def _core(built, monkeypatch, refs, bpc: int, kv: list | None = None, pages=PAGES, device_blocks=DEVICE_BLOCKS,
          chunks=CHUNKS) -> OffloadWorkerCore:
    """A worker core on the emulation, staging always on, 4 slots of 8 records per direction (over
    ``kv``'s tensors when given, an empty list to fill: zeroed tensors of ``pages``)."""
    monkeypatch.setenv("NPU_OFFLOAD_NATIVE_DIR", str(Path(built[0]["1"]).parent))
    monkeypatch.setenv("NPU_OFFLOAD_STAGED", "1")
    monkeypatch.setattr(staging, "MIN_SLOT_BYTES", 0)
    platform = fake_npu_platform()
    monkeypatch.setattr(type(platform), "device", property(lambda self: torch.device("cpu")))
    kv = kv if kv is not None else []
    kv += [torch.zeros(device_blocks, q, dtype=torch.uint8) for q in pages]
    core = OffloadWorkerCore([DeviceKVTensor.from_block_view(t) for t in kv], refs, bpc, chunks, platform,
                             staging_bytes=2 * 4 * 8 * sum(pages))
    assert core.stager.plans_natively and not core.stager.table_form
    return core


def _load_back(core: OffloadWorkerCore, kv: list, want: list, dev, sizes, skips, chunks) -> None:
    """Zero the device KV, load ``dev`` back from the host chunks (job 2): every tensor holds ``want``."""
    for t in kv:
        t.zero_()
    core.submit(2, Direction.H2D, dev, sizes, skips, chunks, staged=True)
    core.wait([2])
    assert [r.success for r in core.poll()] == [True]
    assert all(torch.equal(t[dev], w) for t, w in zip(kv, want))


def _python_plan(core: OffloadWorkerCore, direction: Direction, parts) -> dict[str, np.ndarray]:
    """Stager.plan's page-form plan, as the arrays the native planner gives."""
    plan = core._staged_plan(direction, parts)
    loc, link = plan.local, plan.link
    out = {"local_src": loc.src, "local_dst": loc.dst, "local_size": loc.sizes,
           "local_bounds": plan.local_ranges.bounds, "link_src": link.src, "link_dst": link.dst,
           "link_size": link.sizes, "link_bounds": plan.link_bounds}
    out = {k: np.array(v, np.int64) for k, v in out.items()}  # copies: the buffers go back to the pool
    core.pool.release(plan.buffers)
    return out


def _parts(core: OffloadWorkerCore, rng: np.random.Generator, direction: Direction, hosts: str, bpc: int,
           top: int):
    """A random transfer's (group, device ids, host ids) parts: each group's 1 to ``top`` blocks from
    a random sub-block of its first chunk, host chunks in ``hosts`` order."""
    groups = core.num_groups
    sizes = [int(rng.integers(1, top + 1)) for _ in range(groups)]
    idx = [int(rng.integers(0, bpc)) for _ in range(groups)]
    k = sum(-(-(z + i) // bpc) for z, i in zip(sizes, idx))
    chunks = {"seq": np.arange(5, 5 + k), "rev": np.arange(5, 5 + k)[::-1],
              "shuffled": rng.choice(CHUNKS, k, replace=False)}[hosts].astype(np.int64)
    dev = rng.choice(DEVICE_BLOCKS, sum(sizes), replace=False).astype(np.int64)
    return core._split("src" if direction is Direction.D2H else "dst", dev, sizes, idx, chunks), sum(sizes)


@pytest.mark.parametrize("bpc", [1, 2, 3])
@pytest.mark.parametrize("kind", list(REFS))
def test_native_plan_equals_python_plan(built, emu, monkeypatch, kind, bpc):
    rng = np.random.default_rng(bpc * 10 + len(kind))
    core = _core(built, monkeypatch, REFS[kind], bpc)
    pipe, slices, merged, checked = core.stager._fused, set(), 0, 0
    for min_slice in MIN_SLICES.values():
        monkeypatch.setattr(staging, "MIN_SLICE_BYTES", min_slice)
        core.stager.slice_layout.cache_clear()  # the Python planner's layouts were cut for the old value
        for hosts, direction, top in itertools.product(("seq", "rev", "shuffled"), Direction, (3, 40)):
            parts, n = _parts(core, rng, direction, hosts, bpc, top)
            want = _python_plan(core, direction, parts)
            transfer = core._native_staged(direction, parts, n)
            got = pipe.plan_only(core.stager, transfer)
            core.pool.release(transfer.buffers)
            assert got.keys() == want.keys()
            for key, w in want.items():
                assert got[key].dtype == np.int64 and np.array_equal(got[key], w), (
                    kind, bpc, min_slice, hosts, direction.name, n, key, got[key].tolist()[:12], w.tolist()[:12])
            slices.add(len(want["link_bounds"]) - 1)
            merged += len(want["link_src"]) < n
            checked += 1
    # the cases covered what they claim: one slice, more slices than slots, and merged link runs
    assert 1 in slices and max(slices) > core.stager.geometry.slots, slices
    assert (merged > 0) == (kind in ("one", "sub")), merged  # two groups: each owns part of a record
    assert checked == len(MIN_SLICES) * 3 * 2 * 2
    core.shutdown()


def test_native_plan_equals_python_plan_at_a_real_shape(built, emu, monkeypatch):
    """Llama-3-8B per layer with K and V apart, as vLLM-Ascend hands it: 64 tensors of 32 KiB pages,
    4 blocks per host chunk, a 1.25 GiB host buffer, the default 256 MiB of staging, transfers of up
    to 240 blocks (15,360 page descriptors) in several slices."""
    monkeypatch.setenv("NPU_OFFLOAD_NATIVE_DIR", str(Path(built[0]["1"]).parent))
    monkeypatch.setenv("NPU_OFFLOAD_STAGED", "1")
    platform = fake_npu_platform()
    monkeypatch.setattr(type(platform), "device", property(lambda self: torch.device("cpu")))
    page, tensors, blocks, chunks_total = 32 << 10, 64, 256, 160
    kv = [torch.empty(blocks, page, dtype=torch.uint8) for _ in range(tensors)]
    core = OffloadWorkerCore([DeviceKVTensor.from_block_view(t) for t in kv], [[GroupRef(i, page)
                             for i in range(tensors)]], 4, chunks_total, platform)
    assert core.stager.plans_natively and core.host.nbytes == chunks_total * 4 * tensors * page
    rng, pipe = np.random.default_rng(64), core.stager._fused
    for n, hosts in ((12, "seq"), (64, "rev"), (240, "shuffled"), (240, "rev")):
        for direction in Direction:
            k = -(-n // 4)
            chunks = {"seq": np.arange(7, 7 + k), "rev": np.arange(7, 7 + k)[::-1],
                      "shuffled": rng.choice(chunks_total, k, replace=False)}[hosts].astype(np.int64)
            dev = rng.choice(blocks, n, replace=False).astype(np.int64)
            parts = core._split("src" if direction is Direction.D2H else "dst", dev, [n], [0], chunks)
            want = _python_plan(core, direction, parts)
            transfer = core._native_staged(direction, parts, n)
            got = pipe.plan_only(core.stager, transfer)
            core.pool.release(transfer.buffers)
            for key, w in want.items():
                assert np.array_equal(got[key], w), (n, hosts, direction.name, key)
            assert len(want["local_src"]) == n * tensors
            assert len(want["link_bounds"]) > 2 or n < 64  # several slices at the larger sizes
    core.shutdown()


def _transfer(core: OffloadWorkerCore, direction: Direction, dev: list[int], chunks: list[int]) -> NativeStagedTransfer:
    """A natively planned transfer of group 0, its ids unchecked (the checks under test are the library's)."""
    dev_ids, host_ids = np.array(dev, np.int64), np.array(chunks, np.int64)
    return core._native_staged(direction, [(0, dev_ids, host_ids)], len(dev_ids))


@pytest.mark.parametrize("case, needle", [
    ("device", "device block id 96 out of range [0, 96) (KV group 0, block 2 of the transfer)"),
    ("host", "host block id -3 out of range [0, 90) (KV group 0, block 1 of the transfer)"),
    ("room", "4 pages and up to 1 link copies need room for 5 descriptors, the room holds 3"),
    ("growth", "growth=1"),
    ("span", "group 0 is invalid"),
])
def test_bad_request_fails_whole(built, emu, monkeypatch, case, needle):
    core = _core(built, monkeypatch, REFS["one"], 1)
    dev, chunks = {"device": ([4, 5, DEVICE_BLOCKS], [1, 2, 3]), "host": ([4, 5], [7, -3])}.get(case, ([4], [7]))
    transfer = _transfer(core, Direction.D2H, dev, chunks)
    if case == "room":
        core.pool.release(transfer.buffers)
        transfer.room = DescriptorBuffers(core.platform, 3)
    elif case == "growth":
        monkeypatch.setattr(staging, "GROWTH", 1)
    elif case == "span":
        planner, span, *ids = transfer.groups[0]
        transfer.groups[0] = (planner, (span[1], span[0] + 1), *ids)
    emu.acl_emu_reset()
    if case in ("device", "host"):  # a block id out of range is bad input: ValueError, as the split raises
        with pytest.raises(ValueError, match="npu_offload_acl_staged_submit: .*" + re.escape(needle)):
            transfer.enqueue(STREAM)
        with pytest.raises(ValueError, match="npu_offload_acl_staged_plan: "):
            core.stager._fused.plan_only(core.stager, transfer)
    else:
        with pytest.raises(acl.AclCopyError, match="npu_offload_acl_staged_submit: .*" + re.escape(needle)) as e:
            transfer.enqueue(STREAM)
        assert e.value.status == acl.BAD_ARGUMENT and e.value.call == "argument"
        with pytest.raises(acl.AclCopyError, match="npu_offload_acl_staged_plan: "):
            core.stager._fused.plan_only(core.stager, transfer)
    assert emu.acl_emu_log() == b""  # nothing was enqueued
    core.pool.release(transfer.buffers)
    core.shutdown()


@pytest.mark.parametrize("bpc, dev, chunks, needle", [
    (1, [4, 5, DEVICE_BLOCKS], [1, 2, 3], f"device block id {DEVICE_BLOCKS} out of range [0, {DEVICE_BLOCKS})"),
    (1, [4, -1, 6], [1, 2, 3], f"device block id -1 out of range [0, {DEVICE_BLOCKS})"),
    (1, [4, 5, 6], [1, CHUNKS, 3], f"host block id {CHUNKS} out of range [0, {CHUNKS})"),
    (2, [4, 5, DEVICE_BLOCKS], [1, 2], f"device block id {DEVICE_BLOCKS} out of range [0, {DEVICE_BLOCKS})"),
    # several blocks a chunk: the chunk ids are still checked in Python (their expansion could wrap)
    (2, [4, 5, 6], [1, 1 << 62], f"host chunk id out of range [0, {CHUNKS})"),
])
def test_submit_raises_on_ids_the_library_checks(built, emu, monkeypatch, bpc, dev, chunks, needle):
    """The library checks a natively planned transfer's block ids, so the split leaves the ranges to it:
    a bad id raises ValueError at submit naming it and the range, nothing is enqueued, the job is not
    queued and its room goes back; the next transfer goes through."""
    core = _core(built, monkeypatch, REFS["one"], bpc)
    assert core.stager.checks_ids
    made = []  # every room the pool hands out must come back
    acquire = core.pool.acquire
    monkeypatch.setattr(core.pool, "acquire", lambda n: made.append(acquire(n)) or made[-1])
    emu.acl_emu_reset()
    for d in Direction:
        with pytest.raises(ValueError, match=re.escape(needle)):
            core.submit(1, d, np.array(dev, np.int64), [3], [0], np.array(chunks, np.int64), staged=True)
        assert emu.acl_emu_log() == b"" and core.engine.in_flight() == 0
        assert all(r in core.pool._free for r in made), "a room of a rejected transfer was kept"
    core.submit(2, Direction.D2H, np.array([4, 5, 6], np.int64), [3], [0], np.arange(1, 1 + len(chunks)), staged=True)
    core.wait([2])
    assert [r.success for r in core.poll()] == [True]
    core.shutdown()


@pytest.mark.parametrize("bpc", [1, 3])
def test_submit_plans_the_common_transfer_inline(built, emu, monkeypatch, bpc):
    """One KV group (1 or 3 blocks a host chunk): ``OffloadWorkerCore.submit`` plans the transfer inline, as
    on CUDA (no call of ``plan``; the same transfer as ``plan``'s, which the engine orders here), and
    the round trip is byte-exact; a shape it does not take (group sizes that do not add up) goes to
    ``plan``, which names it."""
    kv: list = []
    core = _core(built, monkeypatch, REFS["one"], bpc, kv)
    assert core._one_native and not core.stager.orders_natively
    rng = np.random.default_rng(3)
    dev = rng.choice(DEVICE_BLOCKS, 7, replace=False).astype(np.int64)
    chunks = rng.choice(CHUNKS, -(-7 // bpc), replace=False).astype(np.int64)
    for t in kv:
        t.copy_(torch.from_numpy(rng.integers(0, 256, tuple(t.shape), dtype=np.uint8)))
    want = [t[dev].clone() for t in kv]
    planned = core.plan(Direction.D2H, dev, [7], [0], chunks, staged=True)
    core.pool.release(planned.buffers)
    real_plan = core.plan
    monkeypatch.setattr(core, "plan", lambda *a, **k: pytest.fail("submit went through plan"))
    core.submit(1, Direction.D2H, dev, [7], [0], chunks, staged=True)
    inline = core.engine._queues[Direction.D2H][-1].transfer
    assert (type(inline), inline.total_bytes, inline.pages, inline.orders_itself) == (
        NativeStagedTransfer, planned.total_bytes, planned.pages, False)
    core.wait([1])
    assert [r.success for r in core.poll()] == [True]
    _load_back(core, kv, want, dev, [7], [0], chunks)
    monkeypatch.setattr(core, "plan", real_plan)
    with pytest.raises(ValueError, match="do not add up"):
        core.submit(3, Direction.D2H, dev, [6], [0], chunks, staged=True)
    core.shutdown()


@pytest.mark.parametrize("skip", [0, 1, 2])
def test_submit_expands_chunks_inline_from_any_place_in_the_first_chunk(built, emu, monkeypatch, skip):
    """3 blocks a host chunk, the group starting ``skip`` blocks into its first chunk (vLLM's
    ``block_indices``): ``submit`` expands the chunk ids itself (no ``plan``), and a store then a load
    of 7 blocks are byte-exact and land in the host blocks ``plan`` would use; a chunk count that does
    not fit, or a chunk id out of range, is never expanded but named by ``plan``."""
    kv: list = []
    core = _core(built, monkeypatch, REFS["one"], 3, kv)
    rng = np.random.default_rng(skip)
    dev = rng.choice(DEVICE_BLOCKS, 7, replace=False).astype(np.int64)
    chunks = rng.choice(CHUNKS, -(-(7 + skip) // 3), replace=False).astype(np.int64)
    for t in kv:
        t.copy_(torch.from_numpy(rng.integers(0, 256, tuple(t.shape), dtype=np.uint8)))
    want = [t[dev].clone() for t in kv]
    ((_, _, host_blocks),) = core.split_groups(dev, [7], [skip], chunks)
    real_plan = core.plan
    monkeypatch.setattr(core, "plan", lambda *a, **k: pytest.fail("submit went through plan"))
    core.submit(1, Direction.D2H, dev, [7], [skip], chunks, staged=True)
    core.wait([1])
    assert [r.success for r in core.poll()] == [True]
    for i, w in enumerate(want):  # the host blocks plan names hold the device pages
        assert torch.equal(core.host_view(i)[torch.from_numpy(host_blocks)], w.cpu().view(w.shape[0], -1))
    _load_back(core, kv, want, dev, [7], [skip], chunks)
    monkeypatch.setattr(core, "plan", real_plan)
    with pytest.raises(ValueError, match="needs 3 host chunks, transfer gives 2|transfer gives 4 host chunks"):
        core.submit(3, Direction.D2H, dev[:7], [7], [skip], np.append(chunks, 5)[:2 if skip == 2 else 4])
    bad = chunks.copy()
    bad[-1] = CHUNKS
    with pytest.raises(ValueError, match=f"host chunk id out of range \\[0, {CHUNKS}\\)"):
        core.submit(4, Direction.D2H, dev, [7], [skip], bad, staged=True)
    core.shutdown()


def test_submit_expands_chunks_inline_at_llama_8b_per_layer_shape(built, emu, monkeypatch):
    """The same at a real model's shape: Llama-3-8B per layer as vLLM-Ascend hands it (32 layers, K and
    V apart: 64 tensors of 32 KiB pages, a 2 MiB host record), 4 blocks a host chunk as a 64-token
    offload block, 14 blocks starting 3 into their first chunk (5 chunks, both ends partial)."""
    pages = [16 * 8 * 128 * 2] * 64
    kv: list = []
    core = _core(built, monkeypatch, [[GroupRef(i, q) for i, q in enumerate(pages)]], 4, kv, pages, 40, 12)
    rng = np.random.default_rng(8)
    dev = rng.choice(40, 14, replace=False).astype(np.int64)
    chunks = rng.choice(12, 5, replace=False).astype(np.int64)
    for t in kv:
        t.copy_(torch.from_numpy(rng.integers(0, 256, tuple(t.shape), dtype=np.uint8)))
    want = [t[dev].clone() for t in kv]
    ((_, _, host_blocks),) = core.split_groups(dev, [14], [3], chunks)
    monkeypatch.setattr(core, "plan", lambda *a, **k: pytest.fail("submit went through plan"))
    core.submit(1, Direction.D2H, dev, [14], [3], chunks, staged=True)
    core.wait([1])
    assert [r.success for r in core.poll()] == [True]
    assert all(torch.equal(core.host_view(i)[torch.from_numpy(host_blocks)], w) for i, w in enumerate(want))
    _load_back(core, kv, want, dev, [14], [3], chunks)
    core.shutdown()


def test_a_natively_planned_transfer_goes_through_the_engine(built, emu, monkeypatch):
    """The worker plans a ``NativeStagedTransfer`` (no page descriptors in Python) and one native call
    plans and enqueues it; its descriptor count is known once enqueued."""
    core = _core(built, monkeypatch, REFS["two"], 2)
    dev = np.arange(10, dtype=np.int64)
    transfer = core.plan(Direction.D2H, dev, [6, 4], [0, 0], np.arange(5, dtype=np.int64), staged=True)
    assert isinstance(transfer, NativeStagedTransfer) and len(transfer) == transfer.pages == 6 * 2 + 4 * 2
    core.engine.submit(1, transfer)
    core.wait([1])
    assert [r.success for r in core.poll()] == [True]
    assert transfer.links == 10  # two groups: each block its own link copy
    core.shutdown()


def test_link_false_runs_only_the_gathers(built, emu, monkeypatch):
    """``link=False`` (benchmarks): every page copied device->device on the job's stream, no link copy,
    no slot event."""
    core = _core(built, monkeypatch, REFS["one"], 2)
    transfer = core.plan(Direction.D2H, np.arange(20, dtype=np.int64), [20], [0], np.arange(10, dtype=np.int64),
                         staged=True)
    emu.acl_emu_reset()
    transfer.enqueue(STREAM, link=False)
    assert emu.acl_emu_count(b"d2d_copies") == transfer.pages == 20 * len(PAGES)
    assert emu.acl_emu_count(b"aclrtRecordEvent") == 0 and emu.acl_emu_last_stream() == STREAM
    assert b"D2D" in emu.acl_emu_log() and b"D2H" not in emu.acl_emu_log()
    core.pool.release(transfer.buffers)
    core.shutdown()
