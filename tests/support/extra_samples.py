"""A valid kv_connector_extra_config value for every key vLLM or our connectors read (any vLLM
version); a key added to the lists in integration/compat.py or options.py needs one here."""

SAMPLES = {
    # NPUOffloadingSpec / vLLM's OffloadingConnector and CPUOffloadingSpec
    "spec_name": "NPUOffloadingSpec",
    "spec_module_path": "vllm_npu_offload.integration.spec",
    "self_describing_kv_events": False,
    "offload_prompt_only": True,
    "block_size": 32,
    "blocks_per_chunk": 2,
    "canonical_layout": False,
    "cpu_bytes_to_use": 64 << 20,
    "num_cpu_blocks": 8,
    "eviction_policy": "ARCCachePolicy",
    "cache_policy_module_path": "vllm.v1.kv_offload.cpu.policies.arc",
    "store_threshold": 2,
    "max_tracker_size": 1000,
    "sync_load_budget_bytes": 0,
    "staging_bytes": 1 << 20,
    # NPUOffloadingConnector only
    "layerwise_load": False,
    "layerwise_min_tokens": 256,
    "layerwise_groups": 4,
    # vLLM's SimpleCPUOffloadConnector
    "cpu_bytes_to_use_per_rank": 64 << 20,
    "lazy_offload": True,
    "kv_offload_backend": "cpu",
    "disk_path": "",
    "disk_capacity_bytes": 1 << 30,
    "disk_buffer_slots": 2,
    "use_page_cache": False,
}
