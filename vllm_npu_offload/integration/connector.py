"""``NPUOffloadingConnector``: vLLM's ``OffloadingConnector`` that also accepts Ascend's per-layer K/V tuples.

vLLM-Ascend registers each attention layer's KV as a tuple of separate tensors (K and V; MLA's
two parts of different widths), carved at 2 MiB-aligned offsets out of bigger allocations.
Upstream ``OffloadingConnectorWorker.register_kv_caches`` (0.23) asserts one tensor per layer
with ``storage_offset() == 0``, so it rejects them; vLLM-Ascend main swaps in its own
connector for that, vLLM-Ascend 0.23.0.post1 does not. This subclass canonicalises such caches
with ``device_kv.canonicalize`` into ``CanonicalKVCaches`` and hands them to the spec exactly where
upstream would; caches upstream can read (plain tensors, Mamba state lists) take the upstream
path unchanged. Everything else is inherited, unless ``layerwise_load`` is on: then a host hit
of at least ``layerwise_min_tokens`` tokens, with at least ``layerwise_min_new_tokens`` left to
compute, is loaded inside the step that computes the rest of its prompt, one transfer per layer
group, each layer's attention waiting (on the device) for its group (``layerwise_scheduler`` /
``layerwise_worker``; docs/layerwise.md).

Use: ``"kv_connector": "NPUOffloadingConnector", "kv_connector_module_path":
"vllm_npu_offload.integration.connector"``.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.v1.kv_cache_interface import AttentionSpec, UniformTypeKVCacheSpecs

from ..errors import OffloadConfigError
from ..device_kv import DeviceKVTensor, canonicalize
from . import compat
from .layerwise_worker import LayerwiseLoader, LoadJob, StepOutcome
from .options import layerwise_options, npu_connector_context


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


def load_job(job_id: int, entry) -> LoadJob:
    """A scheduler load ``TransferJob`` of the one KV group as the layer-wise loader takes it."""
    cpu, gpu = compat.load_job_specs(entry)
    return LoadJob(job_id, np.asarray(gpu.block_ids, dtype=np.int64), int(gpu.block_indices[0]),
                   np.asarray(cpu.block_ids, dtype=np.int64))


class NPUOffloadingConnector(OffloadingConnector):
    """``OffloadingConnector`` plus K/V-tuple canonicalisation in ``register_kv_caches`` and the
    opt-in layer-wise loads (``layerwise_load``: true, or "auto": only while nothing else runs)."""

    def __init__(self, vllm_config, role, *args, **kwargs):
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        self._layerwise = layerwise_options(extra)
        self._lw_sched = None  # LayerwiseScheduler, scheduler role with layerwise_load
        self._lw_loader: LayerwiseLoader | None = None
        self._lw_outcome = StepOutcome()
        with npu_connector_context():  # our spec reads the layerwise_* keys only inside this connector
            super().__init__(vllm_config, role, *args, **kwargs)
        if self._layerwise.enabled:
            self._check_layerwise(extra)
            if self.connector_scheduler is not None:
                # imported here: only layer-wise mode subclasses vLLM's offloading metadata
                from .layerwise_scheduler import LayerwiseScheduler

                self._lw_sched = LayerwiseScheduler(self.connector_scheduler, self._layerwise)

    def _check_layerwise(self, extra: Mapping) -> None:
        why = compat.layerwise_unsupported()
        if why:
            raise OffloadConfigError(why)
        if extra.get("spec_name") != "NPUOffloadingSpec":
            raise OffloadConfigError(
                f"kv_connector_extra_config['layerwise_load']={self._layerwise.mode!r} needs our spec (\"spec_name\": "
                "\"NPUOffloadingSpec\", \"spec_module_path\": \"vllm_npu_offload.integration.spec\"), "
                f"not {extra.get('spec_name')!r}"
            )
        groups = self._kv_cache_config.kv_cache_groups  # all of them: vLLM's recovery reads group 0 only
        if len(groups) != 1:
            raise OffloadConfigError(
                f"kv_connector_extra_config['layerwise_load']={self._layerwise.mode!r} needs a model with one "
                f"KV-cache group; this one has {len(groups)} "
                f"({', '.join(type(g.kv_cache_spec).__name__ for g in groups)}): vLLM recovers "
                "from a failed load for one group only (scheduler._update_requests_with_invalid_blocks). "
                "Set 'layerwise_load' to false"
            )

    @property
    def prefer_cross_layer_blocks(self) -> bool:
        # A page holding every layer of a block cannot be loaded layer by layer (vLLM 0.23 asks for one).
        return not self._layerwise.enabled and getattr(super(), "prefer_cross_layer_blocks", False)

    def register_kv_caches(self, kv_caches) -> None:
        worker = self.connector_worker
        assert worker is not None, "register_kv_caches runs on the worker-role connector"
        kv_cache_config = self._kv_cache_config  # set by KVConnectorBase_V1 (0.21+)
        if self._layerwise.enabled:
            (group,) = compat.offloaded_groups(kv_cache_config)
            worker.spec.use_layer_groups(group.layer_names, self._layerwise.groups)
        if not needs_canonicalizing(kv_caches, kv_cache_config):
            super().register_kv_caches(kv_caches)
        else:
            compat.hand_canonical_to_spec(worker, canonical_kv_caches(kv_caches, kv_cache_config))
        if self._layerwise.enabled:
            self._lw_loader = LayerwiseLoader(worker.spec.npu_router, worker.spec.layer_groups, first_group=1)

    # -- lower tiers: prefetch ------------------------------------------------------------
    def on_new_request(self, request) -> None:
        """Hand a new request's keys to the tiers' manager, which reads those on disk (or in the store)
        into host while the request waits in vLLM's queue (tiered_manager.py, prefetch)."""
        super().on_new_request(request)
        sched = self.connector_scheduler
        prefetch = getattr(getattr(sched, "manager", None), "prefetch", None)
        if prefetch is None:
            return
        found = compat.request_offload_keys(sched, request)
        if found is not None:
            prefetch(*found)

    # -- layer-wise loads: scheduler side -------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens, *args, **kwargs):
        hit, is_async = super().get_num_new_matched_tokens(request, num_computed_tokens, *args, **kwargs)
        if self._lw_sched is None:
            return hit, is_async
        return self._lw_sched.matched(request, num_computed_tokens, hit, is_async)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        if self._lw_sched is None:
            return super().update_state_after_alloc(request, blocks, num_external_tokens)
        before = self._lw_sched.jobs_before_alloc()
        view = self._lw_sched.before_alloc(request, blocks, num_external_tokens)
        out = super().update_state_after_alloc(request, view, num_external_tokens)
        self._lw_sched.after_alloc(request, before)
        return out

    def build_connector_meta(self, scheduler_output):
        meta = super().build_connector_meta(scheduler_output)
        return meta if self._lw_sched is None else self._lw_sched.ship(meta, scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        if self._lw_sched is not None:
            self._lw_sched.on_output(connector_output.kv_connector_worker_meta)
        super().update_connector_output(connector_output)

    def reset_cache(self):
        if self._lw_sched is not None:
            self._lw_sched.reset()
        return super().reset_cache()

    # vLLM calls one of the two when a request leaves: 0.32 the HMA one for an HMA connector
    def request_finished(self, request, *args, **kwargs):
        if self._lw_sched is not None:
            self._lw_sched.finished(request.request_id)
        return super().request_finished(request, *args, **kwargs)

    def request_finished_all_groups(self, request, *args, **kwargs):
        if self._lw_sched is not None:
            self._lw_sched.finished(request.request_id)
        return super().request_finished_all_groups(request, *args, **kwargs)

    # -- layer-wise loads: worker side ----------------------------------------------------
    def layerwise_stats(self) -> dict | None:
        """This worker's layer-wise counters (``LayerwiseStats``), None when the mode is off."""
        return None if self._lw_loader is None else dataclasses.asdict(self._lw_loader.stats)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        meta = self._connector_metadata
        ids = getattr(meta, "layerwise_jobs", None)
        if self._lw_loader is None or not ids:
            return super().start_load_kv(forward_context, **kwargs)
        # ours first: they gate this step's forward; vLLM's asynchronous loads queue behind them
        self._lw_loader.start([load_job(j, meta.load_jobs[j]) for j in sorted(ids)],
                              full_graph=compat.replays_full_graph(forward_context))
        rest = {j: e for j, e in meta.load_jobs.items() if j not in ids}
        self.connector_worker.start_kv_transfers(dataclasses.replace(meta, load_jobs=rest))

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._lw_loader is not None:
            self._lw_loader.wait_layer(layer_name)

    def get_finished(self, finished_req_ids):
        out = super().get_finished(finished_req_ids)
        if self._lw_loader is not None and self._lw_loader.active:
            step = self._lw_loader.finish()
            self._lw_outcome.done |= step.done
            self._lw_outcome.invalid_blocks |= step.invalid_blocks
            self._lw_outcome.loaded += step.loaded
        return out

    def get_block_ids_with_load_errors(self) -> set[int]:
        bad = set(super().get_block_ids_with_load_errors() or ())
        bad |= self._lw_outcome.invalid_blocks
        self._lw_outcome.invalid_blocks = set()
        return bad

    def build_connector_worker_meta(self):
        meta = super().build_connector_worker_meta()
        out, self._lw_outcome = self._lw_outcome, StepOutcome(invalid_blocks=self._lw_outcome.invalid_blocks)
        if self._lw_loader is None or (meta is None and not out.done):
            return meta
        from .layerwise_meta import LayerwiseWorkerMetadata

        meta = LayerwiseWorkerMetadata.extend(meta, {j: 1 for j in out.done})
        for nbytes, seconds in out.loaded:
            compat.record_load_stats(self.connector_worker, meta, nbytes, seconds)
        return meta


__all__ = ["NPUOffloadingConnector", "canonical_kv_caches", "needs_canonicalizing"]
