"""CPU CI for the CUDA backend: the library builds (batch and loop modes), loads
without a driver, runs against a fake libcuda.so.1 (both cuMemcpyBatchAsync ABIs,
chunking, access order, error reporting), and the Triton kernel is byte-exact under
the interpreter. Driver-dependent cases run in subprocesses: the library resolves
the driver once per process."""

from __future__ import annotations

import ctypes
import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parents[1] / "support"


def _load_builder():
    spec = importlib.util.spec_from_file_location("_csrc_cuda_build", ROOT / "csrc_cuda" / "build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


builder = _load_builder()


def _include():
    try:
        return builder.find_cuda_include()
    except builder.ToolkitMissing as e:
        pytest.skip(f"no CUDA toolkit: {e}")


def _has_real_driver() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def libs(tmp_path_factory):
    _include()
    out = {}
    for mode in ("1", "0"):  # batch + gather kernel (when nvcc is here) / loop, no kernel
        d = tmp_path_factory.mktemp(f"cuda_lib_{mode}")
        built = builder.build(ROOT / "csrc_cuda", d, required=True, batch=mode, gather=None if mode == "1" else "0")
        assert built == [str(d / builder.LIB_NAME)]
        out[mode] = d
    return out


@pytest.fixture(scope="module")
def fake_driver(tmp_path_factory):
    inc = _include()
    d = tmp_path_factory.mktemp("fake_cuda")
    so = d / "libcuda.so.1"
    cc = os.environ.get("CC", "cc")
    r = subprocess.run([cc, "-shared", "-fPIC", "-O2", f"-I{inc}", f"-I{ROOT / 'csrc_cuda'}", "-Wl,-soname,libcuda.so.1",
                        str(HERE / "cuda_fake" / "fake_libcuda.c"), "-o", str(so)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot compile the fake driver: {r.stderr}")
    return so


def _run(code: str, env: dict | None = None) -> str:
    e = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=e,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_build_modes(libs):
    for mode, d in libs.items():
        lib = ctypes.CDLL(str(d / builder.LIB_NAME))
        assert lib.npo_cuda_built_mode() == int(mode)
        assert lib.npo_cuda_abi_version() == 10


def test_bad_batch_flag_is_named(libs):
    with pytest.raises(ValueError, match="NPU_OFFLOAD_CUDA_BATCH_MEMCPY='2'"):
        builder.build(ROOT / "csrc_cuda", libs["1"], batch="2")


def test_missing_toolkit_raises_toolkit_missing(monkeypatch, tmp_path):
    for k in ("CUDA_HOME", "CUDA_PATH", "CUDA_ROOT"):
        monkeypatch.setenv(k, str(tmp_path))
    monkeypatch.setattr(builder, "_candidate_roots", lambda: [tmp_path])
    with pytest.raises(builder.ToolkitMissing, match="cuda.h not found"):
        builder.build(ROOT / "csrc_cuda", tmp_path / "out")


@pytest.mark.skipif(_has_real_driver(), reason="a real libcuda.so.1 is installed")
def test_loads_without_driver_and_reports_it(libs):
    out = _run("""
        import numpy as np
        from vllm_npu_offload._native.cuda import load_library
        from vllm_npu_offload.errors import CopyError
        lib = load_library()
        info = lib.describe()
        assert info["runtime"] == "unavailable" and "libcuda.so.1 not found" in info["error"], info
        a = np.ones(2, np.int64)
        try:
            lib.copy(a, a, a, 0, batch=True)
        except CopyError as e:
            assert "libcuda.so.1 not found" in str(e), e
            print("ok")
    """, {"NPU_OFFLOAD_NATIVE_DIR": str(libs["1"])})
    assert out.strip() == "ok"


FAKE_CASE = """
    import ctypes, numpy as np, sys
    fake = ctypes.CDLL({fake!r}, mode=ctypes.RTLD_GLOBAL)
    from vllm_npu_offload._native.cuda import load_library
    from vllm_npu_offload.copy.cuda_dma import CudaDmaCopyPath
    from vllm_npu_offload.copy.base import Direction
    from vllm_npu_offload.errors import CopyError
    from vllm_npu_offload.platform import get_platform
    counter = lambda name: ctypes.c_longlong.in_dll(fake, name).value
    lib = load_library()
    print(lib.describe()["runtime"])
    n = 40000
    src = np.random.default_rng(0).integers(0, 256, n * 8, dtype=np.uint8)
    perm = np.random.default_rng(1).permutation(n).astype(np.int64)
    s = src.ctypes.data + np.arange(n, dtype=np.int64) * 8
    z = np.full(n, 8, np.int64)
    plat = get_platform("cpu")  # only for raw_stream_handle: any nonzero handle
    path = CudaDmaCopyPath(plat, batch=True)
    for direction in (Direction.H2D, Direction.D2H):
        dst = np.zeros_like(src)
        calls0 = counter("fake_batch_calls")
        path.copy(s, dst.ctypes.data + perm * 8, z, direction, plat.new_stream())
        assert (dst.reshape(n, 8)[perm] == src.reshape(n, 8)).all()
        print(counter("fake_batch_calls") - calls0, counter("fake_max_batch"),
              ctypes.c_int.in_dll(fake, "fake_last_order").value)
    try:  # FAKE_CUDA_FAIL_AT counts descriptors over the process: 2 * n copied so far
        path.copy(s, dst.ctypes.data + perm * 8, z, Direction.D2H, plat.new_stream())
    except CopyError as e:
        print("error", e.call, e.index, e)
"""


@pytest.mark.parametrize("version,expect", [("13000", "batch_v2"), ("12080", "batch_v1"), ("12040", "loop")])
def test_fake_driver_batch(libs, fake_driver, version, expect):
    out = _run(FAKE_CASE.format(fake=str(fake_driver)),
               {"NPU_OFFLOAD_NATIVE_DIR": str(libs["1"]), "FAKE_CUDA_VERSION": version,
                "FAKE_CUDA_FAIL_AT": str(2 * 40000 + 20001)}).splitlines()
    assert out[0].startswith(expect)
    for line, order in ((out[1], 3), (out[2], 1)):  # loads ANY, stores STREAM
        calls, biggest, seen_order = map(int, line.split())
        if expect == "loop":
            assert calls == 0
        else:
            assert (calls, biggest, seen_order) == (3, 16384, order)  # 40000 in chunks of 16384
    assert out[3].startswith("error")
    if expect == "batch_v2":  # no failIdx: the first descriptor of the failing chunk is named
        assert " 16384 " in out[3] and "cuMemcpyBatchAsync_v2" in out[3]
    else:
        assert " 20001 " in out[3] and "CUDA_ERROR_INVALID_VALUE" in out[3] and "invalid argument" in out[3]


def test_loop_build_and_null_address(libs, fake_driver):
    out = _run(f"""
        import ctypes, numpy as np
        ctypes.CDLL({str(fake_driver)!r}, mode=ctypes.RTLD_GLOBAL)
        from vllm_npu_offload._native.cuda import load_library
        from vllm_npu_offload.errors import CopyError
        lib = load_library()
        print(lib.describe()["runtime"])
        buf = np.zeros(64, np.uint8)
        s = np.array([buf.ctypes.data, buf.ctypes.data, buf.ctypes.data], np.int64)
        for bad, fail_at in ((1, None), (None, 2)):
            s2 = s.copy()
            if bad is not None:
                s2[bad] = 0
            try:
                lib.copy(s2, s + 32, np.array([4, 4, 4]), 1, batch=True)
            except CopyError as e:
                print(e.index, e)
    """, {"NPU_OFFLOAD_NATIVE_DIR": str(libs["0"]), "FAKE_CUDA_FAIL_AT": "2"}).splitlines()
    assert out[0] == "loop"
    assert out[1].startswith("1 ") and "descriptor 1 is invalid" in out[1]  # rejected before the driver
    assert out[2].startswith("2 ") and "cuMemcpyAsync failed at descriptor 2" in out[2]


def test_transfer_streams_are_the_drivers_own(libs, fake_driver):
    """Transfer streams come from cuStreamCreateWithPriority, non-blocking, with the priority
    asked for, and are destroyed; a driver without the calls gets an error naming them."""
    out = _run(f"""
        import ctypes
        fake = ctypes.CDLL({str(fake_driver)!r}, mode=ctypes.RTLD_GLOBAL)
        from vllm_npu_offload._native.cuda import load_library
        lib = load_library()
        a, b = lib.create_stream(0), lib.create_stream(-1)
        n = ctypes.c_longlong.in_dll(fake, "fake_streams").value
        flags = ctypes.c_int.in_dll(fake, "fake_last_stream_flags").value
        prio = ctypes.c_int.in_dll(fake, "fake_last_stream_priority").value
        print(a != b and a != 0, n, flags, prio)
        lib.destroy_stream(a)
        lib.destroy_stream(b)
        lib.destroy_stream(0)  # nothing to destroy: no error
        print(ctypes.c_longlong.in_dll(fake, "fake_streams").value)
    """, {"NPU_OFFLOAD_NATIVE_DIR": str(libs["0"])}).splitlines()
    assert out == ["True 2 1 -1", "0"]  # CU_STREAM_NON_BLOCKING == 1


def _gather_cases(lib_dir, fake, *cases, env=None):
    r = subprocess.run([sys.executable, str(HERE / "cuda_fake" / "gather_cases.py"), str(fake), *cases],
                       capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=str(ROOT), NPU_OFFLOAD_NATIVE_DIR=str(lib_dir),
                                NPU_OFFLOAD_CACHE_DIR=str(lib_dir), **(env or {})))
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


needs_nvcc = pytest.mark.skipif(builder.find_nvcc() is None, reason="nvcc not found: no gather kernel to test")


@needs_nvcc
def test_gather_kernel_ranges_staged_and_errors(libs, fake_driver):
    """The kernel body (run on the CPU by the fake driver) copies exactly the selected descriptors;
    the launcher sizes the grid and lane groups; the worker core's staged path round-trips."""
    cases = ["ranges", "staged", "native_plan", "staged_groups", "staged_wide_first", "staged_one_slice",
             "staged_large_pages", "staged_load_inline", "staged_ordered", "staged_ids_checked", "submit_frames", "errors"]
    out = _gather_cases(libs["1"], fake_driver, *cases)
    assert out.split() == [w for c in cases for w in (c, "ok")]


@needs_nvcc
def test_gather_kernel_loads_when_a_worker_starts(libs, fake_driver):
    assert _gather_cases(libs["1"], fake_driver, "kernel_at_start").strip() == "kernel_at_start ok"


@needs_nvcc
def test_native_pipeline_link_failure_fails_the_job(libs, fake_driver):
    # the id upload, then the first slice's link copies: fail the 5th copy of the process
    out = _gather_cases(libs["1"], fake_driver, "staged_fail", env={"FAKE_CUDA_FAIL_AT": "4"})
    assert out.strip() == "staged_fail ok"


@needs_nvcc
def test_gather_kernel_missing_binary_is_named(libs, fake_driver):
    out = _gather_cases(libs["1"], fake_driver, "no_binary", env={"FAKE_CUDA_NO_BINARY": "1"})
    assert out.strip() == "no_binary ok"


def test_library_without_gather_kernel(libs, fake_driver):
    lib = ctypes.CDLL(str(libs["0"] / builder.LIB_NAME))
    assert lib.npo_cuda_gather_built() == 0
    assert _gather_cases(libs["0"], fake_driver, "not_built").strip() == "not_built ok"


def test_info_names_the_cuda_build_and_driver(libs, fake_driver):
    code = f"""
        import ctypes
        ctypes.CDLL({str(fake_driver)!r}, mode=ctypes.RTLD_GLOBAL)
        from vllm_npu_offload import info
        print(dict(info.collect())["native cuda (libnpu_offload_cuda)"])
    """
    with_kernel = _run(code, {"NPU_OFFLOAD_NATIVE_DIR": str(libs["1"])}).strip()
    if builder.find_nvcc() is not None:
        assert with_kernel == "batch build, gather kernel; driver: batch_v2 (CUDA 13 ABI)"
    loop = _run(code, {"NPU_OFFLOAD_NATIVE_DIR": str(libs["0"]), "FAKE_CUDA_VERSION": "12040"}).strip()
    assert loop == "loop build, no gather kernel (Triton gathers); driver: loop"


def test_gather_and_arch_flags_are_checked():
    with pytest.raises(ValueError, match="NPU_OFFLOAD_CUDA_GATHER='yes'"):
        builder.gather_mode("yes")
    with pytest.raises(ValueError, match="NPU_OFFLOAD_CUDA_ARCHS='70'"):
        builder.archs("70")
    assert builder.archs("90, 80") == [80, 90]


triton_missing = importlib.util.find_spec("triton") is None


@pytest.mark.skipif(triton_missing, reason="triton is not installed")
def test_sm_kernel_interpreter():
    r = subprocess.run([sys.executable, str(HERE / "sm_interp_cases.py"), "odd", "tiles", "ranges", "errors"], capture_output=True,
                       text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


def test_chooser_heuristic_and_missing_everything():
    from vllm_npu_offload.copy.cuda_paths import heuristic_choice

    assert heuristic_choice([32768], True, True).load == "sm"
    assert heuristic_choice([1 << 20], True, True).load == "dma"
    assert heuristic_choice([4096], True, False).store == "dma"
    assert heuristic_choice([1 << 20], False, True).store == "sm"
    with pytest.raises(RuntimeError, match="triton is not installed"):
        heuristic_choice([4096], False, False)


def test_chooser_measures_only_the_directions_asked(monkeypatch, tmp_path):
    """A core whose stores go staged asks only for the load's direct path: the store's
    calibration (16 MiB timed per path) is not run just to be replaced."""
    from types import SimpleNamespace

    from vllm_npu_offload import calibration
    from vllm_npu_offload.copy import cuda_paths
    from vllm_npu_offload.copy.base import Direction

    monkeypatch.setenv("NPU_OFFLOAD_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("NPU_OFFLOAD_CALIBRATE", "1")
    monkeypatch.setattr(calibration, "_MEMO", {})
    monkeypatch.setattr(cuda_paths, "dma_available", lambda: None)
    monkeypatch.setattr(cuda_paths.sm_triton, "HAS_TRITON", True)
    monkeypatch.setattr(cuda_paths, "native_gather_built", lambda: False)
    measured = []
    monkeypatch.setattr(cuda_paths, "calibrate",
                        lambda platform, pages, d, names: measured.append(d) or {"choice": "dma", "gbps": {}})
    plat = SimpleNamespace(device_name=lambda: "fake-gpu")
    choice = cuda_paths.choose_cuda(plat, [4096], (Direction.H2D,))
    assert measured == [Direction.H2D]
    assert (choice.load, choice.store) == ("dma", "sm")  # the store keeps the heuristic's pick
    choice = cuda_paths.choose_cuda(plat, [8192], tuple(Direction))
    assert measured[1:] == [Direction.H2D, Direction.D2H] and (choice.load, choice.store) == ("dma", "dma")
