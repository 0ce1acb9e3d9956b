"""The disk tier through the installed vLLM's real Scheduler and OffloadingConnector (no model): a
prompt stored, pushed out of a host tier too small to keep it, then served again from disk, byte
for byte; on every release from 0.23 (the per-key lookup with a request context it needs)."""

import time

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from harness import BLOCK, HEAD, HEADS, LAYERS, NB, PAGE, PROMPT, Engine, block_bytes, kv_cache_config, parts_of, \
    stacked_caches, vllm_config  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector  # noqa: E402

from vllm_npu_offload.copy.base import Direction  # noqa: E402
from vllm_npu_offload.errors import OffloadConfigError  # noqa: E402
from vllm_npu_offload.integration import compat  # noqa: E402
from vllm_npu_offload.integration.tiered_manager import TieredManager  # noqa: E402

needs_tiers = pytest.mark.skipif(not compat.TIERS_SUPPORTED, reason="the disk tier needs vLLM >= 0.23")

BLOCKS = len(PROMPT) // BLOCK  # 6
OTHER = list(range(200, 300))  # another 6 blocks: pushes PROMPT out of a 6-chunk host tier


def run_until_done(eng: Engine, prompt, seconds: float = 20.0):
    eng.add(prompt)
    end = time.monotonic() + seconds
    while eng.sched.requests or eng.transfers_pending():
        assert time.monotonic() < end, "the request did not finish"
        eng.step()
        time.sleep(0.001)  # the tier's reads run on threads: let them


@needs_tiers
@pytest.mark.parametrize("ours", [False, True], ids=["OffloadingConnector", "NPUOffloadingConnector"])
def test_prompt_served_from_disk_byte_exact(tiny_model, tmp_path, ours):
    """With ``NPUOffloadingConnector`` the scheduler hands a new request's keys to the tier manager,
    which reads what is on disk into host before the request is looked up (prefetch, up to a quarter
    of host); the rest is read when the scheduler looks it up, as with vLLM's own connector."""
    extra = {"cpu_bytes_to_use": BLOCKS * PAGE * 2, "disk_path": str(tmp_path / "kv"),
             "disk_bytes_to_use": 64 << 20, "disk_admit": "all"}
    if ours:
        from vllm_npu_offload.integration.connector import NPUOffloadingConnector as cls

        vc = vllm_config(tiny_model, extra, "NPUOffloadingConnector", "vllm_npu_offload.integration.connector")
    else:
        cls, vc = OffloadingConnector, vllm_config(tiny_model, extra)
    kcc = kv_cache_config(NB, LAYERS, HEADS, HEAD, PAGE)
    caches = stacked_caches()
    eng = Engine.build(vc, kcc, caches, cls)
    assert isinstance(eng.manager, TieredManager)
    end = time.monotonic() + 10
    while not eng.manager.tier.up:  # the worker's tier server came up after the scheduler's tier
        assert time.monotonic() < end, "the scheduler's tier never reached the worker's"
        eng.manager.settle(0)
        time.sleep(0.01)
    parts = parts_of(caches)

    run_until_done(eng, PROMPT)
    stores = [j for j in eng.jobs if j.direction is Direction.D2H]
    stored_seq = [d for j in stores for d in j.device_blocks]
    assert len(stored_seq) == BLOCKS
    before = [p.clone() for p in parts]
    eng.manager.settle(10)
    assert eng.manager.tier.stats.stores == BLOCKS

    run_until_done(eng, OTHER)  # the host tier now holds OTHER only
    eng.manager.settle(10)
    for p in parts:
        p.zero_()
    eng.reset_device_prefix_cache()
    n = len(eng.jobs)
    run_until_done(eng, PROMPT)
    loads = [j for j in eng.jobs[n:] if j.direction is Direction.H2D]
    loaded_seq = [d for j in loads for d in j.device_blocks]
    assert len(loaded_seq) == BLOCKS, "PROMPT was not served from the tiers"
    assert eng.manager.tier.stats.hits == BLOCKS
    prefetched = eng.manager.tier.stats.prefetches
    assert (0 < prefetched <= eng.manager.prefetch_chunks) if ours else prefetched == 0, prefetched
    for k in range(BLOCKS):
        want = block_bytes(before, stored_seq[k])
        got = block_bytes(parts, loaded_seq[k])
        assert all(torch.equal(a, b) for a, b in zip(got, want)), f"block {k} differs after disk -> host -> device"
    eng.manager.shutdown()


@needs_tiers
@pytest.mark.parametrize("extra, match", [
    ({"disk_path": "/tmp/x"}, r"disk_bytes_to_use"),
    ({"disk_bytes_to_use": 1 << 30}, r"not 'disk_path'"),
    ({"disk_path": "/tmp/x", "disk_bytes_to_use": 1 << 30, "disk_admit": "sometimes"}, r"disk_admit"),
    ({"disk_path": "/tmp/x", "disk_bytes_to_use": 1 << 30, "disk_read_timeout_s": 0}, r"disk_read_timeout_s"),
    ({"disk_path": "/tmp/x", "disk_bytes_to_use": 1 << 30, "disk_read_queue_s": 6}, r"disk_read_queue_s.*below"),
    ({"disk_path": "/tmp/x", "disk_bytes_to_use": 1 << 30, "disk_read_queue_s": "1"}, r"disk_read_queue_s.*number"),
    ({"disk_path": "/proc/npu-offload-kv", "disk_bytes_to_use": 1 << 30}, r"\['disk_path'\].*cannot be used"),
    ({"disk_path": "/tmp/x", "disk_byte_to_use": 1}, r"did you mean 'disk_bytes_to_use'"),
])
def test_bad_disk_config_errors(tiny_model, extra, match):
    vc = vllm_config(tiny_model, {"cpu_bytes_to_use": BLOCKS * PAGE * 2, **extra})
    kcc = kv_cache_config(NB, LAYERS, HEADS, HEAD, PAGE)
    with pytest.raises(OffloadConfigError, match=match):
        Engine.build(vc, kcc, stacked_caches(), OffloadingConnector)


@pytest.mark.skipif(compat.TIERS_SUPPORTED, reason="this vLLM has what the disk tier needs")
def test_disk_tier_refused_before_023(tiny_model, tmp_path):
    vc = vllm_config(tiny_model, {"cpu_bytes_to_use": BLOCKS * PAGE * 2, "disk_path": str(tmp_path),
                                  "disk_bytes_to_use": 1 << 30})
    with pytest.raises(OffloadConfigError, match=r"\['disk_path'\]: the disk tier needs vLLM >= 0.23"):
        Engine.build(vc, kv_cache_config(NB, LAYERS, HEADS, HEAD, PAGE), stacked_caches(), OffloadingConnector)
