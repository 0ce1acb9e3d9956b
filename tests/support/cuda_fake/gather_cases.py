"""Native gather kernel cases against the fake libcuda.so.1 (its cuLaunchKernel runs the
kernel body on the CPU, thread by thread). Run in a subprocess: argv[1] = the fake's path,
the rest = case names. The library resolves the driver once per process."""

import ctypes
import functools
import os
import sys

import numpy as np
import torch

fake = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: shared helpers

from vllm_npu_offload.copy.base import DescriptorRange, Direction  # noqa: E402
from vllm_npu_offload.copy.cuda_gather import NativeGatherPath  # noqa: E402
from vllm_npu_offload._native.cuda import load_library  # noqa: E402
from vllm_npu_offload.errors import CopyError  # noqa: E402
from vllm_npu_offload.plan import DescriptorBuffers, Descriptors  # noqa: E402
from staged_round_trip import store_then_load  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fake_platform import FakeCuda, FakeCudaOrdered  # noqa: E402

POISON = 0xA5


def counter(name, kind=ctypes.c_uint):
    return kind.in_dll(fake, name).value


def table(rng, rows, cols, sizes_per_row, span_extra=0):
    """A tensor-major (rows x cols) table of scattered descriptors with row-specific sizes."""
    sizes = np.repeat(np.asarray(sizes_per_row, np.int64), cols)
    stride = int(max(sizes_per_row)) + 48
    n = rows * cols
    span = n * stride + 64 + span_extra
    src = torch.randint(0, 256, (span,), dtype=torch.uint8)
    dst = torch.full((span,), POISON, dtype=torch.uint8)
    so = rng.permutation(n).astype(np.int64) * stride
    do = rng.permutation(n).astype(np.int64) * stride
    return src, dst, so, do, sizes


def expect(src, dst_len, so, do, sizes, idx):
    ref = np.full(dst_len, POISON, np.uint8)
    sn = src.numpy()
    for i in idx:
        ref[do[i]:do[i] + sizes[i]] = sn[so[i]:so[i] + sizes[i]]
    return ref


def case_ranges():
    p = FakeCuda()
    rng = np.random.default_rng(7)
    # Row sizes: 1 KiB (8 lanes per page), an odd tail, sub-vector pages, a 40 KiB page (several passes).
    for row_sizes, offset in (([1024, 1024, 2048, 16384], 0), ([17, 4097, 1, 40960 + 48], 0),
                              ([4096, 4096], 8)):  # offset 8: every page unaligned -> byte path
        rows, cols = len(row_sizes), 37
        src, dst, so, do, sizes = table(rng, rows, cols, row_sizes, span_extra=offset)
        so = so + offset
        n = rows * cols
        bufs = DescriptorBuffers(p, n + 3)
        bufs.src_np[:n], bufs.dst_np[:n], bufs.sizes_np[:n] = src.data_ptr() + so, dst.data_ptr() + do, sizes
        d = Descriptors(bufs.src_np[:n], bufs.dst_np[:n], bufs.sizes_np[:n], int(sizes.sum()), bufs)
        path = NativeGatherPath(p, row_sizes, programs=3)
        prepared = path.prepare(d)
        chosen = []
        for rng_ in (DescriptorRange(5, 11, rows, cols), DescriptorRange(30, 7, rows - 1, cols),
                     DescriptorRange(cols * (rows - 1) + 1, 2)):
            path.copy_range(prepared, rng_, Direction.D2H, None)
            chosen.extend(rng_.indices().tolist())
            assert counter("fake_last_block") == 512
            assert 1 <= counter("fake_last_grid") <= 3, counter("fake_last_grid")
        ref = expect(src, dst.numel(), so, do, sizes, sorted(set(chosen)))
        assert np.array_equal(dst.numpy(), ref), f"{row_sizes}: wrong bytes or poison overwritten"
        group = counter("fake_last_group")
        assert group == {1024: 8, 1: 1, 4096: 32}[min(row_sizes)], (row_sizes, group)
    # copy(): plain arrays (no pooled buffers) and a single descriptor
    src, dst, so, do, sizes = table(rng, 1, 200, [2048])
    NativeGatherPath(p, [2048]).copy(src.data_ptr() + so, dst.data_ptr() + do, sizes, Direction.H2D, None)
    assert np.array_equal(dst.numpy(), expect(src, dst.numel(), so, do, sizes, range(200)))
    # the grid never exceeds the programs asked for, and shrinks for small ranges
    assert counter("fake_last_grid") == 7  # 200 pages / (512 threads / 16 lanes per page) -> 7 blocks
    # a few large pages take more lanes each, until the launch reaches its programs or a lane's share
    # of a page falls below one pass (8 x 16 bytes): 8 pages of 64 KiB, a block each; 64 of them, 128
    # lanes each; 2 KiB pages keep their 16 lanes (a lane would copy half a pass); unaligned pages of a
    # size that is not a multiple of 16 (the byte path); 32 KiB pages, 256 lanes at most
    for n_pages, page, programs, want in ((8, 65536, 16, (512, 8)), (64, 65536, 16, (128, 16)),
                                          (3, 2048, 16, (16, 1)), (5, 65536 + 7, 4, (512, 4)),
                                          (32, 32768, 16, (256, 16))):
        src, dst, so, do, sizes = table(rng, 1, n_pages, [page], span_extra=8)
        so = so + (8 if page % 16 else 0)
        NativeGatherPath(p, [page], programs=programs).copy(src.data_ptr() + so, dst.data_ptr() + do, sizes,
                                                             Direction.H2D, None)
        assert np.array_equal(dst.numpy(), expect(src, dst.numel(), so, do, sizes, range(n_pages))), (n_pages, page)
        assert (counter("fake_last_group"), counter("fake_last_grid")) == want, (n_pages, page, programs)
    print("ranges ok")


def case_staged():
    """The worker core's staged store and load through the native gather and the batch DMA,
    planned and enqueued by the native pipeline (one call per transfer)."""
    staged_round_trip()
    print("staged ok")


def case_staged_groups():
    """Two KV groups in one table-form transfer: each group's table and block ids, its tensors only."""
    from vllm_npu_offload import staging
    from vllm_npu_offload.device_kv import DeviceKVTensor, GroupRef
    from vllm_npu_offload.offload_worker import OffloadWorkerCore

    os.environ.update(NPU_OFFLOAD_STAGED="1", NPU_OFFLOAD_CALIBRATE="0")
    staging.MIN_SLOT_BYTES = staging.MIN_SLICE_BYTES = 0
    rng = np.random.default_rng(5)
    pages = [1024, 1024, 2048, 512]
    kv = [torch.from_numpy(rng.integers(0, 256, (32, q), dtype=np.uint8)).clone() for q in pages]
    core = OffloadWorkerCore([DeviceKVTensor.from_block_view(t) for t in kv],
                             [[GroupRef(0, 1024), GroupRef(1, 1024)], [GroupRef(2, 2048), GroupRef(3, 512)]], 2, 20,
                             FakeCuda(), staging_bytes=2 * 3 * 2 * sum(pages))
    assert core.stager.table_form
    a, b = rng.choice(32, 5, replace=False).astype(np.int64), rng.choice(32, 6, replace=False).astype(np.int64)
    chunks = np.array([3, 7, 1, 9, 4, 12], np.int64)  # group 0: 5 blocks from sub-block 1 -> 3 chunks; group 1: 3
    original = [t.clone() for t in kv]
    core.submit(1, Direction.D2H, np.concatenate([a, b]), [5, 6], [1, 0], chunks)
    core.wait([1])
    assert [(r.success, r.error) for r in core.poll()] == [(True, None)]
    for t in kv:
        t.zero_()
    a2, b2 = rng.permutation(32)[:5].astype(np.int64), rng.permutation(32)[:6].astype(np.int64)
    core.submit(2, Direction.H2D, np.concatenate([a2, b2]), [5, 6], [1, 0], chunks)
    core.wait([2])
    assert [(r.success, r.error) for r in core.poll()] == [(True, None)]
    for i, (t, o) in enumerate(zip(kv, original)):
        src, dst = (a, a2) if i < 2 else (b, b2)
        assert torch.equal(t[dst], o[src]), i
        untouched = np.setdiff1d(np.arange(32), dst)
        assert not t[untouched].any(), i  # the other group's blocks were not written into this tensor
    core.shutdown()
    print("staged_groups ok")


def case_staged_wide_first():
    """A store whose first slice has more blocks than fit in the launch parameters: its first
    gather waits for the uploaded ids instead (no inline launch), still byte for byte."""
    from vllm_npu_offload import staging
    from vllm_npu_offload.device_kv import DeviceKVTensor, GroupRef
    from vllm_npu_offload.offload_worker import OffloadWorkerCore

    os.environ.update(NPU_OFFLOAD_STAGED="1", NPU_OFFLOAD_CALIBRATE="0")
    pages = [64, 64, 128, 32]
    staging.MIN_SLOT_BYTES = 0
    rng = np.random.default_rng(3)
    kv = [torch.from_numpy(rng.integers(0, 256, (200, q), dtype=np.uint8)).clone() for q in pages]
    core = OffloadWorkerCore([DeviceKVTensor.from_block_view(t) for t in kv], [[GroupRef(i, q) for i, q in
                             enumerate(pages)]], 1, 160, FakeCuda(), staging_bytes=2 * 4 * 128 * 2 * sum(pages))
    staging.MIN_SLICE_BYTES = 80 * core.stager.geometry.record_bytes  # first slice: at least 80 blocks > 64
    assert core.stager.slice_sizes(100, Direction.D2H)[0] > 64, core.stager.slice_sizes(100, Direction.D2H)
    ids, chunks = rng.choice(200, 100, replace=False).astype(np.int64), rng.choice(160, 100, replace=False)
    inline0, tables0 = counter("fake_inline_launches", ctypes.c_longlong), counter("fake_table_launches", ctypes.c_longlong)
    core.submit(1, Direction.D2H, ids, [100], [0], chunks.astype(np.int64))
    core.wait([1])
    assert [(r.success, r.error) for r in core.poll()] == [(True, None)]
    assert counter("fake_inline_launches", ctypes.c_longlong) == inline0
    assert counter("fake_table_launches", ctypes.c_longlong) > tables0
    for i, t in enumerate(kv):
        assert torch.equal(core.host_view(i)[core._host_blocks(chunks, 0, 100)], t[ids]), i
    core.shutdown()
    print("staged_wide_first ok")


def case_staged_one_slice():
    """A store of one slice with its ids inline uploads nothing: no copy is left running on the
    aux stream after the job's stream ends (its id buffers go back to the pool then)."""
    from vllm_npu_offload import staging
    from vllm_npu_offload.device_kv import DeviceKVTensor, GroupRef
    from vllm_npu_offload.offload_worker import OffloadWorkerCore

    os.environ.update(NPU_OFFLOAD_STAGED="1", NPU_OFFLOAD_CALIBRATE="0")
    staging.MIN_SLOT_BYTES = 0
    pages = [256, 512]
    rng = np.random.default_rng(9)
    kv = [torch.from_numpy(rng.integers(0, 256, (32, q), dtype=np.uint8)).clone() for q in pages]
    core = OffloadWorkerCore([DeviceKVTensor.from_block_view(t) for t in kv], [[GroupRef(i, q) for i, q in
                             enumerate(pages)]], 1, 24, FakeCuda(), staging_bytes=2 * 4 * 16 * 2 * sum(pages))
    staging.MIN_SLICE_BYTES = 1 << 20  # the first slice takes the whole (small) transfer
    ids, chunks = rng.choice(32, 6, replace=False).astype(np.int64), rng.choice(24, 6, replace=False).astype(np.int64)
    assert core.stager.slice_sizes(6, Direction.D2H) == [6]
    copies0, inline0 = counter("fake_memcpy_calls", ctypes.c_longlong), counter("fake_inline_launches", ctypes.c_longlong)
    core.submit(1, Direction.D2H, ids, [6], [0], chunks)
    core.wait([1])
    assert [(r.success, r.error) for r in core.poll()] == [(True, None)]
    assert counter("fake_inline_launches", ctypes.c_longlong) > inline0
    assert counter("fake_memcpy_calls", ctypes.c_longlong) == copies0  # no id upload
    for i, t in enumerate(kv):
        assert torch.equal(core.host_view(i)[core._host_blocks(chunks, 0, 6)], t[ids]), i
    core.shutdown()
    print("staged_one_slice ok")


def _inline_core(seed):
    """A staged worker core (FakeCuda, the native pipeline, slot- and slice-size floors off) over
    three tensors of 256, 512 and 128-byte random pages in one KV group: (core, tensors, rng)."""
    from vllm_npu_offload import staging
    from vllm_npu_offload.device_kv import DeviceKVTensor, GroupRef
    from vllm_npu_offload.offload_worker import OffloadWorkerCore

    os.environ.update(NPU_OFFLOAD_STAGED="1", NPU_OFFLOAD_CALIBRATE="0")
    staging.MIN_SLOT_BYTES = staging.MIN_SLICE_BYTES = 0
    pages = [256, 512, 128]
    rng = np.random.default_rng(seed)
    kv = [torch.from_numpy(rng.integers(0, 256, (48, q), dtype=np.uint8)).clone() for q in pages]
    core = OffloadWorkerCore([DeviceKVTensor.from_block_view(t) for t in kv], [[GroupRef(i, q) for i, q in
                             enumerate(pages)]], 1, 40, FakeCuda(), staging_bytes=2 * 3 * 4 * sum(pages))
    return core, kv, rng


def case_staged_large_pages():
    """A 2-block staged store and load of 64 KiB pages (as 256 KiB pages at 128-token blocks, smaller):
    each slice's gather/scatter is a few pages, whose launch takes more lanes per page than a warp;
    both directions byte-exact."""
    from vllm_npu_offload.device_kv import DeviceKVTensor, GroupRef
    from vllm_npu_offload.offload_worker import OffloadWorkerCore

    os.environ.update(NPU_OFFLOAD_STAGED="1", NPU_OFFLOAD_CALIBRATE="0")
    pages = [65536] * 4
    rng = np.random.default_rng(17)
    kv = [torch.from_numpy(rng.integers(0, 256, (6, q), dtype=np.uint8)).clone() for q in pages]
    core = OffloadWorkerCore([DeviceKVTensor.from_block_view(t) for t in kv], [[GroupRef(i, q) for i, q in
                             enumerate(pages)]], 1, 5, FakeCuda(), staging_bytes=2 * 2 * sum(pages))
    ids, chunks = np.array([4, 1], np.int64), np.array([3, 0], np.int64)
    want = [t[ids].clone() for t in kv]
    core.submit(1, Direction.D2H, ids, [2], [0], chunks, staged=True)
    core.wait([1])
    assert [(r.success, r.error) for r in core.poll()] == [(True, None)]
    assert counter("fake_last_group") > 32, counter("fake_last_group")  # 4 or 8 pages: a block's lanes each
    for i, w in enumerate(want):
        assert torch.equal(core.host_view(i)[torch.from_numpy(chunks)], w), i
    for t in kv:
        t.zero_()
    core.submit(2, Direction.H2D, ids[::-1].copy(), [2], [0], chunks, staged=True)
    core.wait([2])
    assert [(r.success, r.error) for r in core.poll()] == [(True, None)]
    assert counter("fake_last_group") > 32, counter("fake_last_group")
    for t, w in zip(kv, want):
        assert torch.equal(t[ids[::-1].copy()], w), "a page landed elsewhere"
    core.shutdown()
    print("staged_large_pages ok")


def case_staged_load_inline():
    """A load of several slices launches every scatter with its ids inline, and the ids go to the
    device in no copy (neither an upload nor a descriptor of the first link batch); the bytes land
    exact. With the engine's order the last scatter waits for the model's mark itself (no upload for
    it to wait for)."""
    core, kv, rng = _inline_core(17)
    fused = core.stager._fused
    ids, chunks = rng.choice(48, 20, replace=False).astype(np.int64), rng.choice(40, 20, replace=False).astype(np.int64)
    core.submit(1, Direction.D2H, ids, [20], [0], chunks)
    core.wait([1])
    assert [(r.success, r.error) for r in core.poll()] == [(True, None)]
    original = [t.clone() for t in kv]
    for t in kv:
        t.zero_()
    back = rng.permutation(48)[:20].astype(np.int64)
    slices = len(core.stager.slice_sizes(20, Direction.H2D))
    assert slices > 3, slices  # more slices than slots
    copies0, inline0 = counter("fake_memcpy_calls", ctypes.c_longlong), counter("fake_inline_launches", ctypes.c_longlong)
    tables0, n0 = counter("fake_table_launches", ctypes.c_longlong), counter("fake_log_n", ctypes.c_longlong)
    transfer = core.plan(Direction.H2D, back, [20], [0], chunks)
    core.engine.submit(2, transfer)
    core.wait([2])
    assert [(r.success, r.error) for r in core.poll()] == [(True, None)]
    assert counter("fake_inline_launches", ctypes.c_longlong) - inline0 == slices  # every scatter inline
    assert counter("fake_table_launches", ctypes.c_longlong) == tables0
    assert counter("fake_memcpy_calls", ctypes.c_longlong) == copies0  # no id upload
    copies = [op for op in _event_ops_since(n0, copies=True) if op[0] == "copy"]
    assert len(copies) == transfer.links > 0, (len(copies), transfer.links)  # the link copies alone: no ids in a batch
    for t, o in zip(kv, original):
        assert torch.equal(t[back], o[ids])
    # with the engine's order: the aux stream and the last scatter wait for the model's mark, no copy has the ids
    for t in kv:
        t.zero_()
    compute, after, start, end = 0xC0, 0xAF, 0x57, 0xE0
    parts = core._split("dst", back, [20], [0], chunks)
    transfer = core._native_staged(Direction.H2D, parts, 20)
    mark, n0 = fused.model_mark(Direction.H2D), counter("fake_log_n", ctypes.c_longlong)
    inline0 = counter("fake_inline_launches", ctypes.c_longlong)
    core.stager.run_native(transfer, object(), order=(compute, after, start, end))
    ops, stream = _event_ops_since(n0, copies=True), 0x51  # FakeCuda's every stream
    # the first link copy right after the engine's order (the previous job's end, the start): aux is ordered
    # in the loop (each scatter there waits for its slice's link batch, aux for the mark after the first
    # batch), no entry mark; the model's mark is recorded after that batch, not before the first byte
    at = ops.index(("record", start, stream))
    assert ops[:at + 1] == [("wait", after, stream), ("record", start, stream)], ops[:at + 1]
    assert ops[at + 1][0] == "copy", ops[:at + 3]
    assert not [op for op in ops if op[1] == fused.events[Direction.H2D][0]], ops
    marked = ops.index(("record", mark, compute))
    assert ops.count(("record", mark, compute)) == 1 and all(op[0] == "copy" for op in ops[at + 1:marked]), ops
    first_filled = marked + 1
    assert ops[first_filled][0] == "record", ops[marked:marked + 3]
    assert ops[first_filled + 1:first_filled + 3] == [("wait", ops[first_filled][1], stream), ("wait", mark, stream)], (
        ops[first_filled:first_filled + 3])  # aux: slice 0's link batch, then the mark, before its scatter
    waits = [op for op in ops if op[0] == "wait"]
    assert [op for op in waits if op[1] == mark] == [("wait", mark, stream)] * 2, waits  # aux's scatters, the last
    assert waits[-2] == ("wait", mark, stream) and waits[-1][1] != mark, waits  # the last scatter's, then the others'
    ids_dev = transfer.room.device_addr
    assert not [op for op in ops if op[0] == "copy" and op[1] == ids_dev], ops
    assert counter("fake_inline_launches", ctypes.c_longlong) - inline0 == slices
    assert ops[-1] == ("record", end, stream), ops[-3:]
    for t, o in zip(kv, original):
        assert torch.equal(t[back], o[ids])
    core.pool.release(transfer.buffers)
    # one slice: its link batch, then the mark, which the stream waits for before the slice's scatter
    from vllm_npu_offload import staging
    staging.MIN_SLICE_BYTES = 1 << 20
    try:
        k = core.stager.geometry.slot_blocks  # a slice fills one slot at most
        assert 1 < k < 20 and core.stager.slice_sizes(k, Direction.H2D) == [k], k
        for t in kv:
            t.zero_()
        transfer = core._native_staged(Direction.H2D, core._split("dst", back[:k], [k], [0], chunks[:k]), k)
        n0 = counter("fake_log_n", ctypes.c_longlong)
        core.stager.run_native(transfer, object(), order=(compute, after, start, end))
        ops = _event_ops_since(n0, copies=True)
        marked = ops.index(("record", mark, compute))
        assert ops[:2] == [("wait", after, stream), ("record", start, stream)] and ops[2][0] == "copy", ops[:3]
        assert all(op[0] == "copy" for op in ops[2:marked]), ops
        assert ops[marked + 1:] == [("wait", mark, stream), ("record", end, stream)], ops[marked:]
        for t, o in zip(kv, original):
            assert torch.equal(t[back[:k]], o[ids[:k]])
        core.pool.release(transfer.buffers)
    finally:
        staging.MIN_SLICE_BYTES = 0
    core.shutdown()
    _load_inline_past_64_blocks()
    print("staged_load_inline ok")


def _load_inline_past_64_blocks():
    """Loads at a real model's shape (32 layers, K and V apart: 64 tensors of 2 KiB pages), one with a
    slice of more than 64 blocks, which launch parameters cannot hold: that load takes its ids in the
    first link batch (no order given) and lands byte-exact."""
    from vllm_npu_offload.device_kv import DeviceKVTensor, GroupRef
    from vllm_npu_offload.offload_worker import OffloadWorkerCore

    page, tensors, blocks, n = 2048, 64, 160, 130
    rng = np.random.default_rng(19)
    kv = [torch.from_numpy(rng.integers(0, 256, (blocks, page), dtype=np.uint8)).clone() for _ in range(tensors)]
    record = tensors * page
    core = OffloadWorkerCore([DeviceKVTensor.from_block_view(t) for t in kv], [[GroupRef(i, page) for i in
                             range(tensors)]], 1, 140, FakeCuda(), staging_bytes=2 * 4 * 80 * record)
    assert core.stager.geometry.slot_blocks == 80
    sizes = core.stager.slice_sizes(n, Direction.H2D)
    assert max(sizes) > 64, sizes
    ids, chunks = rng.choice(blocks, n, replace=False).astype(np.int64), rng.choice(140, n, replace=False).astype(np.int64)
    core.submit(1, Direction.D2H, ids, [n], [0], chunks)
    core.wait([1])
    assert [(r.success, r.error) for r in core.poll()] == [(True, None)]
    original = [t[ids].clone() for t in kv]
    for t in kv:
        t.zero_()
    inline0, tables0 = counter("fake_inline_launches", ctypes.c_longlong), counter("fake_table_launches", ctypes.c_longlong)
    n0 = counter("fake_log_n", ctypes.c_longlong)
    transfer = core.plan(Direction.H2D, ids, [n], [0], chunks)
    core.engine.submit(2, transfer)
    core.wait([2])
    assert [(r.success, r.error) for r in core.poll()] == [(True, None)]
    assert counter("fake_inline_launches", ctypes.c_longlong) == inline0  # no scatter inline
    assert counter("fake_table_launches", ctypes.c_longlong) - tables0 == len(sizes)
    copies = [op for op in _event_ops_since(n0, copies=True) if op[0] == "copy"]
    assert ("copy", transfer.room.device_addr, 0x51) in copies, copies[-3:]  # the ids, in the first link batch
    for t, o in zip(kv, original):
        assert torch.equal(t[ids], o)
    core.shutdown()


def case_staged_fail():
    """A link copy failing inside the native pipeline fails its job (reported by poll, no hang)."""
    from vllm_npu_offload import staging
    from vllm_npu_offload.device_kv import DeviceKVTensor, GroupRef
    from vllm_npu_offload.offload_worker import OffloadWorkerCore

    os.environ.update(NPU_OFFLOAD_STAGED="1", NPU_OFFLOAD_CALIBRATE="0")
    staging.MIN_SLOT_BYTES = staging.MIN_SLICE_BYTES = 0
    kv = [torch.zeros(16, 1024, dtype=torch.uint8) for _ in range(4)]
    core = OffloadWorkerCore([DeviceKVTensor.from_block_view(t) for t in kv],
                             [[GroupRef(i, 1024) for i in range(4)]], 1, 16, FakeCuda(), staging_bytes=2 * 4 * 4096)
    core.submit(1, Direction.D2H, np.arange(8, dtype=np.int64), [8], [0], np.arange(8, dtype=np.int64))
    core.wait([1])
    res = core.poll()
    assert len(res) == 1 and not res[0].success and "cuMemcpyBatchAsync" in res[0].error, res
    core.shutdown()
    print("staged_fail ok")


def staged_round_trip():
    from vllm_npu_offload import staging
    from vllm_npu_offload.device_kv import DeviceKVTensor, GroupRef
    from vllm_npu_offload.offload_worker import OffloadWorkerCore

    os.environ["NPU_OFFLOAD_STAGED"] = "1"
    os.environ["NPU_OFFLOAD_CALIBRATE"] = "0"
    staging.MIN_SLOT_BYTES = staging.MIN_SLICE_BYTES = 0
    p = FakeCuda()
    rng = np.random.default_rng(11)
    pages = [2048, 2048, 1152, 4096]
    kv = [torch.from_numpy(rng.integers(0, 256, (40, q), dtype=np.uint8)).clone() for q in pages]
    dev = [DeviceKVTensor.from_block_view(t) for t in kv]
    bpc, record = 2, sum(pages)
    core = OffloadWorkerCore(dev, [[GroupRef(i, q) for i, q in enumerate(pages)]], bpc, 24, p,
                             staging_bytes=2 * 3 * bpc * record)
    assert (core.stager.local_path.name, core.stager.link_path.name) == ("gather_native", "dma")
    assert core.stager._fused is not None and core.stager.table_form and core.stager.plans_natively
    tables0 = counter("fake_table_launches", ctypes.c_longlong)
    records0 = counter("fake_records", ctypes.c_longlong)
    launches0 = counter("fake_launches", ctypes.c_longlong)
    inline0 = counter("fake_inline_launches", ctypes.c_longlong)
    store_then_load(core, kv, rng)
    # stores: the first gather takes its block ids in the launch parameters
    assert counter("fake_inline_launches", ctypes.c_longlong) > inline0
    assert counter("fake_launches", ctypes.c_longlong) - launches0 >= 4  # one per slice, both directions
    assert counter("fake_records", ctypes.c_longlong) > records0  # the library's slot events
    assert counter("fake_table_launches", ctypes.c_longlong) > tables0  # the table kernel, no page descriptors
    core.shutdown()
    assert counter("fake_events", ctypes.c_longlong) == 0  # the pipeline's events freed


def _python_plan(core, direction, parts, n):
    """Stager.plan's table-form plan, as arrays comparable with the native planner's."""
    plan = core._staged_plan(direction, parts)
    ranges = [(core.stager._fused._table(r.planner), len(r.planner.pairs), r.block0, r.blocks)
              for per in plan.table_ranges for r in per]
    out = {"ids": plan.ids.flat_np[:2 * n].copy(), "ranges": np.array(ranges, np.uint64).reshape(-1, 4),
           "range_off": np.cumsum([0] + [len(per) for per in plan.table_ranges]).astype(np.uint64),
           "link_src": plan.link.src.astype(np.uint64), "link_dst": plan.link.dst.astype(np.uint64),
           "link_size": plan.link.sizes.astype(np.uint64), "link_bounds": plan.link_bounds.astype(np.uint64)}
    core.pool.release(plan.buffers)
    return out


def case_native_plan():
    """The native planner (npo_cuda_staged_plan) gives exactly Stager.plan's table-form plan: the
    ids of both sides, per-slice table ranges, link copies and slice bounds, over one and two KV
    groups, whole and partial record spans, 1-3 blocks per chunk, consecutive, descending and
    shuffled host chunks, one and many slices, both directions."""
    from vllm_npu_offload import staging
    from vllm_npu_offload.device_kv import DeviceKVTensor, GroupRef
    from vllm_npu_offload.offload_worker import OffloadWorkerCore

    os.environ.update(NPU_OFFLOAD_STAGED="1", NPU_OFFLOAD_CALIBRATE="0")
    rng = np.random.default_rng(21)
    checked = 0
    for groups_kind in ("one", "two", "sub"):
        pages = [256, 512, 128, 384]
        refs = {"one": [[GroupRef(i, q) for i, q in enumerate(pages)]],
                "two": [[GroupRef(0, 256), GroupRef(1, 512)], [GroupRef(2, 128), GroupRef(3, 384)]],
                "sub": [[GroupRef(0, 200), GroupRef(1, 512), GroupRef(2, 128), GroupRef(3, 300)]]}[groups_kind]
        for bpc in (1, 2, 3):
            for min_slice in (0, 1 << 30, 3 * sum(pages)):
                staging.MIN_SLOT_BYTES, staging.MIN_SLICE_BYTES = 0, min_slice
                kv = [torch.zeros(96, q, dtype=torch.uint8) for q in pages]
                core = OffloadWorkerCore([DeviceKVTensor.from_block_view(t) for t in kv], refs, bpc, 90, FakeCuda(),
                                         staging_bytes=2 * 3 * 24 * sum(pages))
                assert core.stager.plans_natively
                for hosts in ("seq", "rev", "random"):
                    for direction in Direction:
                        sizes = [int(rng.integers(1, 40)) for _ in refs]
                        idx = [int(rng.integers(0, bpc)) for _ in refs]
                        k = sum(-(-(z + i) // bpc) for z, i in zip(sizes, idx))
                        chunks = {"seq": np.arange(5, 5 + k), "rev": np.arange(5, 5 + k)[::-1],
                                  "random": rng.choice(90, k, replace=False)}[hosts].astype(np.int64)
                        dev = rng.choice(96, sum(sizes), replace=False).astype(np.int64)
                        side = "src" if direction is Direction.D2H else "dst"
                        parts = core._split(side, dev, sizes, idx, chunks)
                        n = sum(sizes)
                        want = _python_plan(core, direction, parts, n)
                        transfer = core._native_staged(direction, parts, n)
                        got = core.stager._fused.plan_only(core.stager, transfer)
                        core.pool.release(transfer.buffers)
                        for key, w in want.items():
                            assert np.array_equal(got[key], w), (groups_kind, bpc, min_slice, hosts, direction, key,
                                                                 got[key].tolist()[:12], w.tolist()[:12])
                        checked += 1
                core.shutdown()
    assert checked == 3 * 3 * 3 * 3 * 2, checked
    # a real model's shape: Llama-3-8B per layer with K and V apart (64 tensors of 32 KiB pages),
    # 4 blocks per host chunk, a 1.25 GiB host buffer, 256 MiB of staging, transfers up to 240 blocks
    staging.MIN_SLOT_BYTES, staging.MIN_SLICE_BYTES = 4 << 20, 512 << 10
    page, tensors = 32 << 10, 64
    kv = [torch.empty(256, page, dtype=torch.uint8) for _ in range(tensors)]
    core = OffloadWorkerCore([DeviceKVTensor.from_block_view(t) for t in kv], [[GroupRef(i, page)
                             for i in range(tensors)]], 4, 160, FakeCuda())
    assert core.host.nbytes == 160 * 4 * tensors * page and core.stager.plans_natively
    for n, hosts in ((12, "seq"), (64, "rev"), (240, "random"), (240, "rev")):
        for direction in Direction:
            k = -(-n // 4)
            chunks = {"seq": np.arange(7, 7 + k), "rev": np.arange(7, 7 + k)[::-1],
                      "random": rng.choice(160, k, replace=False)}[hosts].astype(np.int64)
            dev = rng.choice(256, n, replace=False).astype(np.int64)
            parts = core._split("src" if direction is Direction.D2H else "dst", dev, [n], [0], chunks)
            want = _python_plan(core, direction, parts, n)
            transfer = core._native_staged(direction, parts, n)
            got = core.stager._fused.plan_only(core.stager, transfer)
            core.pool.release(transfer.buffers)
            for key, w in want.items():
                assert np.array_equal(got[key], w), ("llama-8b", n, hosts, direction, key)
            assert len(want["link_bounds"]) > 2 or n < 64  # several slices at the larger sizes
    core.shutdown()
    print("native_plan ok")


def _event_ops_since(n0, copies=False):
    """(kind, event, stream) of every event operation since the fake's log count ``n0``; with
    ``copies`` also ("copy", destination, stream) of every copy, in enqueue order."""
    log = (ctypes.c_ulonglong * 3 * 4096).in_dll(fake, "fake_log")
    n = counter("fake_log_n", ctypes.c_longlong)
    ops = [(("record", "wait", "copy")[log[i % 4096][0] - 1], log[i % 4096][1], log[i % 4096][2])
           for i in range(max(n0, n - 4096), n)]
    return ops if copies else [op for op in ops if op[0] != "copy"]


def case_staged_ordered():
    """The engine's stream order in the submit call: the job stream first waits for the compute
    stream (through a mark recorded there) and the previous job's end, then records the start; the
    end is recorded after the copies, and also when the plan fails (the job then finishes, failed)."""
    from vllm_npu_offload import staging
    from vllm_npu_offload.errors import CopyError

    staging.MIN_SLOT_BYTES = staging.MIN_SLICE_BYTES = 0
    rng = np.random.default_rng(4)
    stream = 0x51  # FakeCuda's every stream
    compute, after, start, end = 0xC0, 0xAF, 0x57, 0xE0
    # a store of 6 blocks; a load of 100 blocks whose first slice has more than the 64 its scatters can
    # take in their launch parameters: its ids are uploaded (staged_load_inline checks loads with their
    # ids inline)
    for direction, core, n in ((Direction.D2H, _fresh_core(), 6), (Direction.H2D, _fresh_core(blocks=200), 100)):
        fused = core.stager._fused
        # every planner's pair table is on the device before the first transfer: uploaded at a submit,
        # the copy waited for the model's stream (a whole step, on a GPU)
        tables = {id(p) for p in core._staged.values() if p is not None}
        assert len(tables) == 2 and set(fused._tables) == tables, (tables, fused._tables)
        if direction is Direction.H2D:
            assert max(core.stager.slice_sizes(n, direction)) > 64, core.stager.slice_sizes(n, direction)
        dev = rng.choice(core.device_tensors[0].num_blocks, n, replace=False).astype(np.int64)
        chunks = np.arange(3, 3 + n, dtype=np.int64)
        parts = core._split("src" if direction is Direction.D2H else "dst", dev, [n], [0], chunks)
        transfer = core._native_staged(direction, parts, n)
        mark = fused.model_mark(direction)
        n0 = counter("fake_log_n", ctypes.c_longlong)
        core.stager.run_native(transfer, object(), order=(compute, after, start, end))
        ops = _event_ops_since(n0)
        ids = transfer.room.device_cols.data_ptr()  # where the block ids are uploaded to
        with_copies = _event_ops_since(n0, copies=True)
        if direction is Direction.D2H:  # a store reads the pages: its stream waits for the model's
            assert ops[:4] == [("record", mark, compute), ("wait", mark, stream), ("wait", after, stream),
                               ("record", start, stream)], ops[:4]
        else:  # a load's link copies do not wait; its scatters (aux, then the last on the stream) do
            entry = fused.events[direction][0]
            # the ids go to the device on aux after the model's mark (their buffer may be memory the
            # model's stream freed moments ago), then entry marks them there for the last scatter
            # (the mark recorded where it is first waited for: after the engine's order, as a load with its ids
            # inline records it after its first link batch)
            assert with_copies[:8] == [("wait", after, stream), ("record", start, stream), ("record", entry, stream),
                                       ("wait", entry, stream), ("record", mark, compute), ("wait", mark, stream),
                                       ("copy", ids, stream), ("record", entry, stream)], with_copies[:8]
            assert with_copies.count(("record", mark, compute)) == 1, with_copies
            assert with_copies.count(("copy", ids, stream)) == 1, with_copies  # not again in a link batch
            assert ops.count(("wait", mark, stream)) == 1, ops  # aux, before its scatters
            waits = [op for op in ops if op[0] == "wait"]
            assert waits[-2:] == [("wait", entry, stream), waits[-1]] and waits[-1][1] != mark, waits  # the last scatter
        assert ops[-1] == ("record", end, stream) and [op for op in ops if op[1] in (start, end)] == [
            ("record", start, stream), ("record", end, stream)], ops
        n0 = counter("fake_log_n", ctypes.c_longlong)
        core.stager.run_native(transfer, object())  # no order: none of it
        assert not [op for op in _event_ops_since(n0) if op[1] in (compute, after, start, end)]
        # a failing plan (a device id past the tensors is caught by the split; an impossible growth
        # is not): nothing is copied, the end is recorded all the same
        staging.GROWTH = 1
        n0 = counter("fake_log_n", ctypes.c_longlong)
        try:
            core.stager.run_native(transfer, object(), order=(compute, after, start, end))
            raise AssertionError("a growth of 1 was accepted")
        except CopyError as e:
            assert "growth" in str(e), e
        finally:
            staging.GROWTH = 4
        assert _event_ops_since(n0) == [("record", end, stream)]
        core.pool.release(transfer.buffers)
        assert set(fused._tables) == tables, "a transfer uploaded a table"
        core.shutdown()
    print("staged_ordered ok")


def case_staged_ids_checked():
    """The native CUDA planner checks both sides' block ids (the split then leaves the ranges to it):
    an id past the device tensors or the host buffer, or a negative one, raises ValueError at submit
    naming the id and the range, before anything is copied; the job is not queued, its room and
    events go back, and the next transfer is byte-exact."""
    from vllm_npu_offload import staging

    os.environ.update(NPU_OFFLOAD_STAGED="1", NPU_OFFLOAD_CALIBRATE="0")
    staging.MIN_SLOT_BYTES = staging.MIN_SLICE_BYTES = 0
    for platform in (FakeCuda(), FakeCudaOrdered()):
        _staged_ids_checked(platform)
    print("staged_ids_checked ok")


def _staged_ids_checked(platform):
    from vllm_npu_offload.device_kv import DeviceKVTensor, GroupRef
    from vllm_npu_offload.offload_worker import OffloadWorkerCore

    rng = np.random.default_rng(6)
    pages = [512, 256]
    kv = [torch.from_numpy(rng.integers(0, 256, (32, q), dtype=np.uint8)).clone() for q in pages]
    core = OffloadWorkerCore([DeviceKVTensor.from_block_view(t) for t in kv], [[GroupRef(i, q) for i, q in
                             enumerate(pages)]], 1, 24, platform, staging_bytes=2 * 3 * 4 * sum(pages))
    assert core.stager.checks_ids and core.stager.orders_natively == platform.raw_events
    free, events = core.pool.num_free, len(core.engine._events)
    dev, chunks = rng.choice(32, 6, replace=False).astype(np.int64), np.arange(3, 9, dtype=np.int64)
    for d in Direction:
        for bad_dev, bad_chunk, want in ((32, 3, "device block id 32 out of range [0, 32)"),
                                         (-1, 3, "device block id -1 out of range [0, 32)"),
                                         (5, 24, "host block id 24 out of range [0, 24)")):
            dv, ch = dev.copy(), chunks.copy()
            dv[2], ch[4] = bad_dev, bad_chunk
            copies = counter("fake_copied", ctypes.c_longlong)
            try:
                core.submit(1, d, dv, [6], [0], ch, staged=True)
                raise AssertionError(f"{d.name}: {bad_dev}/{bad_chunk} accepted")
            except ValueError as e:
                assert want in str(e), (want, str(e))
            assert counter("fake_copied", ctypes.c_longlong) == copies, "copied before the check"
            assert core.engine.in_flight() == 0 and core.pool.num_free == max(free, 1), core.pool.num_free
    assert len(core.engine._events) >= events
    want = [t[dev].clone() for t in kv]
    # where the library orders the transfer, ``submit`` plans it inline (no ``plan``): the same transfer;
    # a shape it does not take (here: group sizes that do not add up) goes to ``plan``, which names it
    planned = core.plan(Direction.D2H, dev, [6], [0], chunks, staged=True)
    core.pool.release(planned.buffers)
    real_plan = core.plan
    if platform.raw_events:
        core.plan = lambda *a, **k: (_ for _ in ()).throw(AssertionError("submit went through plan"))
    core.submit(2, Direction.D2H, dev, [6], [0], chunks, staged=True)
    inline = core.engine._queues[Direction.D2H][-1].transfer
    assert (type(inline), inline.total_bytes, inline.pages, inline.orders_itself, len(inline.groups)) == (
        type(planned), planned.total_bytes, planned.pages, planned.orders_itself, 1), (inline, planned)
    assert all(a is b for a, b in zip(inline.groups[0][:2], planned.groups[0][:2]))  # planner, span
    core.plan = real_plan
    try:
        core.submit(9, Direction.D2H, dev, [5], [0], chunks, staged=True)
        raise AssertionError("group sizes that do not add up were accepted")
    except ValueError as e:
        assert "do not add up" in str(e), e
    for t in kv:
        t[dev] = 0
    core.submit(3, Direction.H2D, dev, [6], [0], chunks, staged=True)
    core.wait([2, 3])
    assert [r.success for r in core.poll()] == [True, True]
    assert all(torch.equal(t[dev], w) for t, w in zip(kv, want))
    core.shutdown()


# Python calls (frames) of ``OffloadWorkerCore.submit`` before its native call, for the common transfer
# (one KV group, a block per host chunk, planned and ordered by the library). Each frame there costs the
# engine thread 1-5 us on a GPU server's host after the model's step left the caches cold; two frames and
# a loop more cost 3-10 us per transfer on an H200 host where the fake-driver rig saw 0.5 us
# (docs/benchmarks.md). Lower it when a change removes frames; never raise it without
# a measurement on the device.
SUBMIT_FRAMES_BEFORE_NATIVE = 8


def _counting(fn, count, keep=lambda code: True):
    """``fn()``'s result, adding to ``count[0]`` each Python call it makes whose code ``keep`` takes, as
    the call starts (SUBMIT_FRAMES_LIST=1 lists them)."""
    listing = bool(os.environ.get("SUBMIT_FRAMES_LIST"))

    def profile(frame, event, arg):
        if event == "call" and keep(frame.f_code):
            count[0] += 1
            if listing:
                c = frame.f_code
                print(f"  {count[0]} {c.co_name} {'/'.join(c.co_filename.rsplit('/', 2)[-2:])}:{c.co_firstlineno}",
                      file=sys.stderr)

    sys.setprofile(profile)
    try:
        return fn()
    finally:
        sys.setprofile(None)


def _frames_before_native(core, job, direction, dev, chunks):
    """Python calls ``core.submit`` makes before the library's call, and in all."""
    lane = core.stager._fused._lanes[direction]
    count, at_native, call = [0], [], lane.call

    def native():  # one frame of its own, counted before its body runs
        at_native.append(count[0] - 1)
        return call()

    lane.call = native
    try:
        # a partial (no frame of its own): the count starts at core.submit
        _counting(functools.partial(core.submit, job, direction, dev, [len(dev)], [0], chunks, staged=True), count)
    finally:
        lane.call = call
    return at_native[0], count[0] - 1  # less native's own


# The package's Python calls in the poll that reports a finished transfer (the engine's poll, which the
# worker core binds as its own, the platform's completion query, the result): the connector sees the
# completion after them.
POLL_FRAMES = 3


def _package_frames(fn):
    """``fn()``'s result and the Python calls it made in this package's own files (not the fake platform's,
    whose events are Python where CUDA's are C++)."""
    count = [0]
    out = _counting(fn, count, lambda code: "/vllm_npu_offload/" in code.co_filename)
    return out, count[0]


def case_submit_frames():
    """The common transfer reaches the library within SUBMIT_FRAMES_BEFORE_NATIVE Python calls in both
    directions, once warm as a serving engine is (counted by sys.setprofile on the fake driver: a count,
    not a timing, so it holds on any host), the poll that reports it within POLL_FRAMES
    of the package's, and the counted transfers arrive whole. SUBMIT_FRAMES_LIST=1 lists the calls."""
    from vllm_npu_offload import staging
    from vllm_npu_offload.device_kv import DeviceKVTensor, GroupRef
    from vllm_npu_offload.offload_worker import OffloadWorkerCore

    os.environ.update(NPU_OFFLOAD_STAGED="1", NPU_OFFLOAD_CALIBRATE="0")
    staging.MIN_SLOT_BYTES = staging.MIN_SLICE_BYTES = 0
    rng = np.random.default_rng(12)
    kv = [torch.from_numpy(rng.integers(0, 256, (40, 256), dtype=np.uint8)).clone() for _ in range(8)]
    core = OffloadWorkerCore([DeviceKVTensor.from_block_view(t) for t in kv], [[GroupRef(i, 256) for i in range(8)]],
                             1, 32, FakeCudaOrdered(), staging_bytes=2 * 4 * 8 * 8 * 256)
    dev, chunks = rng.choice(40, 8, replace=False).astype(np.int64), rng.choice(32, 8, replace=False).astype(np.int64)
    want = [t[dev].clone() for t in kv]
    job = 0
    ring = len(core.engine.streams(Direction.D2H))
    for d in (Direction.D2H, Direction.H2D) * ring:  # warm, as a serving engine is: every stream of the ring
        core.submit(job, d, dev, [8], [0], chunks, staged=True)  # seen, lanes, rooms and events made
        core.wait([job])
        assert [r.job_id for r in core.poll()] == [job]
        core.poll()  # idle: the reported job's room and events go back
        job += 1
    counts = {}
    for d in (Direction.D2H, Direction.H2D):
        if d is Direction.H2D:
            for t in kv:
                t[dev] = 0
        counts[d.name] = _frames_before_native(core, job, d, dev, chunks)
        core.wait([job])
        done, frames = _package_frames(core.poll)
        assert [(r.job_id, r.success) for r in done] == [(job, True)], done
        assert frames <= POLL_FRAMES, f"{d.name}: the reporting poll made {frames} Python calls (at most {POLL_FRAMES})"
        core.poll()
        job += 1
    assert all(torch.equal(t[dev], w) for t, w in zip(kv, want))  # the counted transfers arrived whole
    for name, (before, total) in counts.items():
        assert before <= SUBMIT_FRAMES_BEFORE_NATIVE, (
            f"{name}: {before} Python calls before the native call (at most {SUBMIT_FRAMES_BEFORE_NATIVE}): "
            f"each costs 1-5 us on a GPU host's critical path")
        assert before < total, (name, before, total)
    print("submit_frames", {k: v[0] for k, v in counts.items()}, file=sys.stderr)
    core.shutdown()
    print("submit_frames ok")


def case_errors():
    p = FakeCuda()
    lib = load_library()
    col = np.zeros(4, np.int64)
    base = col.ctypes.data
    for kwargs, needle in (({"stride": 1, "rows": 2, "width": 3}, "stride=1 < width=3"),
                           ({"programs": 0}, "programs=0; allowed: 1..1024")):
        args = dict(first=0, width=1, rows=1, stride=0, min_page=16, programs=4, stream_handle=1)
        args.update(kwargs)
        try:
            lib.gather((base, base, base), **args)
        except CopyError as e:
            assert needle in str(e) and e.call == "npo_cuda_gather", e
        else:
            raise AssertionError(f"{kwargs} accepted")
    try:
        lib.gather((0, base, base), 0, 1, 1, 0, 16, 4, 1)
    except CopyError as e:
        assert "null descriptor column" in str(e), e
    try:
        NativeGatherPath(p, [64], programs=17)
    except ValueError as e:
        assert "programs=17; allowed: 1..16" in str(e)
    try:
        NativeGatherPath(p, [64]).copy(np.array([0], np.int64), np.array([base]), np.array([8]), Direction.D2H, None)
    except CopyError as e:
        assert "null address" in str(e) and e.index == 0
    print("errors ok")


def _fresh_core(blocks: int = 32):
    """A staged CUDA worker core over two tensors of 512 and 256-byte pages in one KV group (FakeCuda):
    32 device blocks, 24 host chunks and staging slots of 3 blocks, or with ``blocks`` device blocks
    that many host chunks, and slots of 80 blocks."""
    from vllm_npu_offload.device_kv import DeviceKVTensor, GroupRef
    from vllm_npu_offload.offload_worker import OffloadWorkerCore

    os.environ.update(NPU_OFFLOAD_STAGED="1", NPU_OFFLOAD_CALIBRATE="0")
    pages = [512, 256]
    kv = [torch.zeros((blocks, q), dtype=torch.uint8) for q in pages]
    chunks, slot_blocks = (24, 3) if blocks == 32 else (blocks, 80)
    return OffloadWorkerCore([DeviceKVTensor.from_block_view(t) for t in kv],
                             [[GroupRef(i, q) for i, q in enumerate(pages)]], 1, chunks, FakeCuda(),
                             staging_bytes=2 * 4 * slot_blocks * sum(pages))


def case_kernel_at_start():
    """The gather kernel is loaded when a worker starts, not at its first launch (loading code may
    wait for the device: at a first submit it waited out the model's step). Run first in a process."""
    assert counter("fake_modules", ctypes.c_longlong) == 0
    core = _fresh_core()
    assert counter("fake_modules", ctypes.c_longlong) == 1 and counter("fake_launches", ctypes.c_longlong) == 0
    core.submit(1, Direction.D2H, np.arange(4, dtype=np.int64), [4], [0], np.arange(4, dtype=np.int64), staged=True)
    core.wait([1])
    assert [r.success for r in core.poll()] == [True]
    assert counter("fake_modules", ctypes.c_longlong) == 1 and counter("fake_launches", ctypes.c_longlong) > 0
    core.shutdown()
    # an 80-layer model with K and V apart in two KV groups (160 tensors): every group's table in each
    # direction is on the device at the start, one per group and direction, and the kernel not loaded again
    from vllm_npu_offload.device_kv import DeviceKVTensor, GroupRef
    from vllm_npu_offload.offload_worker import OffloadWorkerCore

    kv = [torch.zeros((8, 64), dtype=torch.uint8) for _ in range(160)]
    big = OffloadWorkerCore([DeviceKVTensor.from_block_view(t) for t in kv],
                            [[GroupRef(i, 64) for i in range(g, 160, 2)] for g in range(2)], 1, 8, FakeCuda(),
                            staging_bytes=2 * 3 * 160 * 64)
    fused = big.stager._fused
    assert sorted(len(p.pairs) for p, _, _ in fused._tables.values()) == [80] * 4, fused._tables
    assert counter("fake_modules", ctypes.c_longlong) == 1
    big.shutdown()
    print("kernel_at_start ok")


def case_no_binary():
    src = torch.arange(64, dtype=torch.uint8)
    dst = torch.zeros(64, dtype=torch.uint8)
    try:
        NativeGatherPath(FakeCuda(), [64]).copy(np.array([src.data_ptr()]), np.array([dst.data_ptr()]),
                                                np.array([64]), Direction.D2H, None)
    except CopyError as e:
        assert "cuModuleLoadData" in str(e) and "CUDA_ERROR_NO_BINARY_FOR_GPU" in str(e), e
        assert "NPU_OFFLOAD_CUDA_ARCHS" in str(e)
    else:
        raise AssertionError("a missing binary was not reported")
    try:  # a staged worker loads the kernel when it starts: it refuses to start, naming why
        _fresh_core()
    except CopyError as e:
        assert "cuModuleLoadData" in str(e) and "NPU_OFFLOAD_CUDA_ARCHS" in str(e), e
    else:
        raise AssertionError("a worker started without a kernel binary")
    print("no_binary ok")


def case_not_built():
    from vllm_npu_offload.copy import cuda_paths

    assert not load_library().built_gather
    try:
        NativeGatherPath(FakeCuda(), [64])
    except ImportError as e:
        assert "without the gather kernel" in str(e)
    try:
        local, link = cuda_paths.staged_cuda(FakeCuda(), [4096])
        assert local.name == "sm_local", local.name  # triton installed: the fallback gather
    except ImportError as e:
        assert "native gather kernel" in str(e) and "triton" in str(e)
    print("not_built ok")


if __name__ == "__main__":
    for name in sys.argv[2:]:
        globals()[f"case_{name}"]()
