"""Device->device (direction 2) copies of csrc_npu, against the ACL emulation: the gather /
scatter half of staged transfers (device KV pages <-> a device staging buffer)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from _npu_build_support import (  # noqa: F401  (fixtures: built, emu, lib_batch, lib_loop)
    INCLUDE,
    SKIP_REASON,
    STREAM,
    acl_path,
    built,
    emu,
    fake_npu_platform,
    lib_batch,
    lib_loop,
)

from vllm_npu_offload._native import acl

from vllm_npu_offload.copy import acl_copy
from vllm_npu_offload.copy.base import Direction
from vllm_npu_offload.errors import CopyError

pytestmark = pytest.mark.skipif(INCLUDE is None, reason=SKIP_REASON)
KINDS = ["batch", "batch_v2", "loop"]
ALIGN = 64  # aclrtMemcpyAsync D2D needs 64-byte aligned addresses (acl_rt.h)
MAX_PAGE = 256 << 10


def _pool(nbytes: int, fill=None) -> np.ndarray:
    """A 64-byte aligned byte array (random when ``fill`` is a Generator, else zeros)."""
    raw = fill.integers(0, 256, nbytes + ALIGN, dtype=np.uint8) if fill is not None else np.zeros(nbytes + ALIGN, np.uint8)
    skip = -raw.ctypes.data % ALIGN
    return raw[skip : skip + nbytes]


def _round_up(x, a=ALIGN):
    return (np.asarray(x, np.int64) + a - 1) // a * a


def _slots(rng, sizes) -> tuple[np.ndarray, int]:
    """Aligned, non-overlapping offsets for ``sizes`` in shuffled order with gaps; (offsets, pool bytes)."""
    perm = rng.permutation(len(sizes))
    spans = _round_up(sizes[perm]) + ALIGN * rng.integers(0, 3, len(sizes))
    starts = np.concatenate(([0], np.cumsum(spans)[:-1]))
    off = np.empty(len(sizes), np.int64)
    off[perm] = starts
    return off, int(spans.sum())


def _packed(sizes) -> tuple[np.ndarray, int]:
    """Staging layout: pages back to back in transfer order, each start 64-byte aligned."""
    spans = _round_up(sizes)
    return np.concatenate(([0], np.cumsum(spans)[:-1])).astype(np.int64), int(spans.sum())


def _sizes(rng, n) -> np.ndarray:
    sizes = rng.integers(1, MAX_PAGE + 1, n).astype(np.int64)
    sizes[:4] = [1, MAX_PAGE, 63, 65]
    return sizes


def _ptrs(buf: np.ndarray, off: np.ndarray) -> np.ndarray:
    return (buf.ctypes.data + off).astype(np.int64)


def _mask(nbytes, off, sizes) -> np.ndarray:
    m = np.zeros(nbytes, bool)
    for o, n in zip(off.tolist(), sizes.tolist()):
        m[o : o + n] = True
    return m


def _pages_equal(a, a_off, b, b_off, sizes) -> bool:
    return all(np.array_equal(a[x : x + n], b[y : y + n]) for x, y, n in zip(a_off, b_off, sizes.tolist()))


def _chunks(total: int, parts: int) -> tuple[np.ndarray, np.ndarray]:
    """A few large descriptors covering [0, total): (offsets, sizes)."""
    edges = np.linspace(0, total, parts + 1).astype(np.int64)
    return edges[:-1], np.diff(edges)


# -- round trips ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_d2d_round_trip_random_sizes(kind, lib_batch, lib_loop, emu):
    rng = np.random.default_rng(len(kind))
    n = 160
    sizes = _sizes(rng, n)
    a_off, a_bytes = _slots(rng, sizes)
    b_off, b_bytes = _slots(rng, sizes)
    a, b, c = _pool(a_bytes, rng), _pool(b_bytes), _pool(a_bytes)
    path = acl_path(kind, lib_batch, lib_loop, device_local=True)
    assert path.name == ("acl_loop_local" if kind == "loop" else "acl_batch_local")
    # Direction is ignored by a device-local path: both copies go device->device.
    path.copy(_ptrs(a, a_off), _ptrs(b, b_off), sizes, Direction.H2D, STREAM)
    path.copy(_ptrs(b, b_off), _ptrs(c, a_off), sizes, Direction.D2H, STREAM)
    mask = _mask(a_bytes, a_off, sizes)
    assert np.array_equal(c[mask], a[mask]) and not c[~mask].any()
    assert not b[~_mask(b_bytes, b_off, sizes)].any()
    assert emu.acl_emu_count(b"d2d_copies") == 2 * n
    entry = {"batch": b"aclrtMemcpyBatchAsync", "batch_v2": b"aclrtMemcpyBatchAsyncV2", "loop": b"aclrtMemcpyAsync"}
    assert emu.acl_emu_count(entry[kind]) == (2 * n if kind == "loop" else 2)
    assert emu.acl_emu_last_stream() == STREAM


@pytest.mark.parametrize("toggle", ["1", "0", None])
def test_d2d_in_every_toggle_build(toggle, built, emu):
    """The loop entry point exists in every build; the batch one where the toggle built it."""
    lib = acl.load_library(built[0][toggle])
    emu.acl_emu_reset()
    rng = np.random.default_rng(5)
    sizes = _sizes(rng, 24)
    a_off, a_bytes = _slots(rng, sizes)
    b_off, b_bytes = _slots(rng, sizes)
    batch = acl.build_mode(lib) == "batch"
    for use_batch in {False, batch}:
        a, b = _pool(a_bytes, rng), _pool(b_bytes)
        acl_copy.AclCopyPath(None, batch=use_batch, lib=lib, device_local=True).copy(
            _ptrs(a, a_off), _ptrs(b, b_off), sizes, Direction.H2D, STREAM)
        assert _pages_equal(a, a_off, b, b_off, sizes)
    assert emu.acl_emu_count(b"d2d_copies") == len(sizes) * (1 + batch)


@pytest.mark.parametrize("kind", KINDS)
def test_staged_store_then_load(kind, lib_batch, lib_loop, emu):
    """Store: gather pages D2D into staging, then a few large D2H copies; load: a few large H2D
    copies into staging, then scatter D2D into other pages. Byte-exact against numpy."""
    rng = np.random.default_rng(11 + len(kind))
    sizes = _sizes(rng, 120)
    kv_off, kv_bytes = _slots(rng, sizes)
    st_off, st_bytes = _packed(sizes)
    kv = _pool(kv_bytes, rng)
    staging, host = _pool(st_bytes), _pool(st_bytes)
    local = acl_path(kind, lib_batch, lib_loop, device_local=True)
    dma = acl_path(kind, lib_batch, lib_loop)
    big_off, big_sizes = _chunks(st_bytes, 3)

    local.copy(_ptrs(kv, kv_off), _ptrs(staging, st_off), sizes, Direction.D2H, STREAM)  # gather
    dma.copy(_ptrs(staging, big_off), _ptrs(host, big_off), big_sizes, Direction.D2H, STREAM)
    assert _pages_equal(kv, kv_off, host, st_off, sizes)

    new_off, new_bytes = _slots(rng, sizes)
    kv2, staging2 = _pool(new_bytes), _pool(st_bytes)
    dma.copy(_ptrs(host, big_off), _ptrs(staging2, big_off), big_sizes, Direction.H2D, STREAM)
    local.copy(_ptrs(staging2, st_off), _ptrs(kv2, new_off), sizes, Direction.H2D, STREAM)  # scatter
    assert _pages_equal(kv, kv_off, kv2, new_off, sizes)
    assert not kv2[~_mask(new_bytes, new_off, sizes)].any()
    assert emu.acl_emu_count(b"d2d_copies") == 2 * len(sizes)


def test_device_id_reaches_the_d2d_attribute(lib_batch, lib_loop, emu):
    emu.acl_emu_set_device(5)  # the emulation rejects device locations with another id
    sizes = np.array([64, 1, 4096], np.int64)
    a, b = _pool(8192, np.random.default_rng(0)), _pool(8192)
    off = np.array([0, 128, 1024], np.int64)
    acl_path("batch", lib_batch, lib_loop, device_local=True).copy(_ptrs(a, off), _ptrs(b, off), sizes, 0, STREAM)
    assert _pages_equal(a, off, b, off, sizes)


# -- errors --------------------------------------------------------------------------------
def _raw_call(lib, batch: bool, src, dst, sizes, n, direction):
    err = acl.AclError()
    if batch:
        rc = lib.npu_offload_acl_copy_batch(src, dst, sizes, n, direction, STREAM, 0, ctypes.byref(err))
    else:
        rc = lib.npu_offload_acl_copy_loop(src, dst, sizes, n, direction, STREAM, ctypes.byref(err))
    return rc, err


@pytest.mark.parametrize("batch", [True, False])
def test_bad_direction_and_null_arrays_are_named(batch, lib_batch, lib_loop):
    lib = lib_batch if batch else lib_loop
    a, b = _pool(256), _pool(256)
    s, d, z = _ptrs(a, np.array([0])), _ptrs(b, np.array([0])), np.array([64], np.int64)
    rc, err = _raw_call(lib, batch, s.ctypes.data, d.ctypes.data, z.ctypes.data, 1, 3)
    assert rc == acl.BAD_ARGUMENT and err.call == b"argument"
    assert b"direction 3 is not allowed; use 0 (host->device), 1 (device->host) or 2 (device->device)" in err.message
    rc, err = _raw_call(lib, batch, None, d.ctypes.data, z.ctypes.data, 1, acl.D2D)
    assert rc == acl.BAD_ARGUMENT and b"must not be NULL (src=" in err.message
    assert not b.any()


@pytest.mark.parametrize("kind", KINDS)
def test_null_descriptor_address_says_d2d(kind, lib_batch, lib_loop):
    a, b = _pool(512), _pool(512)
    off = np.array([0, 64, 128], np.int64)
    dst = _ptrs(b, off)
    dst[1] = 0
    with pytest.raises(CopyError, match=r"_local D2D copy of 3 descriptors failed: descriptor 1 is invalid"):
        acl_path(kind, lib_batch, lib_loop, device_local=True).copy(
            _ptrs(a, off), dst, np.full(3, 64, np.int64), Direction.H2D, STREAM)


def test_loop_d2d_rejects_misaligned_addresses_before_copying(lib_batch, lib_loop, emu):
    a, b = _pool(1024, np.random.default_rng(1)), _pool(1024)
    src = _ptrs(a, np.array([0, 64, 200], np.int64))
    with pytest.raises(acl.AclCopyError, match="acl_loop_local D2D .*descriptor 2: .*64-byte aligned") as e:
        acl_path("loop", lib_batch, lib_loop, device_local=True).copy(
            src, _ptrs(b, np.array([0, 128, 256], np.int64)), np.full(3, 32, np.int64), Direction.D2H, STREAM)
    assert (e.value.status, e.value.index) == (acl.BAD_ARGUMENT, 2)
    assert not b.any() and emu.acl_emu_count(b"aclrtMemcpyAsync") == 0


def test_d2d_injected_failure_names_call_and_index(lib_batch, lib_loop, emu):
    rng = np.random.default_rng(3)
    sizes = _sizes(rng, 12)
    a_off, a_bytes = _slots(rng, sizes)
    b_off, b_bytes = _slots(rng, sizes)
    a, b = _pool(a_bytes, rng), _pool(b_bytes)
    emu.acl_emu_set_fail_at(7)
    with pytest.raises(acl.AclCopyError, match="acl_batch_local D2D copy of 12 descriptors failed") as e:
        acl_path("batch", lib_batch, lib_loop, device_local=True).copy(
            _ptrs(a, a_off), _ptrs(b, b_off), sizes, Direction.H2D, STREAM)
    assert (e.value.call, e.value.index, e.value.fail_index) == ("aclrtMemcpyBatchAsync", 7, 7)
    assert not b.any()


# -- the emulation itself: what it accepts as device->device -------------------------------
class _Loc(ctypes.Structure):
    _fields_ = [("id", ctypes.c_uint32), ("type", ctypes.c_int)]


class _Attr(ctypes.Structure):  # aclrtMemcpyBatchAttr: dstLoc first
    _fields_ = [("dstLoc", _Loc), ("srcLoc", _Loc), ("rsv", ctypes.c_uint8 * 16)]


HOST, DEVICE = 0, 1  # ACL_MEM_LOCATION_TYPE_*
INVALID_PARAM = 100000


def _emu_batch(emu, src_loc, dst_loc, a, b, size=256):
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    srcs, dsts = (vp * 1)(a.ctypes.data), (vp * 1)(b.ctypes.data)
    sizes, idx, fail = (sz * 1)(size), (sz * 1)(0), sz(0)
    attr = _Attr(dstLoc=_Loc(*dst_loc), srcLoc=_Loc(*src_loc))
    rc = emu.aclrtMemcpyBatchAsync(dsts, sizes, srcs, sizes, sz(1), ctypes.byref(attr), idx, sz(1),
                                   ctypes.byref(fail), vp(STREAM))
    emu.aclGetRecentErrMsg.restype = ctypes.c_char_p
    return rc, emu.aclGetRecentErrMsg()


@pytest.mark.parametrize("src_loc,dst_loc", [
    ((0, HOST), (0, HOST)),        # host -> host
    ((2, DEVICE), (1, HOST)),      # a host end that is not host id 0
    ((2, DEVICE), (3, DEVICE)),    # device -> another device
    ((3, DEVICE), (3, DEVICE)),    # device -> device, but not the current one
    ((2, DEVICE), (2, 2)),         # device -> unregistered
])
def test_emulation_rejects_bad_d2d_locations(src_loc, dst_loc, emu):
    emu.acl_emu_reset()
    emu.acl_emu_set_device(2)
    a, b = _pool(256, np.random.default_rng(0)), _pool(256)
    rc, msg = _emu_batch(emu, src_loc, dst_loc, a, b)
    assert rc == INVALID_PARAM and b"inconsistent src/dst locations" in msg and not b.any()
    rc, _ = _emu_batch(emu, (2, DEVICE), (2, DEVICE), a, b)  # the same call, device 2 -> device 2
    assert rc == 0 and np.array_equal(a, b) and emu.acl_emu_count(b"d2d_copies") == 1


def test_emulation_d2d_memcpy_checks_alignment_and_overlap(emu):
    emu.acl_emu_reset()
    emu.aclGetRecentErrMsg.restype = ctypes.c_char_p
    buf = _pool(1024, np.random.default_rng(2))
    d2d = 3  # ACL_MEMCPY_DEVICE_TO_DEVICE
    call = lambda dst, src, n: emu.aclrtMemcpyAsync(ctypes.c_void_p(dst), ctypes.c_size_t(n), ctypes.c_void_p(src),
                                                   ctypes.c_size_t(n), d2d, ctypes.c_void_p(STREAM))
    p = buf.ctypes.data
    assert call(p + 512, p + 8, 64) == INVALID_PARAM and b"64-byte aligned" in emu.aclGetRecentErrMsg()
    assert call(p + 64, p, 128) == INVALID_PARAM and b"overlapping" in emu.aclGetRecentErrMsg()
    want = buf[:256].copy()
    assert call(p + 512, p, 256) == 0 and np.array_equal(buf[512:768], want)


# -- local_path ----------------------------------------------------------------------------
def test_local_path_follows_choose(built, emu, monkeypatch):
    from vllm_npu_offload.copy import npu_paths

    plat = fake_npu_platform()
    for toggle, expect in (("1", "acl_batch"), ("0", "acl_loop"), (None, "acl_batch")):
        monkeypatch.setenv("NPU_OFFLOAD_NATIVE_DIR", str(built[0][toggle].parent))
        assert npu_paths.choose(plat, []).load == expect
        path = npu_paths.local_path(plat)
        assert path.name == expect + "_local" and path.device_local
        emu.acl_emu_reset()
        a, b = _pool(4096, np.random.default_rng(9)), _pool(4096)
        off = np.array([0, 1024, 2048], np.int64)
        path.copy(_ptrs(a, off), _ptrs(b, off), np.array([1000, 1, 2048], np.int64), Direction.H2D, plat.new_stream())
        assert np.array_equal(a[:1000], b[:1000]) and b[1024] == a[1024] and np.array_equal(a[2048:], b[2048:])
        assert emu.acl_emu_count(b"d2d_copies") == 3
