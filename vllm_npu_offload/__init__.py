"""vllm-npu-offload: move KV cache between accelerator memory and pinned host memory.

The core (platform, memory, plan, copy, engine) imports only torch and numpy so that
it can be benchmarked on machines without vLLM. Everything that imports vLLM lives in
``vllm_npu_offload.integration``.
"""

__version__ = "0.1.0"
