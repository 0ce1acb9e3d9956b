"""Adapters: the only modules that import vLLM. Version differences live in ``compat``."""
