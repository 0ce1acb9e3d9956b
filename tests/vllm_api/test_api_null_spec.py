"""The benchmark's NullCopySpec (vLLM's CPUOffloadingSpec without copies) in the installed vLLM's real scheduler.

The e2e miss part reads "null vs off" as the price of vLLM's connector itself, so the null spec
must keep vLLM's manager and sizing, finish stores without touching a byte, and refuse loads.
"""

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from harness import (  # noqa: E402
    HEAD,
    HEADS,
    LAYERS,
    NB,
    PAGE,
    PROMPT,
    Engine,
    kv_cache_config,
    make_spec,
    stacked_caches,
    vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector  # noqa: E402

from benchmarks.gpu_e2e.null_spec import NULL_MODULE, NullCopyError, NullCopySpec  # noqa: E402
from vllm_npu_offload.integration import compat  # noqa: E402

EXTRA = {"cpu_bytes_to_use": 32 * PAGE * 2, "spec_name": "NullCopySpec", "spec_module_path": NULL_MODULE}


def test_null_spec_stores_nothing_and_refuses_loads(tiny_model, caplog):
    vc = vllm_config(tiny_model, EXTRA, spec=False)
    kcc = kv_cache_config(NB, LAYERS, HEADS, HEAD, PAGE)
    caches = stacked_caches()
    before = {k: v.clone() for k, v in caches.items()}
    eng = Engine.build(vc, kcc, caches, OffloadingConnector, record=False)
    assert isinstance(eng.spec, NullCopySpec)
    assert type(eng.manager).__name__ == "CPUOffloadingManager"
    native = make_spec(compat.CPUOffloadingSpec, vllm_config(tiny_model, {"cpu_bytes_to_use": EXTRA["cpu_bytes_to_use"]},
                                                               spec=False), kcc)
    # the same host sizing as vLLM's own spec
    assert compat.chunk_geometry(eng.spec) == compat.chunk_geometry(native) and compat.chunk_geometry(native)[1] > 0

    eng.run(PROMPT)  # stores are submitted and finish at the next poll
    copies = eng.spec._null
    assert copies.stores > 0 and not copies.done and not eng.transfers_pending()
    assert all(torch.equal(caches[k], before[k]) for k in caches)  # no byte moved
    assert eng.moved == {"store": 0, "load": 0}  # vLLM's stats count no copied bytes

    eng.reset_device_prefix_cache()
    with pytest.raises((AssertionError, NullCopyError)) as err:  # either way the engine stops
        eng.run(PROMPT)  # the manager now holds the prefix: vLLM asks for a load
    if err.type is AssertionError:  # 0.21-0.24 log the handler's error, then assert
        assert any("NullCopyError" in r.getMessage() and "nothing is reused" in r.getMessage()
                   for r in caplog.records)
    else:  # >= 0.25 let the worker's error through
        assert "nothing is reused" in str(err.value)
