"""vllm-npu-offload: move KV cache between accelerator memory and pinned host memory.

The core (platform, memory, plan, copy, engine) imports only torch and numpy so that
it can be benchmarked on machines without vLLM. Everything that imports vLLM lives in
``vllm_npu_offload.integration``.
"""

__version__ = "0.1.0"

CORE_MODULES = (
    "vllm_npu_offload.platform",
    "vllm_npu_offload.memory",
    "vllm_npu_offload.plan",
    "vllm_npu_offload.copy",
    "vllm_npu_offload.copy.base",
    "vllm_npu_offload.copy.host",
    "vllm_npu_offload.copy.backend",
    "vllm_npu_offload.engine",
    "vllm_npu_offload.errors",
    "vllm_npu_offload.host_limits",
    "vllm_npu_offload.stats",
    "vllm_npu_offload.offload_worker",
    "vllm_npu_offload.layouts",
    "vllm_npu_offload._native.acl",
    "vllm_npu_offload.copy.acl_copy",
    "vllm_npu_offload.copy.npu_paths",
    "vllm_npu_offload.simple_core",
)
