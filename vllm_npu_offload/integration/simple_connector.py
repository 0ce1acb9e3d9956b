"""``NPUSimpleCPUOffloadConnector``: vLLM's simple CPU offload with our worker.

Select with ``"kv_connector": "NPUSimpleCPUOffloadConnector",
"kv_connector_module_path": "vllm_npu_offload.integration.simple_connector"``.
The scheduler side (CPU ``BlockPool`` / ``KVCacheCoordinator``: prefix caching,
hybrid groups, LRU) is vLLM's ``SimpleCPUOffloadConnector``, unchanged; only the
worker handler is replaced, plus one scheduler-side addition: a store the worker
reports as failed releases its blocks without entering the CPU prefix cache.
"""

from __future__ import annotations

import logging

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector import SimpleCPUOffloadConnector

from ..host_limits import check_host_allocation
from . import compat
from .options import SIMPLE_KEYS, reject_unknown_keys, validate_simple_extra_config
from .simple_worker import NPUSimpleCPUOffloadWorker, NPUSimpleWorkerMetadata

logger = logging.getLogger(__name__)


def _take_store_event(manager, ev):
    """Remove a store event from the manager's pending stores (it will never be cached);
    returns its ``TransferMeta`` or None if the manager no longer knows it."""
    transfer = manager._store_event_to_blocks.pop(ev, None)
    if transfer is None:
        return None
    in_flight = getattr(manager, "_in_flight_store_gpu_blocks", None)  # absent in vLLM 0.21
    if in_flight is not None:
        in_flight.difference_update(transfer.gpu_block_ids)
    for req_id in manager._store_event_to_reqs.pop(ev, []):
        state = manager._reqs_to_store.get(req_id)
        if state is None:
            continue
        state.store_events.discard(ev)
        if state.finished and not state.store_events:
            manager._cleanup_store_request(req_id)
    return transfer


def abandon_failed_stores(manager, events) -> int:
    """Move failed store events to vLLM's "abandoned" set (the one ``reset()`` uses):
    when every worker has reported them, their CPU/GPU refs are released and nothing
    is inserted into the CPU prefix cache. Returns how many events were abandoned."""
    n = 0
    for ev in events:
        transfer = _take_store_event(manager, ev)
        if transfer is None:
            continue
        manager._abandoned_store_event_to_blocks[ev] = transfer
        n += 1
    return n


class FailedStoreReleaser:
    """The abandoned set for a scheduler manager without one (vLLM 0.23).

    A failed store event is taken away from the manager (with the worker reports it has
    counted so far); reports for it are then counted here, never by the manager, and once
    every worker has reported it its CPU and device refs are released without inserting
    any hash into the CPU prefix cache (the workers are done with the blocks by then)."""

    def __init__(self, manager):
        self.manager = manager
        self.events: dict[int, list] = {}  # event -> [TransferMeta, worker reports so far]

    def filter(self, meta: NPUSimpleWorkerMetadata) -> NPUSimpleWorkerMetadata:
        """``meta`` without the events taken over here (what the manager may still process)."""
        m = self.manager
        for ev in meta.failed_store_events:
            transfer = _take_store_event(m, ev)
            if transfer is not None:
                self.events[ev] = [transfer, m._store_event_pending_counts.pop(ev, 0)]
        completed = {}
        for ev, n in meta.completed_store_events.items():
            entry = self.events.get(ev)
            if entry is None:
                completed[ev] = n
                continue
            entry[1] += n
            if entry[1] >= m._expected_worker_count:
                del self.events[ev]
                self._release(entry[0])
        return NPUSimpleWorkerMetadata(completed_store_events=completed)

    def _release(self, transfer) -> None:
        m = self.manager
        cpu_blocks = [m.cpu_block_pool.blocks[b] for b in transfer.cpu_block_ids]
        for blk in cpu_blocks:
            blk.reset_hash()  # stamped when allocated; never inserted into the cache
        m.cpu_block_pool.free_blocks(cpu_blocks)
        m._gpu_block_pool.free_blocks(m._gpu_block_pool.blocks[b] for b in transfer.gpu_block_ids)


class NPUSimpleCPUOffloadConnector(SimpleCPUOffloadConnector):
    def __init__(self, vllm_config, role, kv_cache_config):
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        reject_unknown_keys(
            extra,
            SIMPLE_KEYS + compat.simple_connector_keys(),
            f"NPUSimpleCPUOffloadConnector on vLLM {compat.VLLM_VERSION}",
        )
        opts = validate_simple_extra_config(extra)
        super().__init__(vllm_config, role, kv_cache_config)
        if role == KVConnectorRole.WORKER and self.worker_handler is not None:
            cap = self.worker_handler.cpu_capacity_bytes
            # Fail here, before the model's KV caches are allocated; register_kv_caches checks
            # the exact size again right before the host buffer is allocated.
            ws = vllm_config.parallel_config.world_size
            if opts.size_value is None:
                how = f"vLLM's default capacity / {ws} rank(s)"
            else:
                how = "" if opts.size_value == cap else f"its share over {ws} ranks"
            check_host_allocation(cap, opts.size_key, opts.size_value, how)
            self.worker_handler = NPUSimpleCPUOffloadWorker(vllm_config, kv_cache_config, cap, opts)
        self._no_host_hit: set[str] = set()
        mode = compat.simple_failed_store_mode(self.scheduler_manager) if self.scheduler_manager is not None else None
        self._can_abandon = mode == "abandon"
        self._store_releaser = FailedStoreReleaser(self.scheduler_manager) if mode == "release" else None
        if self.scheduler_manager is not None and mode is None:
            logger.warning(
                "this vLLM's simple offload scheduler lacks %s: a failed store will keep its blocks pinned "
                "(never reported complete, so never loadable)", compat.SIMPLE_ABANDON_ATTRS,
            )

    # -- worker side ----------------------------------------------------------------------
    # vLLM 0.23's base class does not forward these two hooks (it launched in get_finished).
    def start_load_kv(self, forward_context, **kwargs) -> None:
        if self.worker_handler is not None:
            self.worker_handler.start_load_kv()

    def wait_for_save(self) -> None:
        if self.worker_handler is not None:
            self.worker_handler.wait_for_save()

    def get_transfer_results(self, finished_req_ids: set[str]):  # called by vLLM with failed_recving only
        if self.worker_handler is None:
            return compat.simple_transfer_results(set(), set())
        fin, failed = self.worker_handler.collect()
        return compat.simple_transfer_results(fin, failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self.worker_handler is None:
            return set()
        return self.worker_handler.get_block_ids_with_load_errors()

    def shutdown(self):
        if self.worker_handler is not None:
            self.worker_handler.shutdown()
        return super().shutdown()

    # -- scheduler side -------------------------------------------------------------------
    # A request whose host load failed is recomputed on the device: vLLM's recompute
    # path puts it back in the waiting queue, and without this the same CPU hit would
    # be offered (and fail) again, forever, if the failure persists.
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if request.request_id in self._no_host_hit:
            return 0, False
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def request_finished(self, request, block_ids):
        self._no_host_hit.discard(request.request_id)
        return super().request_finished(request, block_ids)

    def request_finished_all_groups(self, request, block_ids):
        self._no_host_hit.discard(request.request_id)
        return super().request_finished_all_groups(request, block_ids)

    def _failed_load_requests(self, connector_output) -> set[str]:
        failed = compat.simple_failed_recving(connector_output)
        bad = set(connector_output.invalid_block_ids or ())
        if bad and self.scheduler_manager is not None:
            for attr in ("_reqs_to_load", "_abandoned_reqs_to_load"):
                for req_id, state in getattr(self.scheduler_manager, attr, {}).items():
                    tm = getattr(state, "transfer_meta", None)
                    if tm is not None and bad.intersection(tm.gpu_block_ids):
                        failed.add(req_id)
        return failed

    def update_connector_output(self, connector_output) -> None:
        if self.scheduler_manager is not None:
            failed_loads = self._failed_load_requests(connector_output)
            if failed_loads:
                logger.warning("simple offload: host loads failed for %s; recomputing them", sorted(failed_loads))
                self._no_host_hit |= failed_loads
        meta = connector_output.kv_connector_worker_meta
        if self.scheduler_manager is not None and isinstance(meta, NPUSimpleWorkerMetadata):
            failed = meta.failed_store_events
            if failed:
                logger.error("simple offload: store events %s failed; their blocks are not cached", sorted(failed))
                if self._can_abandon:
                    abandon_failed_stores(self.scheduler_manager, failed)
                elif self._store_releaser is not None:
                    pass  # below: also counts later reports of events it took over
                else:
                    # Never count a failed store as complete.
                    meta = NPUSimpleWorkerMetadata(
                        completed_store_events={
                            e: c for e, c in meta.completed_store_events.items() if e not in failed
                        }
                    )
                    connector_output.kv_connector_worker_meta = meta
            if self._store_releaser is not None and (failed or self._store_releaser.events):
                connector_output.kv_connector_worker_meta = self._store_releaser.filter(meta)
        super().update_connector_output(connector_output)


__all__ = ["FailedStoreReleaser", "NPUSimpleCPUOffloadConnector", "abandon_failed_stores"]
