"""vLLM >= 0.26 configs for connector tests without a model run: a VllmConfig for one of our
connectors, a one-group KVCacheConfig and a worker-role connector ready for register_kv_caches.
(tests/vllm_api/harness.py drives any release's real Scheduler.)"""

from __future__ import annotations

import torch

NB, BLOCK, HEADS, HEAD = 12, 16, 2, 32
PAGE = 2 * BLOCK * HEADS * HEAD * 4  # K+V bytes per block and layer (float32)
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]

SPEC_EXTRA = {"spec_name": "NPUOffloadingSpec", "spec_module_path": "vllm_npu_offload.integration.spec"}
# kv_connector, kv_connector_module_path
OFFLOADING = ("OffloadingConnector", None)
NPU_OFFLOADING = ("NPUOffloadingConnector", "vllm_npu_offload.integration.connector")
SIMPLE = ("NPUSimpleCPUOffloadConnector", "vllm_npu_offload.integration.simple_connector")


def vllm_config(model: str, extra: dict, connector: tuple[str, str | None] = NPU_OFFLOADING):
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig

    name, module = connector
    return VllmConfig(
        model_config=ModelConfig(model=model, dtype="float32", seed=0),
        scheduler_config=SchedulerConfig(
            max_num_seqs=4, max_num_batched_tokens=512, max_model_len=2048, is_encoder_decoder=False
        ),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector=name, kv_connector_module_path=module, kv_role="kv_both", kv_connector_extra_config=extra
        ),
        device_config=DeviceConfig("cpu"),
    )


def kv_cache_config(num_blocks: int = NB):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    # As vLLM >= 0.26 places layers: one allocation, each KVCacheTensor's size is all of it.
    region = num_blocks * PAGE
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(size=region * len(LAYERS), layers=[n], layer_stride=region, block_stride=PAGE,
                          offset=i * region)
            for i, n in enumerate(LAYERS)
        ],
        kv_cache_groups=[
            KVCacheGroupSpec(
                LAYERS, FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32)
            )
        ],
    )


def stacked_caches() -> dict:
    """Upstream layout: one (num_blocks, 2, block, heads, head) view per layer of one allocation."""
    buf = torch.randn(len(LAYERS), NB, 2, BLOCK, HEADS, HEAD)
    return {n: buf[i] for i, n in enumerate(LAYERS)}


def worker_connector(model: str, cls, extra: dict, connector: tuple[str, str | None] = NPU_OFFLOADING):
    """(worker-role ``cls`` connector, ``register(kv_caches)``)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    vc = vllm_config(model, extra, connector)
    conn = cls(vc, KVConnectorRole.WORKER, kv_cache_config())

    def register(caches: dict) -> None:
        with set_current_vllm_config(vc):
            conn.register_kv_caches(caches)

    return conn, register


def offloading_config(extra: dict, bytes_per_block: int = 4096, tokens_per_block: int = 16, world_size: int = 1):
    """The ``OffloadingConfig`` vLLM hands a spec (``spec_name`` added), for spec-only tests."""
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    def make(cls, **kw):  # only the fields the installed release has (0.27 has fewer than 0.32)
        import dataclasses

        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in kw.items() if k in names})

    extra = {"spec_name": "NPUOffloadingSpec", **extra}
    bpc = int(extra.get("blocks_per_chunk", 1))
    return OffloadingConfig(
        groups=(make(OffloadingGroupConfig, tokens_per_block=tokens_per_block, layer_names=("layer.0",), group_id=0),),
        worker_kv_bytes_per_block=bytes_per_block,
        enable_kv_cache_events=False,
        extra_config=extra,
        engine_id="test",
        model=OffloadingModelConfig("tiny", "float32"),
        cache=OffloadingCacheConfig(tokens_per_hash=tokens_per_block, blocks_per_chunk=bpc),
        parallel=make(OffloadingParallelConfig, rank=0, world_size=world_size, tp_size=world_size, pp_size=1,
                      pcp_size=1, dcp_size=1, data_parallel_index=0, data_parallel_size=1,
                      data_parallel_rank_local=None, is_parallelism_agnostic=True),
    )
