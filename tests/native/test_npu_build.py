"""csrc_npu on a CPU-only machine: compiled against torch-npu's ACL headers in every toggle
mode, then run against the ACL emulation (csrc_npu/acl_emulation.c, a test double)."""

from __future__ import annotations

import ctypes
import shutil

import numpy as np
import pytest

from _npu_build_support import (  # noqa: F401  (fixtures: built, emu, lib_batch, lib_loop)
    INCLUDE,
    SKIP_REASON,
    STREAM,
    acl_path as _path,
    build_into,
    build_mod,
    built,
    fake_npu_platform,
    emu,
    lib_batch,
    lib_loop,
)

from vllm_npu_offload._native import acl

from vllm_npu_offload.copy import acl_copy
from vllm_npu_offload.copy.base import Direction
from vllm_npu_offload.errors import CopyError

pytestmark = pytest.mark.skipif(INCLUDE is None, reason=SKIP_REASON)


def _scatter(rng, sizes, pool_bytes):
    """Offsets of non-overlapping slots for ``sizes`` (same order), laid out in shuffled order with gaps."""
    sizes = np.asarray(sizes, np.int64)
    perm = rng.permutation(len(sizes))
    gaps = rng.integers(0, 64, len(sizes))
    starts = np.concatenate(([0], np.cumsum(sizes[perm] + gaps)[:-1]))
    off = np.empty(len(sizes), np.int64)
    off[perm] = starts
    assert (off + sizes).max() <= pool_bytes
    return off, sizes


# -- build ---------------------------------------------------------------------------------
def test_toggle_selects_mode(built):
    libs, _ = built
    modes = {t: acl.build_mode(acl.load_library(p)) for t, p in libs.items()}
    assert modes == {"1": "batch", "0": "loop", None: "batch"}  # unset: the headers have the API
    info = acl.load_library(libs["1"]).npu_offload_acl_build_info().decode()
    assert "aclrtMemcpyBatchAsync" in info and "aclrtHostRegisterV2" in info


def test_library_has_no_link_time_acl_dependency(built):
    import subprocess

    out = subprocess.run(["nm", "-D", "--undefined-only", str(built[0]["1"])], capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("nm not available")
    assert "aclrt" not in out.stdout


@pytest.fixture(scope="module")
def headers_without_batch(tmp_path_factory):
    """A copy of the headers in which aclrtMemcpyBatchAsync(V2) are not declared."""
    root = tmp_path_factory.mktemp("old_headers")
    shutil.copytree(INCLUDE / "acl", root / "acl")
    (root / "acl" / "acl_rt.h").rename(root / "acl" / "acl_rt_real.h")
    (root / "acl" / "acl_rt.h").write_text(
        "#define aclrtMemcpyBatchAsync hidden_batch_v1\n#define aclrtMemcpyBatchAsyncV2 hidden_batch_v2\n"
        '#include "acl_rt_real.h"\n#undef aclrtMemcpyBatchAsync\n#undef aclrtMemcpyBatchAsyncV2\n'
    )
    return root


def test_toggle_1_fails_clearly_without_batch_api(headers_without_batch, tmp_path):
    with pytest.raises(build_mod.BuildFailed, match="VLLM_ASCEND_ENABLE_BATCH_MEMCPY=1 but .* declare neither"):
        build_into(tmp_path, headers_without_batch, "1")


def test_unset_toggle_probes_to_loop_without_batch_api(headers_without_batch, tmp_path):
    lib = acl.load_library(build_into(tmp_path, headers_without_batch, None))
    assert acl.build_mode(lib) == "loop"


def test_bad_toggle_value_is_named(tmp_path):
    with pytest.raises(build_mod.BuildFailed, match="'yes' is not allowed"):
        build_into(tmp_path, INCLUDE, "yes")


def test_no_headers_raises_toolkit_missing(monkeypatch, tmp_path):
    for k in ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH"):
        monkeypatch.setenv(k, str(tmp_path / "nothing"))
    monkeypatch.setenv("NPU_OFFLOAD_ACL_INCLUDE", str(tmp_path / "nothing"))
    monkeypatch.setattr(build_mod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(build_mod.ToolkitMissing, match="no ACL headers .*ASCEND_TOOLKIT_HOME"):
        build_mod.find_acl_include()


# -- copies against the emulation ----------------------------------------------------------
@pytest.mark.parametrize("kind", ["batch", "batch_v2", "loop"])
@pytest.mark.parametrize("direction", [Direction.H2D, Direction.D2H])
def test_round_trip_byte_exact(kind, direction, lib_batch, lib_loop, emu):
    rng = np.random.default_rng(int(direction) * 10 + len(kind))
    sizes = [1, 3, 7, 64, 4095, 4096, 4097, 65543, 2, 131071]
    a = rng.integers(0, 256, 1 << 19, dtype=np.uint8)
    b = np.zeros_like(a)
    c = np.zeros_like(a)
    s_off, sz = _scatter(rng, sizes, len(a))
    d_off, _ = _scatter(np.random.default_rng(99), sz, len(b))
    path = _path(kind, lib_batch, lib_loop)
    fwd = (a.ctypes.data + s_off, b.ctypes.data + d_off)
    path.copy(fwd[0].astype(np.int64), fwd[1].astype(np.int64), sz, direction, STREAM)
    back = Direction.D2H if direction is Direction.H2D else Direction.H2D
    path.copy((b.ctypes.data + d_off).astype(np.int64), (c.ctypes.data + s_off).astype(np.int64), sz, back, STREAM)
    mask = np.zeros(len(a), bool)
    for o, n in zip(s_off, sz):
        mask[o : o + n] = True
    assert np.array_equal(c[mask], a[mask]) and not c[~mask].any()
    assert emu.acl_emu_last_stream() == STREAM
    name = {"batch": b"aclrtMemcpyBatchAsync", "batch_v2": b"aclrtMemcpyBatchAsyncV2", "loop": b"aclrtMemcpyAsync"}
    assert emu.acl_emu_count(name[kind]) == (2 if kind != "loop" else 2 * len(sizes))


def test_batch_and_loop_agree(lib_batch, lib_loop):
    rng = np.random.default_rng(7)
    sizes = rng.integers(1, 5000, 300)
    src = rng.integers(0, 256, 1 << 21, dtype=np.uint8)
    outs = []
    for kind in ("batch", "loop"):
        dst = np.zeros_like(src)
        s_off, sz = _scatter(np.random.default_rng(1), sizes, len(src))
        d_off, _ = _scatter(np.random.default_rng(2), sz, len(dst))
        _path(kind, lib_batch, lib_loop).copy(
            (src.ctypes.data + s_off).astype(np.int64), (dst.ctypes.data + d_off).astype(np.int64), sz,
            Direction.H2D, STREAM)
        outs.append(dst)
    assert np.array_equal(outs[0], outs[1]) and outs[0].any()


def _descs(n, size=16):
    a = np.arange(n * size, dtype=np.uint8)
    b = np.zeros_like(a)
    off = np.arange(n, dtype=np.int64) * size
    return a, b, (a.ctypes.data + off).astype(np.int64), (b.ctypes.data + off).astype(np.int64), np.full(n, size, np.int64)


@pytest.mark.parametrize("k", [0, 5, 11])
def test_injected_failure_reports_index(k, lib_batch, lib_loop, emu):
    a, b, s, d, z = _descs(12)
    emu.acl_emu_set_fail_at(k)
    with pytest.raises(acl.AclCopyError) as e:
        _path("batch", lib_batch, lib_loop).copy(s, d, z, Direction.H2D, STREAM)
    assert (e.value.call, e.value.index, e.value.fail_index) == ("aclrtMemcpyBatchAsync", k, k)
    assert e.value.acl_code == 507000 and f"failIndex {k}" in str(e.value) and "injected failure" in str(e.value)
    assert not b.any()  # the batch was rejected as a whole

    emu.acl_emu_reset()
    emu.acl_emu_set_fail_at(k)
    with pytest.raises(CopyError) as e:
        _path("loop", lib_batch, lib_loop).copy(s, d, z, Direction.D2H, STREAM)
    assert (e.value.call, e.value.index) == ("aclrtMemcpyAsync", k)
    assert np.array_equal(b[: k * 16], a[: k * 16]) and not b[k * 16 :].any()  # copies before k were issued


def test_v2_failure_has_no_fail_index(lib_batch, lib_loop, emu):
    a, b, s, d, z = _descs(8)
    emu.acl_emu_set_fail_at(3)
    with pytest.raises(acl.AclCopyError) as e:
        _path("batch_v2", lib_batch, lib_loop).copy(s, d, z, Direction.H2D, STREAM)
    assert e.value.call == "aclrtMemcpyBatchAsyncV2" and e.value.index is None and e.value.fail_index is None
    assert "descriptors 0..7" in str(e.value)


def test_chunked_batches_offset_fail_index(lib_batch, lib_loop, emu):
    a, b, s, d, z = _descs(10)
    path = _path("batch", lib_batch, lib_loop, max_batch=3)
    path.copy(s, d, z, Direction.H2D, STREAM)
    assert np.array_equal(a, b) and emu.acl_emu_count(b"aclrtMemcpyBatchAsync") == 4
    emu.acl_emu_reset()
    emu.acl_emu_set_fail_at(7)
    with pytest.raises(acl.AclCopyError) as e:
        path.copy(s, d, z, Direction.H2D, STREAM)
    assert (e.value.index, e.value.fail_index) == (7, 7)


def test_device_id_reaches_the_batch_attribute(lib_batch, lib_loop, emu):
    a, b, s, d, z = _descs(4)
    emu.acl_emu_set_device(3)  # the emulation rejects attributes whose device id differs
    _path("batch", lib_batch, lib_loop).copy(s, d, z, Direction.D2H, STREAM)
    assert np.array_equal(a, b)


def test_bad_arguments_are_named(lib_batch, lib_loop):
    a, b, s, d, z = _descs(4)
    err = acl.AclError()
    rc = lib_batch.npu_offload_acl_copy_batch(s.ctypes.data, d.ctypes.data, z.ctypes.data, 4, 3, STREAM, 0,
                                              ctypes.byref(err))
    assert rc == acl.BAD_ARGUMENT and b"direction 3 is not allowed" in err.message
    path = _path("loop", lib_batch, lib_loop)
    with pytest.raises(ValueError, match="descriptor 1 has size 0"):
        path.copy(s, d, np.array([4, 0, 4, 4], np.int64), Direction.H2D, STREAM)
    with pytest.raises(TypeError, match="int64"):
        path.copy(s.astype(np.uint64), d, z, Direction.H2D, STREAM)
    with pytest.raises(CopyError, match=r"descriptor 2 is invalid"):
        path.copy(s, np.array([d[0], d[1], 0, d[3]], np.int64), z, Direction.H2D, STREAM)


def test_loop_build_has_no_batch_path(lib_loop):
    with pytest.raises(acl.AclCopyError, match="batch path was not built") as e:
        acl_copy.AclCopyPath(None, batch=True, lib=lib_loop).copy(*_descs(2)[2:], Direction.H2D, STREAM)
    assert e.value.status == acl.NOT_BUILT


def test_host_register_pins_page_aligned_range(built, emu):
    lib = acl.load_library(built[0]["1"])
    buf = np.zeros(3 * 4096 + 100, np.uint8)
    ptr = buf.ctypes.data + 10  # unaligned on purpose: the library widens to whole pages
    err = acl.AclError()
    assert lib.npu_offload_acl_host_register(ptr, 5000, ctypes.byref(err)) == 0, err.message
    assert lib.npu_offload_acl_host_unregister(ptr, ctypes.byref(err)) == 0, err.message
    assert emu.acl_emu_count(b"aclrtHostRegisterV2") == 1


def test_missing_libascendcl_is_named(built, tmp_path, monkeypatch):
    # A private copy of the library has its own (not yet loaded) ACL state.
    copy = tmp_path / "libnpu_offload_acl.so"
    shutil.copy(built[0]["1"], copy)
    lib = acl.load_library(copy)
    monkeypatch.setenv("NPU_OFFLOAD_ACL_LIBRARY", str(tmp_path / "absent" / "libascendcl.so"))
    for batch in (True, False):
        with pytest.raises(acl.AclCopyError, match=r"cannot load the Ascend runtime library .*libascendcl.so") as e:
            acl_copy.AclCopyPath(None, batch=batch, lib=lib).copy(*_descs(2)[2:], Direction.H2D, STREAM)
        assert e.value.call == "dlopen" and e.value.status == acl.MISSING
    assert "cannot load" in acl.probe(lib)


def test_chooser_and_backend_with_emulation(built, emu, monkeypatch):
    """The npu chooser and NPUDmaCopyBackend end to end, on a CPU platform posing as 'npu'."""
    from vllm_npu_offload.copy.backend import NPUDmaCopyBackend
    from vllm_npu_offload.copy import npu_paths

    plat = fake_npu_platform()
    for toggle, expect in (("1", "acl_batch"), ("0", "acl_loop")):
        monkeypatch.setenv("NPU_OFFLOAD_NATIVE_DIR", str(built[0][toggle].parent))
        assert npu_paths.choose(plat, []).load == expect
        backend = NPUDmaCopyBackend(plat, [])
        assert backend.choice.load == backend.choice.store == expect
        a, b, s, d, z = _descs(5, 33)
        backend.copy(s, d, z, Direction.H2D, plat.new_stream())
        assert np.array_equal(a, b)
    monkeypatch.setenv("NPU_OFFLOAD_NATIVE_DIR", str(built[0]["1"].parent))
    monkeypatch.setenv("NPU_OFFLOAD_ACL_LIBRARY", "/nonexistent/libascendcl.so")  # already loaded: no effect
    assert npu_paths.choose(plat, []).load == "acl_batch"


def test_info_command_reports_mode(built, emu):
    import os
    import subprocess
    import sys

    env = dict(os.environ, NPU_OFFLOAD_NATIVE_DIR=str(built[0]["0"].parent), NPU_OFFLOAD_DEVICE="cpu")
    out = subprocess.run([sys.executable, "-m", "vllm_npu_offload", "info"], capture_output=True, text=True,
                         env=env, check=True).stdout
    assert "version" in out and "device" in out and "cpu" in out
    assert "mode=loop" in out and "ACL library resolved" in out


def test_info_providers_are_extensible():
    from vllm_npu_offload import info

    info.register_info_provider("test line", lambda: "hello")
    info.register_info_provider("broken", lambda: 1 / 0)
    try:
        text = info.format_info()
        assert "hello" in text and "ZeroDivisionError" in text
    finally:
        del info.PROVIDERS[-2:]
