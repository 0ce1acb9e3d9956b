"""Both connectors on the current vLLM API: unknown kv_connector_extra_config keys are errors
that name the nearest known key, every key vLLM itself reads is still accepted, and a host
size the machine cannot hold fails before anything is allocated (not in torch's allocator).

(tests/vllm_api/test_api_config.py has the same checks on every release's code.)"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace

import pytest

vllm = pytest.importorskip("vllm")

from extra_samples import SAMPLES  # noqa: E402
from vllm_configs import (  # noqa: E402
    LAYERS,
    NPU_OFFLOADING,
    OFFLOADING,
    PAGE,
    SIMPLE,
    SPEC_EXTRA,
    offloading_config,
    stacked_caches,
    worker_connector,
)

from vllm_npu_offload import host_limits  # noqa: E402
from vllm_npu_offload.errors import OffloadConfigError  # noqa: E402
from vllm_npu_offload.integration import compat, options  # noqa: E402

if compat.API == "handlers":
    pytest.skip("tests/vllm_api covers the 0.21-0.24 API", allow_module_level=True)

TEN_TIB = 10 << 40
SMALL = 1 << 30  # what the fake host has available in the unit tests


def _cls(connector):
    if connector is SIMPLE:
        from vllm_npu_offload.integration.simple_connector import NPUSimpleCPUOffloadConnector

        return NPUSimpleCPUOffloadConnector
    if connector is NPU_OFFLOADING:
        from vllm_npu_offload.integration.connector import NPUOffloadingConnector

        return NPUOffloadingConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

    return OffloadingConnector


def _extra(connector, **kw) -> dict:
    return {**(SPEC_EXTRA if connector is not SIMPLE else {}), **kw}


CONNECTORS = pytest.mark.parametrize("connector", [OFFLOADING, NPU_OFFLOADING, SIMPLE], ids=lambda c: c[0])


@pytest.fixture
def small_host(monkeypatch):
    """The host has 1 GiB available (whatever this machine really has)."""
    mem = host_limits.HostMemory(SMALL, "test host")
    monkeypatch.setattr(host_limits, "host_memory", lambda: mem)
    return mem


# -- 1. strict keys ----------------------------------------------------------------------


@CONNECTORS
def test_misspelt_key_is_rejected_with_the_nearest_key(tiny_model, connector):
    extra = _extra(connector, cpu_byte_to_use=256 << 20)
    with pytest.raises(OffloadConfigError) as err:
        worker_connector(tiny_model, _cls(connector), extra, connector)
    msg = str(err.value)
    owner = "NPUSimpleCPUOffloadConnector" if connector is SIMPLE else "NPUOffloadingSpec"
    assert f"unknown key for {owner} on vLLM {compat.VLLM_VERSION}" in msg
    assert "'cpu_byte_to_use' (did you mean 'cpu_bytes_to_use'?)" in msg
    assert options.ALLOW_UNKNOWN_ENV in msg


def test_several_unknown_keys_are_named_together():
    from vllm_npu_offload.integration.spec import NPUOffloadingSpec

    with pytest.raises(OffloadConfigError) as err:
        NPUOffloadingSpec(offloading_config({"cpu_bytes_to_use": 1 << 20, "evicton_policy": "arc", "zzz": 1}))
    msg = str(err.value)
    assert "unknown keys" in msg
    assert "'evicton_policy' (did you mean 'eviction_policy'?), 'zzz'." in msg


def test_spec_keys_are_not_simple_connector_keys(tiny_model):
    """block_size is read by the OffloadingConnector path, never by the simple connector."""
    with pytest.raises(OffloadConfigError, match=r"unknown key .*'block_size'"):
        worker_connector(tiny_model, _cls(SIMPLE), {"cpu_bytes_to_use": 64 << 20, "block_size": 32}, SIMPLE)


SPEC_ALL = set(options.SPEC_KEYS) | set(compat.OFFLOADING_KEYS) | set(compat.ASCEND_KEYS)


def test_every_known_key_has_a_sample():
    assert SPEC_ALL | set(options.SIMPLE_KEYS) | set(compat.simple_connector_keys()) <= set(SAMPLES)
    # what vLLM 0.32 itself reads (grep of its sources), so a shrinking list is caught too
    assert {"spec_name", "spec_module_path", "offload_prompt_only", "store_threshold", "max_tracker_size",
            "canonical_layout", "self_describing_kv_events", "cache_policy_module_path"} <= set(compat.OFFLOADING_KEYS)
    assert {"cpu_bytes_to_use_per_rank", "lazy_offload", "disk_path"} <= set(compat.simple_connector_keys())


@pytest.mark.parametrize(
    "drop", [("block_size", "num_cpu_blocks"), ("blocks_per_chunk", "cpu_bytes_to_use")], ids=["bpc+bytes", "bs+blocks"]
)
@pytest.mark.parametrize("connector", [OFFLOADING, NPU_OFFLOADING], ids=lambda c: c[0])
def test_every_key_vllm_reads_is_accepted_by_the_spec(tiny_model, connector, drop):
    """All keys at once (minus the pairs that exclude each other), through vLLM's own config
    translation and factory; the worker registers and the scheduler manager builds."""
    extra = {k: SAMPLES[k] for k in sorted(SPEC_ALL) if k not in drop}
    conn, register = worker_connector(tiny_model, _cls(connector), extra, connector)
    register(stacked_caches())
    spec = conn.connector_worker.spec
    assert spec.blocks_per_chunk == 2 and spec.num_chunks > 0
    assert type(spec.get_manager()).__name__ == "CPUOffloadingManager"
    conn.shutdown()


def test_every_key_vllm_reads_is_accepted_by_the_simple_connector(tiny_model):
    keys = set(options.SIMPLE_KEYS) | set(compat.simple_connector_keys())
    extra = {k: SAMPLES[k] for k in sorted(keys)}
    conn, register = worker_connector(tiny_model, _cls(SIMPLE), extra, SIMPLE)
    register(stacked_caches())
    assert conn.worker_handler.cpu_capacity_bytes == SAMPLES["cpu_bytes_to_use_per_rank"]
    assert conn.worker_handler.transport is not None
    conn.shutdown()


@pytest.mark.parametrize(
    "extra, match",
    [
        ({"staging_bytes": 0}, r"\['staging_bytes'\]=0 must be a positive integer"),
        ({"staging_bytes": "4M"}, r"\['staging_bytes'\]='4M' must be a positive integer"),
        ({"cpu_bytes_to_use": -1}, r"\['cpu_bytes_to_use'\]=-1 must be a positive integer"),
        ({"kv_offload_backend": "disk"}, r"\['kv_offload_backend'\]='disk' is not supported"),
    ],
)
def test_simple_connector_bad_values(tiny_model, extra, match):
    with pytest.raises(OffloadConfigError, match=match):
        worker_connector(tiny_model, _cls(SIMPLE), {"cpu_bytes_to_use": 64 << 20, **extra}, SIMPLE)


# -- 2. host memory ----------------------------------------------------------------------


@pytest.mark.parametrize("connector", [OFFLOADING, NPU_OFFLOADING], ids=lambda c: c[0])
def test_spec_checks_host_memory_before_allocating(tiny_model, connector, small_host):
    conn, register = worker_connector(tiny_model, _cls(connector), _extra(connector, cpu_bytes_to_use=TEN_TIB),
                                      connector)
    spec = conn.connector_worker.spec
    nbytes = spec.num_chunks * PAGE * len(LAYERS)  # host chunks (vLLM's sizing) x KV bytes per block
    assert nbytes >= TEN_TIB
    with pytest.raises(OffloadConfigError) as err:
        register(stacked_caches())
    msg = str(err.value)
    assert msg.startswith(f"kv_connector_extra_config['cpu_bytes_to_use']={TEN_TIB}: ")
    assert f"this rank would allocate {nbytes} bytes ({host_limits.fmt_bytes(nbytes)})" in msg
    assert f"only {SMALL} bytes (1.0 GiB) are available (test host)" in msg
    assert conn.connector_worker.worker is None  # nothing was built


def test_spec_names_the_legacy_key(small_host):
    from vllm_npu_offload.integration.spec import NPUOffloadingSpec

    spec = NPUOffloadingSpec(offloading_config({"num_cpu_blocks": 10**9}, bytes_per_block=PAGE))
    with pytest.raises(OffloadConfigError, match=r"\['num_cpu_blocks'\]=1000000000: this rank would allocate "
                                                 rf"{10**9 * PAGE} bytes"):
        spec._new_core(SimpleNamespace(tensors=[SimpleNamespace(page_size_bytes=PAGE)]))


def test_simple_connector_checks_at_construction(tiny_model, small_host):
    with pytest.raises(OffloadConfigError) as err:
        worker_connector(tiny_model, _cls(SIMPLE), {"cpu_bytes_to_use": TEN_TIB}, SIMPLE)
    msg = str(err.value)
    assert msg.startswith(f"kv_connector_extra_config['cpu_bytes_to_use']={TEN_TIB}: ")
    assert f"this rank would allocate {TEN_TIB} bytes (10.0 TiB)" in msg and f"only {SMALL} bytes" in msg


def test_simple_connector_checks_the_exact_size_at_registration(tiny_model, monkeypatch):
    from vllm_npu_offload.integration.simple_worker import host_size

    conn, register = worker_connector(tiny_model, _cls(SIMPLE), {"cpu_bytes_to_use_per_rank": 64 << 20}, SIMPLE)
    monkeypatch.setattr(host_limits, "host_memory", lambda: host_limits.HostMemory(1 << 20, "test host"))
    with pytest.raises(OffloadConfigError) as err:
        register(stacked_caches())
    msg = str(err.value)
    bpb = PAGE * len(LAYERS)
    n = host_size(conn.worker_handler.kv_cache_config, 64 << 20, [PAGE] * len(LAYERS)).blocks
    assert msg.startswith(f"kv_connector_extra_config['cpu_bytes_to_use_per_rank']={64 << 20}: ")
    assert f"would allocate {n * bpb} bytes" in msg and f"{n} host blocks x {bpb} bytes" in msg
    assert conn.worker_handler.transport is None


# A real engine start, in a subprocess (a failed in-process start leaves vLLM state behind),
# with this machine's real memory: our error, quickly, and never torch's allocator error.
ENGINE = textwrap.dedent("""
    import sys, time
    from vllm_npu_offload.demo.run import make_llm, offload_config
    simple = {"kv_connector": "NPUSimpleCPUOffloadConnector", "kv_role": "kv_both",
              "kv_connector_module_path": "vllm_npu_offload.integration.simple_connector",
              "kv_connector_extra_config": {"cpu_bytes_to_use": %d}}
    cfg = simple if sys.argv[2] == "simple" else offload_config(%d, 32)
    t0 = time.perf_counter()
    try:
        make_llm(sys.argv[1], 32, cfg, 1024)
    except Exception as e:
        print("SECONDS", time.perf_counter() - t0)
        print("ERROR", type(e).__name__, e)
""") % (TEN_TIB, TEN_TIB)


@pytest.mark.vllm
@pytest.mark.parametrize("which", ["spec", "simple"])
def test_10_tib_engine_start_fails_fast_with_our_error(tiny_model, which):
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", ENGINE, tiny_model, which], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"})
    wall = time.monotonic() - t0
    lines = dict(ln.split(" ", 1) for ln in out.stdout.splitlines() if ln.startswith(("ERROR ", "SECONDS ")))
    assert "ERROR" in lines, out.stdout[-2000:] + out.stderr[-3000:]
    err = lines["ERROR"]
    assert err.startswith(f"OffloadConfigError kv_connector_extra_config['cpu_bytes_to_use']={TEN_TIB}: "), err
    assert "this rank would allocate" in err and "(10.0 TiB)" in err and "are available (" in err
    assert "can't allocate memory" not in out.stdout + out.stderr
    avail = host_limits.available_host_bytes()
    assert avail is not None and avail < TEN_TIB
    assert float(lines["SECONDS"]) < 60, (lines["SECONDS"], wall)  # engine start to error (~4 s here)
