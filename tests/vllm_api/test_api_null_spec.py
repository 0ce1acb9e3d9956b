"""The benchmark's NullCopySpec (vLLM's CPUOffloadingSpec without copies) in vLLM 0.23's real scheduler.

The e2e miss part reads "null vs off" as the price of vLLM's connector itself, so the null spec
must keep vLLM's manager and sizing, finish stores without touching a byte, and refuse loads.
"""

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from harness import BLOCK, HEAD, HEADS, LAYERS, NB, PAGE, PROMPT, Engine, kv_cache_config, stacked_caches, vllm_config  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector  # noqa: E402

from vllm_npu_offload.bench.gpu_e2e.null_spec import NULL_MODULE, NullCopySpec  # noqa: E402
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
    native = compat.CPUOffloadingSpec(vllm_config(tiny_model, {"cpu_bytes_to_use": EXTRA["cpu_bytes_to_use"]},
                                                  spec=False), kcc)
    assert eng.spec.num_blocks == native.num_blocks > 0  # the same host sizing as vLLM's own spec

    eng.run(PROMPT)  # stores are submitted and finish at the next poll
    copies = eng.spec._null
    assert copies.stores > 0 and not copies.done and not eng.transfers_pending()
    assert all(torch.equal(caches[k], before[k]) for k in caches)  # no byte moved
    stats = eng.worker.get_kv_connector_stats()
    assert stats is None or not stats.data.get("GPU_to_CPU")  # zero-time results are not counted as copies

    eng.reset_device_prefix_cache()
    with pytest.raises(AssertionError):  # vLLM 0.23 logs the handler's error and asserts: the engine stops
        eng.run(PROMPT)  # the manager now holds the prefix: vLLM asks for a load
    assert any("NullCopyError" in r.getMessage() and "nothing is reused" in r.getMessage() for r in caplog.records)
