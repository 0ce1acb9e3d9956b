"""The GPU yardstick's per-layer connector (benchmarks/gpu_e2e/perlayer.py) on vLLM 0.23.0's real
scheduler and worker-role connector (CPU tensors, no model): K and V of every layer become device
tensors of their own, and a prefix stored, dropped from the device and loaded back is byte-exact."""

import pytest
import torch

pytest.importorskip("vllm")
from harness import LAYERS, NB, PAGE, PROMPT, HEAD, HEADS, Engine, kv_cache_config, stacked_caches, vllm_config

from benchmarks.gpu_e2e.perlayer import PerLayerOffloadingConnector
from vllm_npu_offload.copy.base import Direction


def test_perlayer_connector_registers_k_and_v_apart_and_reloads(tiny_model):
    vc = vllm_config(tiny_model, {"cpu_bytes_to_use": 64 * PAGE * len(LAYERS), "block_size": 32},
                     connector="PerLayerOffloadingConnector", module="benchmarks.gpu_e2e.perlayer")
    caches = stacked_caches()
    eng = Engine.build(vc, kv_cache_config(NB, LAYERS, HEADS, HEAD, PAGE), caches, PerLayerOffloadingConnector)
    assert eng.sched.connector.prefer_cross_layer_blocks is False  # vLLM allocates one tensor per layer
    core = eng.core
    assert len(core.device_tensors) == 2 * len(LAYERS)
    assert {t.page_bytes for t in core.device_tensors} == {PAGE // 2} == {t.block_stride // 2 for t in core.device_tensors}
    eng.run(PROMPT)
    stores = [j for j in eng.jobs if j.direction == Direction.D2H]
    assert stores
    snapshot = {n: t.clone() for n, t in caches.items()}
    eng.reset_device_prefix_cache()
    for t in caches.values():
        t.zero_()
    eng.run(PROMPT)
    loads = [j for j in eng.jobs if j.direction == Direction.H2D]
    assert loads and len(loads[0].device_blocks) == len(stores[0].device_blocks)
    for src, dst in zip(stores[0].device_blocks, loads[0].device_blocks):
        for n in LAYERS:
            assert torch.equal(caches[n][dst], snapshot[n][src])
