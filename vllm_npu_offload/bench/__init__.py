"""Benchmarks; ``scripts/`` wraps them. ``transfer``: torch/numpy/triton. ``multiturn``: HTTP client only."""
