"""The whole staged path of the worker core on the Ascend code path, against the ACL emulation:
block-first host records, ACL device-to-device gather/scatter into staging, and chunk-sized
``aclrtMemcpyBatchAsync`` (or per-copy) link copies, byte-exact, for both build toggles.
("Device" memory is host memory in the emulation; the platform is a CPU platform posing as npu.)"""

from __future__ import annotations

import pytest

from _npu_build_support import INCLUDE, PAGES, SKIP_REASON, built, emu, staged_core  # noqa: F401  (fixtures)
from staged_round_trip import store_then_load

pytestmark = pytest.mark.skipif(INCLUDE is None, reason=SKIP_REASON)


@pytest.mark.parametrize("toggle", ["1", "0"])
def test_staged_round_trip_through_acl(built, emu, monkeypatch, toggle):
    emu.acl_emu_reset()
    core, kv, _, rng = staged_core(built, monkeypatch, toggle, 1, seed=int(toggle) + 3)
    names = (core.stager.local_path.name, core.stager.link_path.name)
    assert names == (("acl_batch_local", "acl_batch") if toggle == "1" else ("acl_loop_local", "acl_loop"))
    assert type(core.stager._fused).__name__ == "AclStagedPipeline"  # slices enqueued by one native call
    store_then_load(core, kv, rng)
    # Every page went device<->staging as a D2D copy; the link copies were far fewer.
    assert emu.acl_emu_count(b"d2d_copies") == 2 * 15 * len(PAGES)
    core.shutdown()
