"""device_kv.py: vLLM-Ascend-shaped per-layer KV (K/V tuples, MLA 512+64, 2 MiB-aligned slices
with non-zero storage offsets) -> descriptors, with byte-exact round trips on the CPU platform."""

import numpy as np
import pytest
import torch

from vllm_npu_offload.copy.base import Direction
from vllm_npu_offload.errors import OffloadConfigError
from vllm_npu_offload.device_kv import canonicalize
from vllm_npu_offload.plan import BlockLayout, CopyPlanner, TensorPair

from kv_arena import ALIGN, Arena, build_worker_core  # noqa: E402  (tests/ is on sys.path under pytest)

NB, BS = 6, 16  # device blocks, tokens per block


def ascend_caches(arena: Arena, dtype=torch.bfloat16):
    """Two ordinary layers (K, V of different head counts) and two MLA layers (512 + 64)."""
    return {
        "layers.0.attn": (arena.tensor((NB, BS, 2, 64), dtype), arena.tensor((NB, BS, 2, 64), dtype)),
        "layers.1.attn": (arena.tensor((NB, BS, 2, 64), dtype), arena.tensor((NB, BS, 1, 40), dtype)),
        "layers.2.mla": (arena.tensor((NB, BS, 1, 512), dtype), arena.tensor((NB, BS, 1, 64), dtype)),
        "layers.3.mla": [arena.tensor((NB, BS, 1, 512), dtype), arena.tensor((NB, BS, 1, 64), dtype)],
    }


def test_canonicalize_ascend_tuples():
    arena = Arena(8 * ALIGN)
    caches = ascend_caches(arena)
    lay = canonicalize(caches, NB)
    assert len(lay.tensors) == 8 and list(lay.layer_refs) == list(caches)
    k, v = caches["layers.1.attn"]
    rk, rv = lay.layer_refs["layers.1.attn"]
    assert lay.tensors[rk.tensor_idx].base == k.data_ptr()  # data_ptr includes the storage offset
    assert (rk.page_bytes, rv.page_bytes) == (BS * 2 * 64 * 2, BS * 40 * 2)
    nope, rope = lay.layer_refs["layers.2.mla"]
    assert (nope.page_bytes, rope.page_bytes) == (BS * 512 * 2, BS * 64 * 2)
    assert all(t.block_stride == t.page_bytes for t in lay.tensors)
    assert k.untyped_storage().nbytes() % NB != 0  # sized from shape/stride, not from storage


def test_stacked_kv_is_split_and_shared_tensors_dedup():
    kv = torch.randn(2, NB, BS, 4, 8)
    lay = canonicalize({"a": kv, "b": kv, "c": (kv[0], kv[1])}, NB)
    assert len(lay.tensors) == 2
    assert [t.base for t in lay.tensors] == [kv[0].data_ptr(), kv[1].data_ptr()]
    assert lay.layer_refs["a"] == lay.layer_refs["b"] == lay.layer_refs["c"]
    assert len(lay.group_refs()) == 2


def test_kernel_blocks_merge_into_logical_blocks():
    t = torch.zeros(NB * 4, 8, 2, 16, dtype=torch.float16)
    (d,) = canonicalize({"l": t}, NB).tensors
    assert (d.num_blocks, d.block_stride, d.page_bytes) == (NB, 4 * 8 * 2 * 16 * 2, 4 * 8 * 2 * 16 * 2)


def test_padded_block_stride_is_kept():
    big = torch.zeros(NB, BS * 2 * 64 + 128, dtype=torch.float16)
    t = big[:, : BS * 2 * 64].view(NB, BS, 2, 64)
    (d,) = canonicalize({"l": t}, NB).tensors
    assert d.block_stride == (BS * 2 * 64 + 128) * 2 and d.page_bytes == BS * 2 * 64 * 2


@pytest.mark.parametrize(
    "value, match",
    [
        (torch.zeros(NB, BS, 8)[:, :, :4], "non-contiguous per-block payload"),
        (torch.zeros(BS, NB, 4, 8).transpose(0, 1), "non-contiguous"),
        (torch.zeros(NB + 1, BS), "leading dimension must be num_blocks=6"),
        ((), "non-empty tuple/list"),
        ("k", "allowed: a tensor"),
        (torch.zeros(NB, 4).as_strided((NB, 4), (2, 1)), "smaller than the block payload"),
    ],
)
def test_bad_layouts_name_the_problem(value, match):
    with pytest.raises(OffloadConfigError, match=match):
        canonicalize({"layers.9": value}, NB)


def test_planner_round_trip_byte_exact():
    arena = Arena(8 * ALIGN)
    caches = ascend_caches(arena)
    lay = canonicalize(caches, NB)
    hosts = [torch.zeros(NB * 2, t.page_bytes, dtype=torch.uint8) for t in lay.tensors]
    ref = [s.clone() for s in lay.sources]

    def pairs(direction):
        out = []
        for d, h in zip(lay.tensors, hosts):
            dev = BlockLayout(d.base, d.block_stride, d.num_blocks)
            host = BlockLayout(h.data_ptr(), h.stride(0), h.shape[0])
            out.append(TensorPair(dev, host, d.page_bytes) if direction == "store" else TensorPair(host, dev, d.page_bytes))
        return out

    import ctypes

    def run(descs):
        for s, d, n in zip(descs.src.tolist(), descs.dst.tolist(), descs.sizes.tolist()):
            ctypes.memmove(d, s, n)

    dev_ids, host_ids = np.array([4, 1, 2, 3]), np.array([7, 0, 1, 2])
    run(CopyPlanner(pairs("store")).plan(dev_ids, host_ids))
    for s in lay.sources:
        s.zero_()
    run(CopyPlanner(pairs("load")).plan(host_ids, dev_ids))
    for s, r in zip(lay.sources, ref):
        assert torch.equal(s[dev_ids].view(torch.uint8), r[dev_ids].view(torch.uint8))
        untouched = [i for i in range(NB) if i not in dev_ids]
        assert not s[untouched].view(torch.uint8).any()  # zeroed blocks stay zero
    assert arena.outside_untouched()


@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
def test_worker_core_round_trip_byte_exact(blocks_per_chunk):
    arena = Arena(8 * ALIGN)
    caches = ascend_caches(arena)
    core = build_worker_core(caches, NB, blocks_per_chunk, num_chunks=8)
    try:
        sources = canonicalize(caches, NB).sources
        ref = [s.clone() for s in sources]
        ids = np.array([5, 0, 3, 4], dtype=np.int64)
        chunks = np.arange(-(-len(ids) // blocks_per_chunk), dtype=np.int64) + 1
        core.submit(1, Direction.D2H, ids, [len(ids)], [0], chunks)
        core.wait([1])
        for s in sources:
            s.zero_()
        core.submit(2, Direction.H2D, ids, [len(ids)], [0], chunks)
        core.wait([2])
        results = {r.job_id: r for r in core.poll()}
        assert all(r.success for r in results.values())
        for s, r in zip(sources, ref):
            assert torch.equal(s[ids].view(torch.uint8), r[ids].view(torch.uint8))
        assert arena.outside_untouched()
    finally:
        core.shutdown()


def test_worker_core_groups_by_layer_name():
    arena = Arena(8 * ALIGN)
    caches = ascend_caches(arena)
    core = build_worker_core(caches, NB, 1, 4, groups=[["layers.0.attn", "layers.1.attn"], ["layers.2.mla", "layers.3.mla"]])
    try:
        assert core.num_groups == 2
        with pytest.raises(OffloadConfigError, match="not one of the KV layers"):
            build_worker_core(caches, NB, 1, 4, groups=[["nope"]])
    finally:
        core.shutdown()


def test_a_permuted_dense_block_payload_is_one_page():
    """vLLM 0.23's TRITON_ATTN on an H200 keeps a layer as (blocks, 2, heads, tokens, dim) in memory
    and hands a (blocks, 2, tokens, heads, dim) view; Ascend-style K/V halves of it have per-block
    payloads in (heads, tokens, dim) order: one gap-free run each, so one page per block."""
    heads, dim = 4, 8
    layer = torch.arange(NB * 2 * heads * BS * dim, dtype=torch.float32).view(NB, 2, heads, BS, dim)
    view = layer.permute(0, 1, 3, 2, 4)  # (NB, 2, BS, heads, dim), not contiguous
    lay = canonicalize({"l": (view[:, 0], view[:, 1])}, NB)
    page = BS * heads * dim * 4
    assert [(t.block_stride, t.page_bytes) for t in lay.tensors] == [(2 * page, page), (2 * page, page)]
    assert lay.tensors[1].base - lay.tensors[0].base == page


def test_a_descriptor_keeps_its_memory_alive():
    """Copies reach KV by address: a worker core built from descriptors of tensors the caller then drops
    (a test helper did, and the copies wrote into freed heap) must still copy into live memory. The
    descriptor holds its tensor; a round trip after every other reference is gone is byte-exact."""
    import gc
    import weakref

    from vllm_npu_offload.device_kv import DeviceKVTensor, GroupRef
    from vllm_npu_offload.offload_worker import OffloadWorkerCore
    from vllm_npu_offload.platform import CpuPlatform

    pages = [512, 256]
    kv = [torch.randint(0, 256, (8, q), dtype=torch.uint8) for q in pages]
    want = [t.clone() for t in kv]
    refs = [weakref.ref(t) for t in kv]
    desc = [DeviceKVTensor.from_block_view(t) for t in kv]
    desc += canonicalize({"l": kv[0]}, 8).tensors
    del kv
    gc.collect()
    assert all(r() is not None for r in refs), "a descriptor let its tensor go"
    assert [d.base for d in desc[:2]] == [r().data_ptr() for r in refs] and desc[2].owner is not None
    core = OffloadWorkerCore(desc[:2], [[GroupRef(i, q) for i, q in enumerate(pages)]], 1, 8, CpuPlatform())
    try:
        blocks = np.arange(8, dtype=np.int64)
        core.submit(1, Direction.D2H, blocks, [8], [0], blocks)
        core.wait([1])
        for r in refs:
            r().zero_()
        core.submit(2, Direction.H2D, blocks, [8], [0], blocks)
        core.wait([2])
        assert [x.success for x in core.poll()] == [True, True]
        assert all(torch.equal(r(), w) for r, w in zip(refs, want))
    finally:
        core.shutdown()
    assert DeviceKVTensor(0, 8, 1, 8) == DeviceKVTensor(0, 8, 1, 8, owner=object()), "owner is not part of equality"
