"""Build helpers for the NPU tests: fetch torch-npu's ACL headers once, compile csrc_npu.

Also the fixtures the emulation tests share (import them into a test module to use them):
``built`` (the library in every toggle mode + the ACL emulation), ``emu`` (the emulation,
loaded and pointed at), ``lib_batch`` / ``lib_loop``, ``acl_path`` and ``fake_npu_platform``.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc_npu"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_csrc_npu_{name}", CSRC / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


build_mod = _load("build")
fetch_mod = _load("fetch_headers")


def acl_include() -> tuple[Path | None, str]:
    """Headers for the tests: $NPU_OFFLOAD_ACL_INCLUDE, else the fetched wheel headers (cached)."""
    explicit = os.environ.get("NPU_OFFLOAD_ACL_INCLUDE")
    if explicit and (Path(explicit) / "acl" / "acl_rt.h").exists():
        return Path(explicit), ""
    try:
        return fetch_mod.fetch_headers(), ""
    except Exception as e:  # no network / no pip: the tests skip with this reason
        return None, f"ACL headers unavailable (torch-npu {fetch_mod.TORCH_NPU_VERSION} wheel could not be fetched): {e}"


def build_into(out: Path, include: Path, toggle: str | None, env: dict | None = None) -> Path:
    """Compile libnpu_offload_acl.so with VLLM_ASCEND_ENABLE_BATCH_MEMCPY=toggle (None = unset)."""
    saved = {k: os.environ.get(k) for k in ("VLLM_ASCEND_ENABLE_BATCH_MEMCPY", "NPU_OFFLOAD_ACL_INCLUDE",
                                            "ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH")}
    try:
        for k in ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH", "VLLM_ASCEND_ENABLE_BATCH_MEMCPY"):
            os.environ.pop(k, None)
        os.environ["NPU_OFFLOAD_ACL_INCLUDE"] = str(include)
        if toggle is not None:
            os.environ["VLLM_ASCEND_ENABLE_BATCH_MEMCPY"] = toggle
        os.environ.update(env or {})
        build_mod.build(CSRC, out, required=True)
        return out / build_mod.LIBRARY
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


INCLUDE, SKIP_REASON = acl_include()
STREAM = 0x5EED  # any non-null aclrtStream: the emulation only records it


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """({toggle: library path} for toggle 1, 0 and unset, emulation path)."""
    root = tmp_path_factory.mktemp("npu_build")
    libs = {t: build_into(root / f"mode_{t}", INCLUDE, t) for t in ("1", "0", None)}
    emu_path = build_mod.build_emulation(CSRC, root / "emu", INCLUDE)
    return libs, emu_path


@pytest.fixture(scope="module")
def emu(built):
    """The emulation's test controls; NPU_OFFLOAD_ACL_LIBRARY points at it for the module."""
    _, emu_path = built
    os.environ["NPU_OFFLOAD_ACL_LIBRARY"] = str(emu_path)
    lib = ctypes.CDLL(str(emu_path))
    lib.acl_emu_set_fail_at.argtypes = [ctypes.c_longlong]
    lib.acl_emu_count.restype = ctypes.c_longlong
    lib.acl_emu_count.argtypes = [ctypes.c_char_p]
    lib.acl_emu_last_stream.restype = ctypes.c_void_p
    lib.acl_emu_log.restype = ctypes.c_char_p
    yield lib
    os.environ.pop("NPU_OFFLOAD_ACL_LIBRARY", None)


@pytest.fixture
def lib_batch(built, emu):
    from vllm_npu_offload._native import acl

    lib = acl.load_library(built[0]["1"])
    acl.set_batch_form(0, lib)
    emu.acl_emu_reset()
    yield lib
    acl.set_batch_form(0, lib)


@pytest.fixture
def lib_loop(built, emu):
    from vllm_npu_offload._native import acl

    emu.acl_emu_reset()
    return acl.load_library(built[0]["0"])


def acl_path(kind: str, lib_batch, lib_loop, device_local: bool = False, max_batch: int = 0):
    """An AclCopyPath: kind "batch" (failIndex form), "batch_v2" or "loop"; ``max_batch``: descriptors
    per batch call (0: all)."""
    from vllm_npu_offload._native import acl
    from vllm_npu_offload.copy import acl_copy

    if kind == "loop":
        return acl_copy.AclCopyPath(None, batch=False, lib=lib_loop, device_local=device_local)
    acl.set_batch_form({"batch": 1, "batch_v2": 2}[kind], lib_batch)
    return acl_copy.AclCopyPath(None, batch=True, lib=lib_batch, device_local=device_local, max_batch=max_batch)


def fake_npu_platform():
    """A CPU platform posing as 'npu' (the npu chooser and backends run; streams are STREAM)."""
    from vllm_npu_offload.platform import CpuPlatform

    class FakeNpu(CpuPlatform):
        kind = "npu"

        def raw_stream_handle(self, stream) -> int:
            return STREAM

    return FakeNpu()


PAGES = [4096, 4096, 1024, 3072]  # K/V pairs and unequal MLA-like parts, 64-byte multiples
GROUPS = {1: [[0, 1, 2, 3]], 2: [[0, 1], [2, 3]]}  # KV group -> its tensors
BPC, SLOTS = 2, 3


def staged_core(built, monkeypatch, toggle: str, groups: int, seed: int = 0):
    """A worker core on the emulation, library built with ``toggle``: staging always on, 3 slots
    of one host chunk (2 blocks) per direction; (core, device KV tensors, group refs, rng)."""
    import numpy as np
    import torch

    from vllm_npu_offload import staging
    from vllm_npu_offload.device_kv import DeviceKVTensor, GroupRef
    from vllm_npu_offload.offload_worker import OffloadWorkerCore

    libs, _ = built
    monkeypatch.setenv("NPU_OFFLOAD_NATIVE_DIR", str(Path(libs[toggle]).parent))
    monkeypatch.setenv("NPU_OFFLOAD_STAGED", "1")
    monkeypatch.setattr(staging, "MIN_SLOT_BYTES", 0)
    monkeypatch.setattr(staging, "MIN_SLICE_BYTES", 0)
    platform = fake_npu_platform()
    monkeypatch.setattr(type(platform), "device", property(lambda self: torch.device("cpu")))
    rng = np.random.default_rng(seed)
    # torch.empty is 64-byte aligned, as aclrtMemcpyAsync device-to-device copies require (numpy is not)
    kv = [torch.empty(40, p, dtype=torch.uint8).copy_(torch.from_numpy(rng.integers(0, 256, (40, p), dtype=np.uint8)))
          for p in PAGES]
    refs = [[GroupRef(i, PAGES[i]) for i in tensors] for tensors in GROUPS[groups]]
    core = OffloadWorkerCore([DeviceKVTensor.from_block_view(t) for t in kv], refs, BPC, 24, platform,
                             staging_bytes=2 * SLOTS * BPC * sum(PAGES))
    assert core.stager.geometry.slots == SLOTS
    return core, kv, refs, rng
