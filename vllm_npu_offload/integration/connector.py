"""``NPUOffloadingConnector``: vLLM's ``OffloadingConnector`` that also accepts Ascend's per-layer K/V tuples.

vLLM-Ascend registers each attention layer's KV as a tuple of separate tensors (K and V; MLA's
two parts of different widths), carved at 2 MiB-aligned offsets out of bigger allocations.
Upstream ``OffloadingConnectorWorker.register_kv_caches`` (0.23) asserts one tensor per layer
with ``storage_offset() == 0``, so it rejects them; vLLM-Ascend main swaps in its own
connector for that, vLLM-Ascend 0.23.0.post1 does not. This subclass canonicalises such caches
with ``device_kv.canonicalize`` into ``CanonicalKVCaches`` and hands them to the spec exactly where
upstream would; caches upstream can read (plain tensors, Mamba state lists) take the upstream
path unchanged. Everything else is inherited.

Use: ``"kv_connector": "NPUOffloadingConnector", "kv_connector_module_path":
"vllm_npu_offload.integration.connector"``.
"""

from __future__ import annotations

from typing import Mapping

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.v1.kv_cache_interface import AttentionSpec, UniformTypeKVCacheSpecs

from ..errors import OffloadConfigError
from ..device_kv import DeviceKVTensor, canonicalize
from . import compat


def _layer_specs(kv_cache_config) -> dict:
    """layer name -> its KV-cache spec, for the groups the connector offloads, in group order."""
    out = {}
    for group in compat.offloaded_groups(kv_cache_config):
        spec = group.kv_cache_spec
        per_layer = spec.kv_cache_specs if isinstance(spec, UniformTypeKVCacheSpecs) else {}
        for name in group.layer_names:
            out[name] = per_layer.get(name, spec)
    return out


def needs_canonicalizing(kv_caches: Mapping, kv_cache_config) -> bool:
    """True if an attention layer is not one tensor upstream can read: a K/V tuple, or (0.21-0.25,
    whose worker asserts it) a view that does not start at its storage. vLLM >= 0.26 places every
    layer as a view into one allocation and reads such views itself."""
    for name, spec in _layer_specs(kv_cache_config).items():
        kv = kv_caches.get(name)
        if not isinstance(spec, AttentionSpec):
            continue
        if not isinstance(kv, torch.Tensor) or (compat.UPSTREAM_NEEDS_OWN_STORAGE and kv.storage_offset() != 0):
            return True
    return False


def block_view(source: torch.Tensor, d: DeviceKVTensor) -> torch.Tensor:
    """Zero-copy int8 ``(num_blocks, page)`` view of ``d`` (what upstream hands specs)."""
    storage = source.untyped_storage()
    view = torch.empty(0, dtype=torch.int8, device=source.device)
    return view.set_(storage, d.base - storage.data_ptr(), (d.num_blocks, d.page_bytes), (d.block_stride, 1))


def canonical_kv_caches(kv_caches: Mapping, kv_cache_config):
    """``CanonicalKVCaches`` of per-layer tensors or K/V tuples; one ref per distinct tensor and group."""
    specs = _layer_specs(kv_cache_config)
    other = sorted(n for n, s in specs.items() if not isinstance(s, AttentionSpec))
    if other:
        raise OffloadConfigError(
            f"NPUOffloadingConnector canonicalises attention layers only; layers {other[:4]} are "
            f"{type(specs[other[0]]).__name__}. Allowed: attention layers as a tensor or a tuple of tensors"
        )
    missing = [n for n in specs if n not in kv_caches]
    if missing:
        raise OffloadConfigError(f"register_kv_caches got no KV cache for layers {missing[:4]}")
    layout = canonicalize({n: kv_caches[n] for n in specs}, kv_cache_config.num_blocks)
    tensors = [
        compat.CanonicalKVCacheTensor(tensor=block_view(src, d), page_size_bytes=d.page_bytes)
        for src, d in zip(layout.sources, layout.tensors)
    ]
    refs = [
        [
            compat.CanonicalKVCacheRef(tensor_idx=r.tensor_idx, page_size_bytes=r.page_bytes)
            for r in layout.group_refs(g.layer_names)
        ]
        for g in compat.offloaded_groups(kv_cache_config)
    ]
    return compat.CanonicalKVCaches(tensors=tensors, group_data_refs=refs)


class NPUOffloadingConnector(OffloadingConnector):
    """``OffloadingConnector`` plus K/V-tuple canonicalisation in ``register_kv_caches``."""

    def register_kv_caches(self, kv_caches) -> None:
        worker = self.connector_worker
        assert worker is not None, "register_kv_caches runs on the worker-role connector"
        kv_cache_config = self._kv_cache_config  # set by KVConnectorBase_V1 (0.21+)
        if not needs_canonicalizing(kv_caches, kv_cache_config):
            return super().register_kv_caches(kv_caches)
        compat.hand_canonical_to_spec(worker, canonical_kv_caches(kv_caches, kv_cache_config))


__all__ = ["NPUOffloadingConnector", "canonical_kv_caches", "needs_canonicalizing"]
