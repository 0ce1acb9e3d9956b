"""Benchmarks run from a checkout (not installed: setup.py packages vllm_npu_offload only)."""
