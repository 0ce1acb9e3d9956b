import os

# vllm-ascend (if present) would take over platform detection; these tests want CpuPlatform.
os.environ.setdefault("VLLM_PLUGINS", "")
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
