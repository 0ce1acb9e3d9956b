"""Adapters: the only modules that import vLLM. Version differences live in ``compat``.

The installed vLLM's version is checked here, before any submodule imports vLLM's internals,
so an unsupported vLLM fails with one error naming the supported range (``versions``)."""

from .versions import require_supported_vllm as _require_supported_vllm

_require_supported_vllm()
