"""Benchmarks (core only: torch/numpy/triton); ``scripts/`` wraps them."""
