"""The whole staged path of the worker core on the Ascend code path, against the ACL emulation:
block-first host records, ACL device-to-device gather/scatter into staging, and chunk-sized
``aclrtMemcpyBatchAsync`` (or per-copy) link copies, byte-exact, for both build toggles.
("Device" memory is host memory in the emulation; the platform is a CPU platform posing as npu.)"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from _npu_build_support import INCLUDE, SKIP_REASON, built, emu, fake_npu_platform  # noqa: F401  (fixtures)
from staged_round_trip import store_then_load

from vllm_npu_offload import staging
from vllm_npu_offload.device_kv import DeviceKVTensor, GroupRef
from vllm_npu_offload.offload_worker import OffloadWorkerCore

pytestmark = pytest.mark.skipif(INCLUDE is None, reason=SKIP_REASON)


@pytest.mark.parametrize("toggle", ["1", "0"])
def test_staged_round_trip_through_acl(built, emu, monkeypatch, toggle):
    libs, _ = built
    monkeypatch.setenv("NPU_OFFLOAD_NATIVE_DIR", str(Path(libs[toggle]).parent))
    monkeypatch.setenv("NPU_OFFLOAD_STAGED", "1")
    monkeypatch.setattr(staging, "MIN_SLOT_BYTES", 0)
    monkeypatch.setattr(staging, "MIN_SLICE_BYTES", 0)
    emu.acl_emu_reset()
    platform = fake_npu_platform()
    monkeypatch.setattr(type(platform), "device", property(lambda self: torch.device("cpu")))
    rng = np.random.default_rng(int(toggle) + 3)
    pages = [4096, 4096, 1024, 3072]  # K/V pairs and unequal MLA-like parts, 64-byte multiples
    # torch.empty is 64-byte aligned, as aclrtMemcpyAsync device-to-device copies require (numpy is not)
    kv = [torch.empty(40, p, dtype=torch.uint8).copy_(torch.from_numpy(rng.integers(0, 256, (40, p), dtype=np.uint8)))
          for p in pages]
    dev = [DeviceKVTensor.from_block_view(t) for t in kv]
    bpc = 2
    record = sum(pages)
    core = OffloadWorkerCore(dev, [[GroupRef(i, p) for i, p in enumerate(pages)]], bpc, 24, platform,
                             staging_bytes=2 * 3 * bpc * record)
    names = (core.stager.local_path.name, core.stager.link_path.name)
    assert names == (("acl_batch_local", "acl_batch") if toggle == "1" else ("acl_loop_local", "acl_loop"))
    assert core.stager.geometry.slots == 3
    assert type(core.stager._fused).__name__ == "AclStagedPipeline"  # slices enqueued by one native call
    store_then_load(core, kv, rng)
    # Every page went device<->staging as a D2D copy; the link copies were far fewer.
    assert emu.acl_emu_count(b"d2d_copies") == 2 * 15 * len(pages)
    core.shutdown()
