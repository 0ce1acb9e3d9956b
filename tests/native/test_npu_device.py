"""Real Ascend NPU: byte-exact round trips through NPUDmaCopyBackend (acl_batch, acl_loop), and
the device->device gather/scatter of staged copies (acl_batch_local, acl_loop_local).

Skipped unless torch_npu imports, an NPU is visible and csrc_npu was built
(`python csrc_npu/build.py`). Run by scripts/npu_check.sh on an Ascend machine.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from vllm_npu_offload._native import library_path
from vllm_npu_offload.copy.base import Direction


def _npu_ready() -> str:
    if importlib.util.find_spec("torch_npu") is None:
        return "torch_npu is not installed"
    try:
        import torch_npu  # noqa: F401

        if not torch.npu.is_available():
            return "no NPU visible"
    except Exception as e:  # torch_npu without CANN fails at import
        return f"torch_npu does not load: {e}"
    if library_path("npu_offload_acl") is None:
        return "libnpu_offload_acl.so is not built (python csrc_npu/build.py)"
    return ""


REASON = _npu_ready()
pytestmark = [pytest.mark.npu, pytest.mark.skipif(bool(REASON), reason=REASON or "ok")]
PATHS = ["acl_batch", "acl_loop"]


@pytest.fixture(scope="module")
def platform():
    from vllm_npu_offload.platform import get_platform

    return get_platform("npu")


def _backend(platform, name):
    from vllm_npu_offload._native import acl
    from vllm_npu_offload.copy.backend import BackendChoice, NPUDmaCopyBackend

    if name == "acl_batch" and acl.build_mode() != "batch":
        pytest.skip("library built with VLLM_ASCEND_ENABLE_BATCH_MEMCPY=0")
    if name == "acl_batch" and not acl.batch_form()[0]:
        pytest.skip(f"batch API not exported by this CANN: {acl.batch_form()[1]}")
    return NPUDmaCopyBackend(platform, [], BackendChoice(name, name))


def _slots(rng, sizes):
    perm = rng.permutation(len(sizes))
    starts = np.concatenate(([0], np.cumsum(sizes[perm] + 32)[:-1]))
    off = np.empty(len(sizes), np.int64)
    off[perm] = starts
    return off


@pytest.mark.parametrize("name", PATHS)
@pytest.mark.parametrize("sizes", [[4096] * 64, [1, 3, 511, 4097, 28 * 1024, 65537, 2 << 20]])
def test_round_trip_both_directions(platform, name, sizes):
    backend = _backend(platform, name)
    rng = np.random.default_rng(len(sizes))
    sizes = np.asarray(sizes, np.int64)
    total = int(sizes.sum() + 32 * len(sizes))
    src = torch.from_numpy(rng.integers(0, 256, total, dtype=np.uint8)).pin_memory()
    back = torch.zeros(total, dtype=torch.uint8).pin_memory()
    dev = torch.zeros(total, dtype=torch.uint8, device=platform.device)
    h_off, d_off = _slots(rng, sizes), _slots(np.random.default_rng(7), sizes)
    stream = platform.new_stream()
    stream.wait_stream(platform.current_stream())  # dev is zeroed on the compute stream
    backend.copy(src.data_ptr() + h_off, dev.data_ptr() + d_off, sizes, Direction.H2D, stream)
    backend.copy(dev.data_ptr() + d_off, back.data_ptr() + h_off, sizes, Direction.D2H, stream)
    stream.synchronize()
    mask = torch.zeros(total, dtype=torch.bool)
    for o, n in zip(h_off.tolist(), sizes.tolist()):
        mask[o : o + n] = True
    assert torch.equal(back[mask], src[mask]) and not back[~mask].any()


def test_exact_pinning_with_host_register(platform):
    t = torch.zeros(5 * 4096 + 123, dtype=torch.uint8)
    assert platform.pin(t), "aclrtHostRegisterV2 failed (CANN >= 8.5 and kernel > 5.10 needed)"
    platform.unpin(t)


@pytest.mark.parametrize("name", PATHS)
def test_worker_core_ascend_layout(platform, name):
    """Per-layer (K, V) and MLA (512, 64) tuples on the NPU, through OffloadWorkerCore."""
    from kv_arena import build_worker_core

    nb, bs = 8, 128
    dt, dv = torch.bfloat16, platform.device
    caches = {
        "l0": (torch.randn(nb, bs, 4, 128, dtype=dt, device=dv), torch.randn(nb, bs, 4, 128, dtype=dt, device=dv)),
        "l1": (torch.randn(nb, bs, 1, 512, dtype=dt, device=dv), torch.randn(nb, bs, 1, 64, dtype=dt, device=dv)),
    }
    backend = _backend(platform, name)
    core = build_worker_core(caches, nb, 1, 16, backend=backend)
    try:
        ref = {k: [t.cpu() for t in v] for k, v in caches.items()}
        ids = np.array([6, 1, 2, 3], np.int64)
        platform.synchronize()
        core.submit(1, Direction.D2H, ids, [4], [0], np.array([9, 4, 5, 6]))
        core.wait([1])
        for v in caches.values():
            for t in v:
                t.zero_()
        platform.synchronize()
        core.submit(2, Direction.H2D, ids, [4], [0], np.array([9, 4, 5, 6]))
        core.wait([2])
        platform.synchronize()
        for k, v in caches.items():
            for t, r in zip(v, ref[k]):
                assert torch.equal(t.cpu()[ids].view(torch.uint8), r[ids].view(torch.uint8))
    finally:
        core.shutdown()


def _aligned_slots(rng, sizes, align=64):
    """Shuffled, gapped, ``align``-aligned offsets (aclrtMemcpyAsync D2D needs 64-byte addresses)."""
    spans = (sizes + align - 1) // align * align + align
    perm = rng.permutation(len(sizes))
    starts = np.concatenate(([0], np.cumsum(spans[perm])[:-1]))
    off = np.empty(len(sizes), np.int64)
    off[perm] = starts
    return off, int(spans.sum())


@pytest.mark.parametrize("name", PATHS)
def test_staged_d2d_gather_scatter(platform, name):
    """Store: gather device pages D2D into a device staging buffer, 3 large D2H copies; load: 3 large
    H2D copies into staging, scatter D2D into other pages. Byte-exact, untouched bytes stay zero."""
    from vllm_npu_offload.copy import acl_copy, npu_paths

    backend = _backend(platform, name)  # skips where the batch path is unusable
    local = acl_copy.AclCopyPath(platform, batch=name == "acl_batch", device_local=True)
    assert npu_paths.local_path(platform).name.endswith("_local")
    rng = np.random.default_rng(17)
    sizes = np.array([1, 63, 64, 4097, 28 * 1024, 65537, 256 << 10] * 4, np.int64)
    kv_off, kv_bytes = _aligned_slots(rng, sizes)
    new_off, _ = _aligned_slots(np.random.default_rng(18), sizes)
    st_spans = (sizes + 63) // 64 * 64
    st_off = np.concatenate(([0], np.cumsum(st_spans)[:-1])).astype(np.int64)
    st_bytes = int(st_spans.sum())
    edges = np.linspace(0, st_bytes, 4).astype(np.int64)
    big_off, big_sizes = edges[:-1], np.diff(edges)

    def dev_zeros(n):  # 64-byte aligned start, whatever the allocator's alignment
        t = torch.zeros(n + 64, dtype=torch.uint8, device=platform.device)
        skip = -t.data_ptr() % 64
        return t[skip : skip + n]

    src = torch.from_numpy(rng.integers(0, 256, kv_bytes, dtype=np.uint8))
    kv = dev_zeros(kv_bytes)
    kv.copy_(src)
    staging, staging2, kv2 = dev_zeros(st_bytes), dev_zeros(st_bytes), dev_zeros(kv_bytes)
    host = torch.zeros(st_bytes, dtype=torch.uint8).pin_memory()
    stream = platform.new_stream()
    stream.wait_stream(platform.current_stream())  # kv/staging are written on the compute stream
    local.copy(kv.data_ptr() + kv_off, staging.data_ptr() + st_off, sizes, Direction.D2H, stream)
    backend.copy(staging.data_ptr() + big_off, host.data_ptr() + big_off, big_sizes, Direction.D2H, stream)
    backend.copy(host.data_ptr() + big_off, staging2.data_ptr() + big_off, big_sizes, Direction.H2D, stream)
    local.copy(staging2.data_ptr() + st_off, kv2.data_ptr() + new_off, sizes, Direction.H2D, stream)
    stream.synchronize()
    out = kv2.cpu()
    mask = torch.zeros(kv_bytes, dtype=torch.bool)
    for a, b, s, n in zip(kv_off.tolist(), new_off.tolist(), st_off.tolist(), sizes.tolist()):
        assert torch.equal(host[s : s + n], src[a : a + n]) and torch.equal(out[b : b + n], src[a : a + n])
        mask[b : b + n] = True
    assert not out[~mask].any()


def test_staged_pipeline_round_trip(platform, monkeypatch):
    """A staged store then load through OffloadWorkerCore on the NPU, more slices than slots, each
    transfer planned and enqueued by one native call (npu_offload_acl_staged_submit, ACL slot
    events): byte-exact both ways."""
    from vllm_npu_offload import staging
    from vllm_npu_offload.copy.npu_pipeline import AclStagedPipeline
    from vllm_npu_offload.device_kv import DeviceKVTensor, GroupRef
    from vllm_npu_offload.offload_worker import OffloadWorkerCore

    monkeypatch.setenv("NPU_OFFLOAD_STAGED", "1")
    monkeypatch.setattr(staging, "MIN_SLOT_BYTES", 0)
    monkeypatch.setattr(staging, "MIN_SLICE_BYTES", 0)
    pages, nb, bpc, n = [64 << 10, 64 << 10, 16 << 10], 64, 2, 21
    rng = np.random.default_rng(1)
    kv = [torch.from_numpy(rng.integers(0, 256, (nb, p), dtype=np.uint8)).to(platform.device) for p in pages]
    core = OffloadWorkerCore([DeviceKVTensor.from_block_view(t) for t in kv],
                             [[GroupRef(i, p) for i, p in enumerate(pages)]], bpc, 32, platform,
                             staging_bytes=2 * 3 * bpc * sum(pages))  # 3 slots of one chunk per direction
    try:
        assert isinstance(core.stager._fused, AclStagedPipeline) and core.stager.plans_natively
        ref = [t.cpu() for t in kv]
        ids = rng.choice(nb, n, replace=False).astype(np.int64)
        chunks = rng.choice(32, -(-(n + 1) // bpc), replace=False).astype(np.int64)  # from sub-block 1
        platform.synchronize()
        core.submit(1, Direction.D2H, ids, [n], [1], chunks)
        core.wait([1])
        assert [(r.success, r.error) for r in core.poll()] == [(True, None)]
        for t in kv:
            t.zero_()
        platform.synchronize()
        back = rng.permutation(nb)[:n].astype(np.int64)
        core.submit(2, Direction.H2D, back, [n], [1], chunks)
        core.wait([2])
        assert [(r.success, r.error) for r in core.poll()] == [(True, None)]
        platform.synchronize()
        for t, r in zip(kv, ref):
            assert torch.equal(t.cpu()[back], r[ids])
    finally:
        core.shutdown()
