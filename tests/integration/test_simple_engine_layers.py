"""NPUSimpleCPUOffloadConnector in a real vLLM engine at a real layer count and a GiB-scale host
capacity: a 32-layer tiny Llama, cpu_bytes_to_use = 1 GiB. The host holds exactly the CPU blocks
vLLM's scheduler hands out, in 1 GiB (not 32x that, the per-layer sizing bug of issue 20), and a
prompt stored, dropped from the device prefix cache and loaded back decodes as offload off."""

from __future__ import annotations

import gc

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

from test_simple_engine import CONNECTOR, _gen, _llm  # noqa: E402

from vllm_npu_offload.demo.tiny_model import build_tiny_llama, random_words  # noqa: E402

LAYERS = 32
GIB = 1 << 30
PAGE = 2 * 32 * 2 * 32 * 4  # K and V x 32 tokens x 2 KV heads x head 32 x float32, per layer and block
PROMPTS = [random_words(200, s) for s in (50, 51)]  # 6 full blocks of 32 tokens each


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    model = build_tiny_llama(tmp_path_factory.mktemp("deep") / "llama32", num_layers=LAYERS)
    llm = _llm(model)
    ref = _gen(llm, PROMPTS)[0]
    del llm
    gc.collect()
    cfg = {**CONNECTOR, "kv_connector_extra_config": {"cpu_bytes_to_use": GIB}}
    llm = _llm(model, cfg)
    yield llm, ref
    del llm
    gc.collect()


def test_host_is_the_schedulers_blocks_in_the_capacity(engines):
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    llm, _ = engines
    worker = get_kv_transfer_group().worker_handler
    sched = llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler_manager
    host = worker.transport.host
    layout = worker.transport.core.layout
    assert layout.record_bytes == LAYERS * PAGE  # a host block holds every layer's K and V
    assert layout.num_blocks == sched.num_cpu_blocks  # every id the scheduler hands out
    assert 0.99 * GIB <= host.nbytes <= GIB, host.nbytes


def test_store_reset_load_matches_offload_off(engines):
    llm, ref = engines
    tokens, cached = _gen(llm, PROMPTS)
    assert tokens == ref and cached == [0, 0]
    assert llm.reset_prefix_cache()
    tokens, cached = _gen(llm, PROMPTS)
    assert all(c >= 192 for c in cached), cached  # 6 blocks each came back from host
    assert tokens == ref
