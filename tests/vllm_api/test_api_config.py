"""Strict extra-config keys and the host-memory check on the vLLM 0.21-0.24 API (real vLLM 0.23.0
Scheduler + worker-role connectors, no model). Same checks as tests/test_config_strict.py.

NPUSimpleCPUOffloadConnector is checked here too (it runs on 0.23 as well, tests/v023/test_simple_v023.py)."""

import pytest

pytest.importorskip("vllm")

from extra_samples import SAMPLES  # noqa: E402
from harness import (  # noqa: E402
    HEAD,
    HEADS,
    LAYERS,
    NB,
    PAGE,
    PROMPT,
    Engine,
    kv_cache_config,
    stacked_caches,
    vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector  # noqa: E402

from vllm_npu_offload import host_limits  # noqa: E402
from vllm_npu_offload.errors import OffloadConfigError  # noqa: E402
from vllm_npu_offload.integration import compat, options  # noqa: E402
from vllm_npu_offload.integration.connector import NPUOffloadingConnector  # noqa: E402

TEN_TIB = 10 << 40
CONNECTORS = {
    "OffloadingConnector": (OffloadingConnector, {}),
    "NPUOffloadingConnector": (
        NPUOffloadingConnector,
        {"connector": "NPUOffloadingConnector", "module": "vllm_npu_offload.integration.connector"},
    ),
}
by_connector = pytest.mark.parametrize("name", list(CONNECTORS))


def build(tiny_model, name: str, extra: dict) -> Engine:
    cls, kw = CONNECTORS[name]
    kcc = kv_cache_config(NB, LAYERS, HEADS, HEAD, PAGE)
    return Engine.build(vllm_config(tiny_model, extra, **kw), kcc, stacked_caches(), cls)


def test_key_lists_are_the_023_ones():
    assert compat.API == "handlers"
    assert set(compat.OFFLOADING_KEYS) == {
        "spec_name", "spec_module_path", "offload_prompt_only", "block_size", "cpu_bytes_to_use",
        "eviction_policy", "store_threshold", "max_tracker_size",
    }
    assert set(compat.OFFLOADING_KEYS) | set(options.SPEC_KEYS) <= set(SAMPLES)


@by_connector
def test_misspelt_key_is_rejected_with_the_nearest_key(tiny_model, name):
    with pytest.raises(OffloadConfigError) as err:
        build(tiny_model, name, {"cpu_byte_to_use": 256 << 20})
    msg = str(err.value)
    assert "unknown key for NPUOffloadingSpec on vLLM 0.23" in msg
    assert "'cpu_byte_to_use' (did you mean 'cpu_bytes_to_use'?)" in msg


def test_keys_vllm_023_does_not_read_are_rejected(tiny_model):
    """0.23's CPUOffloadingManager knows no out-of-tree policies: the key would be ignored."""
    with pytest.raises(OffloadConfigError, match=r"unknown key .*'cache_policy_module_path'"):
        build(tiny_model, "OffloadingConnector", {"cpu_bytes_to_use": 1 << 20, "cache_policy_module_path": "x"})


@pytest.mark.parametrize("drop", ["block_size", "num_cpu_blocks"])
@by_connector
def test_every_key_vllm_reads_is_accepted(tiny_model, name, drop):
    keys = (set(compat.OFFLOADING_KEYS) | set(options.SPEC_KEYS) | set(compat.ASCEND_KEYS)) - {drop}
    keys -= {"cpu_bytes_to_use"} if drop == "block_size" else {"blocks_per_chunk"}
    extra = {k: SAMPLES[k] for k in keys} | {"eviction_policy": "arc", "store_threshold": 0}
    eng = build(tiny_model, name, extra)
    assert eng.spec.block_size_factor == 2 and eng.spec.num_blocks > 0
    assert type(eng.manager).__name__ == "CPUOffloadingManager"
    eng.run(PROMPT)
    assert eng.jobs, "nothing was stored"
    eng.worker.shutdown()


@by_connector
def test_10_tib_fails_before_allocating(tiny_model, name, monkeypatch):
    monkeypatch.setattr(host_limits, "host_memory", lambda: host_limits.HostMemory(1 << 30, "test host"))
    with pytest.raises(OffloadConfigError) as err:
        build(tiny_model, name, {"cpu_bytes_to_use": TEN_TIB})
    msg = str(err.value)
    per_block = PAGE * len(LAYERS)
    nbytes = TEN_TIB // per_block * per_block  # 0.23 sizes chunks from the real per-block bytes
    assert msg.startswith(f"kv_connector_extra_config['cpu_bytes_to_use']={TEN_TIB}: ")
    assert f"this rank would allocate {nbytes} bytes ({host_limits.fmt_bytes(nbytes)})" in msg
    assert f"only {1 << 30} bytes (1.0 GiB) are available (test host)" in msg


def test_10_tib_against_this_machine(tiny_model):
    avail = host_limits.available_host_bytes()
    assert avail is not None and avail < TEN_TIB
    with pytest.raises(OffloadConfigError, match=rf"\['num_cpu_blocks'\]={10**9}: this rank would allocate "
                                                 rf"{10**9 * PAGE * len(LAYERS)} bytes .* are available \("):
        build(tiny_model, "NPUOffloadingConnector", {"num_cpu_blocks": 10**9})


SIMPLE = ("NPUSimpleCPUOffloadConnector", "vllm_npu_offload.integration.simple_connector")


def simple_connector(tiny_model, extra: dict, role):
    from vllm_npu_offload.integration.simple_connector import NPUSimpleCPUOffloadConnector

    vc = vllm_config(tiny_model, extra, *SIMPLE, spec=False)
    return NPUSimpleCPUOffloadConnector(vc, role, kv_cache_config(NB, LAYERS, HEADS, HEAD, PAGE))


def test_simple_connector_rejects_a_misspelt_key(tiny_model):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(OffloadConfigError, match=r"'cpu_byte_to_use' \(did you mean 'cpu_bytes_to_use'\?\)"):
            simple_connector(tiny_model, {"cpu_byte_to_use": 1 << 20}, role)


def test_simple_connector_10_tib_fails_before_allocating(tiny_model):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    with pytest.raises(OffloadConfigError, match=rf"\['cpu_bytes_to_use'\]={TEN_TIB}: this rank would allocate "
                                                 rf"{TEN_TIB} bytes .* are available \("):
        simple_connector(tiny_model, {"cpu_bytes_to_use": TEN_TIB}, KVConnectorRole.WORKER)
