"""``PerLayerOffloadingConnector``: vLLM's ``OffloadingConnector`` without cross-layer blocks (benchmark only).

Why: for a model with one uniform KV-cache group on an attention backend whose stride order has a
layers dimension (TRITON_ATTN, FLASH_ATTN; NHD), vLLM 0.23's ``OffloadingConnector`` says
``prefer_cross_layer_blocks = True`` and the model runner allocates one cross-layer tensor: a block
of every layer is one contiguous page (2 MiB per 64 tokens of an 8B Llama), so vLLM's native spec
moves one large page per block too. On Ascend, for several KV-cache groups, for MLA and wherever
vLLM falls back, a block is many small pages instead. This connector gives the same model that
layout on CUDA, for native and ours alike:

- ``prefer_cross_layer_blocks`` is False, so vLLM allocates one KV tensor per layer;
- ``register_kv_caches`` splits each layer's ``(num_blocks, 2, block, heads, dim)`` tensor (TRITON_ATTN
  / FLASH_ATTN, NHD) into its K and V halves, as Ascend registers them: 2 x layers pages per block
  (32 KiB each for the 8B at block 16), each a strided view (block stride = 2 pages). Both specs get
  these through ``NPUOffloadingConnector``'s canonicalisation (``CanonicalKVCaches``); vLLM's native
  CPU worker reads the row stride (``compute_sub_block_ptrs``).

Use: ``"kv_connector": "PerLayerOffloadingConnector", "kv_connector_module_path":
"benchmarks.gpu_e2e.perlayer"`` with vLLM's or our spec in ``kv_connector_extra_config``.
"""

from __future__ import annotations

from typing import Mapping

import torch

from vllm_npu_offload.integration.connector import NPUOffloadingConnector

MODULE = __name__


def split_kv(kv_caches: Mapping[str, object]) -> dict[str, object]:
    """Each ``(num_blocks, 2, ...)`` layer tensor as a (K, V) tuple of strided views; others as given."""
    out: dict[str, object] = {}
    for name, kv in kv_caches.items():
        if isinstance(kv, torch.Tensor) and kv.dim() == 5 and kv.shape[1] == 2:
            out[name] = (kv[:, 0], kv[:, 1])
        else:
            out[name] = kv
    return out


class PerLayerOffloadingConnector(NPUOffloadingConnector):
    """Per-layer KV tensors (no cross-layer blocks) with K and V registered apart: Ascend's layout."""

    @property
    def prefer_cross_layer_blocks(self) -> bool:
        return False

    def register_kv_caches(self, kv_caches) -> None:
        super().register_kv_caches(split_kv(kv_caches))


__all__ = ["MODULE", "PerLayerOffloadingConnector", "split_kv"]
