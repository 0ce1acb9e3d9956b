"""OffloadWorkerCore: vLLM's (group sizes, block indices, chunks) mapping, byte-exact, on the CPU platform."""

import numpy as np
import pytest
import torch

from vllm_npu_offload.copy.base import Direction
from vllm_npu_offload.errors import OffloadConfigError
from vllm_npu_offload.host_layout import HostLayout
from vllm_npu_offload.memory import HostKVBuffer
from vllm_npu_offload.device_kv import DeviceKVTensor, GroupRef
from vllm_npu_offload.offload_worker import OffloadWorkerCore
from vllm_npu_offload.platform import CpuPlatform


def make_core(bpc, pages=(96, 40), padded=(96, 48), num_blocks=32, num_chunks=20, groups=None, threaded=False):
    rng = np.random.default_rng(bpc)
    tensors = [torch.from_numpy(rng.integers(0, 256, (num_blocks, p), dtype=np.uint8)) for p in padded]
    dev = [DeviceKVTensor.from_block_view(t) for t in tensors]
    refs = groups or [[GroupRef(i, pages[i]) for i in range(len(pages))]]
    core = OffloadWorkerCore(dev, refs, bpc, num_chunks, CpuPlatform(threaded_streams=threaded))
    return core, tensors


def run(core, job, direction, dev_ids, sizes, indices, chunks):
    core.submit(job, direction, np.array(dev_ids), sizes, indices, np.array(chunks))
    core.wait([job])
    res = core.poll()
    assert [r.job_id for r in res] == [job] and res[0].success, res
    return res[0]


@pytest.mark.parametrize("threaded", [False, True])
@pytest.mark.parametrize("bpc", [1, 2, 4])
def test_store_then_load_round_trip(bpc, threaded):
    core, tensors = make_core(bpc, threaded=threaded)
    # 7 device blocks starting at logical block index 1 of the request -> skip 1 sub-block when bpc > 1
    dev_ids = [5, 9, 2, 30, 31, 0, 17]
    skip = 1 % bpc
    n_chunks = -(-(len(dev_ids) + skip) // bpc)
    chunks = [11, 3, 7, 19, 0, 14, 8][:n_chunks]
    original = [t.clone() for t in tensors]
    r = run(core, 1, Direction.D2H, dev_ids, [7], [1], chunks)
    assert r.num_bytes == 7 * (96 + 40)
    for t in tensors:
        t.fill_(0xEE)  # poison the device
    back = [3, 4, 10, 11, 12, 25, 26]
    run(core, 2, Direction.H2D, back, [7], [1], chunks)
    for t, o, page in zip(tensors, original, (96, 40)):
        assert torch.equal(t[back][:, :page], o[dev_ids][:, :page])
        others = np.setdiff1d(np.arange(32), back)
        assert (t[others] == 0xEE).all()
    # host placement: sub-block j of chunk c is host block c*bpc + j
    host0 = core.host_view(0)
    expanded = (np.array(chunks)[:, None] * bpc + np.arange(bpc)).ravel()[skip : skip + 7]
    assert torch.equal(host0[expanded][:, :96], original[0][dev_ids][:, :96])
    core.shutdown()


def test_two_groups_each_with_own_refs():
    groups = [[GroupRef(0, 96)], [GroupRef(1, 40)]]
    core, tensors = make_core(2, groups=groups)
    original = [t.clone() for t in tensors]
    # group 0: 3 blocks from logical index 0 (2 chunks); group 1: 2 blocks from index 3 (skip 1 -> 2 chunks)
    run(core, 1, Direction.D2H, [1, 2, 3, 10, 11], [3, 2], [0, 3], [4, 5, 6, 7])
    for t in tensors:
        t.zero_()
    run(core, 2, Direction.H2D, [20, 21, 22, 23, 24], [3, 2], [0, 3], [4, 5, 6, 7])
    assert torch.equal(tensors[0][[20, 21, 22]][:, :96], original[0][[1, 2, 3]][:, :96])
    assert torch.equal(tensors[1][[23, 24]][:, :40], original[1][[10, 11]][:, :40])
    assert (tensors[0][[23, 24]] == 0).all() and (tensors[1][[20, 21, 22]] == 0).all()


def test_bad_transfers_raise_and_leak_nothing():
    core, _ = make_core(1)
    free_before = core.pool.num_free
    with pytest.raises(ValueError, match="host chunk id out of range"):
        core.submit(1, Direction.D2H, np.array([1]), [1], [0], np.array([20]))
    with pytest.raises(ValueError, match="do not add up"):
        core.submit(1, Direction.D2H, np.array([1, 2]), [1], [0], np.array([0]))
    with pytest.raises(ValueError, match="src block id 32 out of range"):
        core.submit(1, Direction.D2H, np.array([32]), [1], [0], np.array([0]))
    with pytest.raises(ValueError, match="1 KV groups"):
        core.submit(1, Direction.D2H, np.array([1]), [1, 0], [0, 0], np.array([0]))
    assert core.pool.num_free >= free_before
    assert core.engine.in_flight() == 0


@pytest.mark.parametrize("bpc", [1, 2])  # 1: the split's one-group fast path (matching counts); 2: the loop
def test_host_chunk_count_must_match_the_blocks(bpc):
    core, _ = make_core(bpc)
    need = -(-3 // bpc)
    with pytest.raises(ValueError, match=f"group 0 needs {need} host chunks, transfer gives {need - 1}$"):
        core.submit(1, Direction.D2H, np.array([1, 2, 3]), [3], [0], np.arange(need - 1))
    with pytest.raises(ValueError, match=f"transfer gives {need + 1} host chunks but its groups use {need}$"):
        core.submit(1, Direction.D2H, np.array([1, 2, 3]), [3], [0], np.arange(need + 1))
    with pytest.raises(ValueError, match="transfer gives 1 host chunks but its groups use 0$"):
        core.submit(1, Direction.D2H, np.array([], np.int64), [0], [0], np.array([4]))
    assert core.split_groups(np.array([], np.int64), [0], [0], np.array([], np.int64)) == []
    (g, dev, host), = core.split_groups(np.array([7, 8, 9]), [3], [0], np.arange(10, 10 + need))
    assert g == 0 and dev.tolist() == [7, 8, 9]
    assert host.tolist() == ([10, 11, 12] if bpc == 1 else [20, 21, 22])
    assert core.engine.in_flight() == 0


def test_host_memory_is_exact_and_block_first():
    lay = HostLayout.build([4096, 18432, 2048], blocks_per_chunk=4, num_chunks=250)  # K/V, MLA parts
    exact = (4096 + 18432 + 2048) * 1000
    assert lay.nbytes == exact  # no padding for KV-sized pages
    assert lay.page_offsets == (0, 4096, 22528) and lay.chunk_bytes == 4 * lay.record_bytes
    assert lay.num_blocks == 1000 and lay.group_span([1, 2]) == (4096, 24576)
    odd = HostLayout.build([1000, 24], blocks_per_chunk=1, num_chunks=10)
    assert odd.page_offsets == (0, 1024) and odd.record_bytes == 1088  # 64-byte aligned pages
    buf = HostKVBuffer(CpuPlatform(), lay.nbytes)
    assert buf.tensor.nbytes == buf.nbytes == lay.nbytes
    assert "NUMA" in buf.numa.describe()
    with pytest.raises(OffloadConfigError, match="positive size"):
        HostKVBuffer(CpuPlatform(), 0)
    with pytest.raises(OffloadConfigError, match="positive"):
        HostLayout.build([0], 1, 4)
    with pytest.raises(OffloadConfigError, match="num_chunks must be > 0"):
        HostLayout.build([16], 1, 0)


class _RegisteringPlatform(CpuPlatform):
    """A CPU platform that page-locks the way CUDA does (cudaHostRegister by address): what is registered."""

    def __init__(self):
        super().__init__()
        self.registered: dict[int, int] = {}

    @property
    def pin_memory_available(self) -> bool:
        return True

    def pin(self, tensor) -> bool:
        assert tensor.data_ptr() not in self.registered, "part or all of the range is already registered"
        self.registered[tensor.data_ptr()] = tensor.nbytes
        return True

    def unpin(self, tensor) -> None:
        del self.registered[tensor.data_ptr()]


def test_host_memory_dropped_unshut_is_unregistered_before_it_is_freed():
    """A host buffer dropped without ``release`` (a worker never shut down, as after an exception) is
    unregistered while its memory is still its own, once; a released one is not unregistered again.
    (On a GPU, a failed test's core left its range registered: the next allocation there failed to
    register and its copies failed.)"""
    import gc

    platform = _RegisteringPlatform()
    buf = HostKVBuffer(platform, 1 << 20)
    assert buf.pinned and platform.registered == {buf.base: 1 << 20}
    del buf
    gc.collect()
    assert platform.registered == {}
    again = HostKVBuffer(platform, 1 << 20)  # may take the same range: registers cleanly
    again.release()
    assert platform.registered == {} and not again.pinned
    del again
    gc.collect()  # the finalizer ran at release: no second unregister (it would raise KeyError)
    assert platform.registered == {}


def test_core_rejects_zero_chunks():
    with pytest.raises(OffloadConfigError, match="num_chunks must be > 0"):
        make_core(1, num_chunks=0)
