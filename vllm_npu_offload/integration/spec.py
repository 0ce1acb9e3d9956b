"""``NPUOffloadingSpec``: our worker inside vLLM's own ``OffloadingConnector``.

Select it with ``kv_connector_extra_config = {"spec_name": "NPUOffloadingSpec",
"spec_module_path": "vllm_npu_offload.integration.spec", "cpu_bytes_to_use": ...}``.
The scheduler side (``CPUOffloadingManager`` with LRU/ARC) is vLLM's, unchanged; the
worker side is ``OffloadWorkerCore`` and works on CUDA, Ascend NPU and CPU. The same class
serves vLLM 0.21-0.24 (``get_handlers``), 0.25 (``get_worker``) and >= 0.26
(``OffloadingConfig``); ``compat`` holds the differences.
"""

from __future__ import annotations

import atexit
from typing import Sequence

from ..errors import OffloadConfigError
from ..host_limits import check_host_allocation
from ..memory import round_up
from ..device_kv import DeviceKVTensor, GroupRef, device_platform
from ..offload_worker import OffloadWorkerCore
from . import compat
from .job_router import ResultRouter
from .layer_groups import LayerGroups, split_layer_groups
from .tier_options import TIER_KEYS, check_disk_path, disk_options, mooncake_options, tier_order
from .options import (
    LAYERWISE_KEYS,
    SPEC_KEYS,
    check_layerwise_owner,
    layerwise_options,
    reject_unknown_keys,
    resolve_cpu_bytes,
    staging_bytes_option,
    validate_extra_config,
)
from .tiered_manager import TieredManager, tier_metrics
from .workers import NPUOffloadingWorker, handler_pair
from ..tiers.contract import RecordIdentity
from ..tiers.channel import socket_path
from ..tiers.disk_tier import DiskTier, DiskTierConfig
from ..tiers.disk_worker import DiskTierServer
from ..tiers.mooncake_store import MooncakeConfig, MooncakeRankServer, MooncakeTier, MooncakeTierConfig, tier_address

PREFETCH_HOST_SHARE = 4  # the prefetch window holds at most this share of the host chunks (1/4)


def _identity(core: OffloadWorkerCore, facts) -> RecordIdentity:
    lay = core.layout
    return RecordIdentity(model=facts.model, kv_dtype=facts.kv_dtype, page_bytes=tuple(lay.page_bytes),
                          page_offsets=tuple(lay.page_offsets), record_bytes=lay.record_bytes,
                          blocks_per_chunk=lay.blocks_per_chunk, world_size=facts.world_size)


def start_disk_worker(core: OffloadWorkerCore, root: str, facts) -> DiskTierServer:
    """This rank's disk tier worker over the core's host buffer (records of its own share)."""
    host = memoryview(core.host.tensor.numpy()).cast("B")
    server = DiskTierServer(host, _identity(core, facts), facts.rank, root,
                            socket_path(facts.engine_id, root, facts.rank))
    atexit.register(server.shutdown)  # the socket file goes with the process
    return server


def start_mooncake_worker(core: OffloadWorkerCore, cfg: MooncakeConfig, facts) -> MooncakeRankServer:
    """This rank's Mooncake tier worker: its host buffer registered with the pool once."""
    host = memoryview(core.host.tensor.numpy()).cast("B")
    server = MooncakeRankServer(host, _identity(core, facts), facts.rank, cfg,
                                tier_address(cfg, facts.engine_id, facts.rank))
    atexit.register(server.shutdown)
    return server


def canonical_refs(kv_caches) -> list[list[GroupRef]]:
    """Per vLLM KV group, its pages in ``CanonicalKVCaches`` as the core's ``GroupRef``s."""
    return [[GroupRef(r.tensor_idx, r.page_size_bytes) for r in group] for group in kv_caches.group_data_refs]


def core_from_canonical(kv_caches, blocks_per_chunk: int, num_chunks: int, staging_bytes: int | None = None,
                        extra_groups: Sequence[Sequence[GroupRef]] = ()) -> OffloadWorkerCore:
    """Build the version-independent worker from vLLM's ``CanonicalKVCaches``; ``extra_groups`` (layer
    groups) follow vLLM's groups as more core groups over the same blocks."""
    tensors = [t.tensor for t in kv_caches.tensors]
    device = [DeviceKVTensor.from_block_view(t.tensor, t.page_size_bytes) for t in kv_caches.tensors]
    refs = canonical_refs(kv_caches) + [list(g) for g in extra_groups]
    return OffloadWorkerCore(device, refs, blocks_per_chunk, num_chunks, device_platform(tensors),
                             staging_bytes=staging_bytes)


class NPUOffloadingSpec(compat.ExtraConfigOverride, compat.CPUOffloadingSpec):
    """CPU offloading spec whose worker runs on any device through ``NPUDmaCopyBackend``.

    Takes whatever the installed ``OffloadingSpec`` takes: ``(config)`` on vLLM >= 0.26,
    ``(vllm_config, kv_cache_config)`` on 0.21-0.25.
    """

    def __init__(self, *args, **kwargs):
        inp = compat.spec_inputs(args, kwargs)
        check_layerwise_owner(inp.extra)
        reject_unknown_keys(
            inp.extra,
            SPEC_KEYS + LAYERWISE_KEYS + TIER_KEYS + compat.OFFLOADING_KEYS + compat.ASCEND_KEYS,
            f"NPUOffloadingSpec on vLLM {compat.VLLM_VERSION}",
        )
        layerwise_options(inp.extra)  # checked at start-up; NPUOffloadingConnector acts on it
        opts = validate_extra_config(
            inp.extra,
            engine_block_size=inp.engine_block_size,
            allowed_policies=compat.registered_cache_policies(),
        )
        self._staging_bytes = staging_bytes_option(inp.extra)
        self._disk = disk_options(inp.extra)
        if self._disk is not None and not compat.TIERS_SUPPORTED:
            raise OffloadConfigError(f"kv_connector_extra_config['disk_path']: the disk tier needs vLLM >= 0.23 "
                                     f"(installed: {compat.VLLM_VERSION})")
        if self._disk is not None:
            check_disk_path(self._disk)  # each rank's tier server finds out for itself whether it may write
        self._mooncake = mooncake_options(inp.extra)
        if self._mooncake is not None and not compat.TIERS_SUPPORTED:
            raise OffloadConfigError(f"kv_connector_extra_config['mooncake_master']: the Mooncake tier needs vLLM "
                                     f">= 0.23 (installed: {compat.VLLM_VERSION})")
        configured = [n for n, o in (("disk", self._disk), ("mooncake", self._mooncake)) if o is not None]
        self._tier_order = tier_order(inp.extra, configured)
        self._facts = compat.engine_facts(args, kwargs) if configured else None
        self._tier_manager = None
        self._tier_servers: list = []
        bpc = inp.blocks_per_chunk or opts.blocks_per_chunk
        self._engine_block_size = inp.engine_block_size
        extra = compat.base_extra(inp.extra, inp.engine_block_size, bpc)
        per_chunk = inp.bytes_per_block * bpc
        if per_chunk > 0:
            extra["cpu_bytes_to_use"] = resolve_cpu_bytes(opts, per_chunk, compat.CPU_CHUNK_ALIGNMENT)
        elif opts.cpu_bytes_to_use is None:
            extra["cpu_bytes_to_use"] = 1  # placeholder until the KV size per block is known
        compat.init_base(self, args, kwargs, extra)
        self._npu_worker = None
        self._npu_handlers = None
        self.npu_router: ResultRouter | None = None  # the worker core's results (set with the core)
        self._layer_plan: tuple[tuple[str, ...], int] | None = None
        self.layer_groups: LayerGroups | None = None
        # The setting that sized the host buffer, for the memory check's message.
        size_key = "cpu_bytes_to_use" if opts.num_cpu_blocks is None else "num_cpu_blocks"
        self._npu_size_setting = (size_key, inp.extra[size_key])
        if per_chunk > 0 and self.geometry[1] <= 0:
            need = round_up(per_chunk, compat.CPU_CHUNK_ALIGNMENT)
            raise OffloadConfigError(
                f"kv_connector_extra_config['cpu_bytes_to_use']={extra['cpu_bytes_to_use']} holds no offloaded "
                f"block; one needs {need} bytes across all ranks"
            )

    @property
    def geometry(self) -> tuple[int, int]:
        """(engine blocks per host chunk, host chunks per rank)."""
        return compat.chunk_geometry(self)

    def _uses_shared_region(self) -> bool:
        # Each rank owns an exact-size private host buffer (no shared mmap region).
        return False

    def use_layer_groups(self, layer_names: Sequence[str], groups: int) -> None:
        """Layer-wise mode (``NPUOffloadingConnector``, before registration): the core also gets the
        one KV group's layers, in ``layer_names`` order (vLLM's), as ``groups`` layer groups."""
        self._layer_plan = (tuple(layer_names), groups)

    def _new_core(self, kv_caches) -> ResultRouter:
        # Only workers build a core, right before allocating this rank's host buffer: the
        # scheduler's spec never allocates (and may run after the workers took their memory).
        bpc, chunks = self.geometry
        per_block = sum(t.page_size_bytes for t in kv_caches.tensors)
        key, value = self._npu_size_setting
        check_host_allocation(
            per_block * bpc * chunks, key, value,
            f"{chunks} chunks x {bpc} blocks x {per_block} bytes of KV per block on this rank",
        )
        extra: tuple = ()
        if self._layer_plan is not None:
            names, groups = self._layer_plan
            self.layer_groups = split_layer_groups(names, canonical_refs(kv_caches)[0], groups)
            extra = self.layer_groups.refs
        core = core_from_canonical(kv_caches, bpc, chunks, staging_bytes=self._staging_bytes, extra_groups=extra)
        self.npu_router = ResultRouter(core)
        if self._disk is not None:
            self._tier_servers.append(start_disk_worker(core, self._disk.path, self._facts))
        if self._mooncake is not None:
            self._tier_servers.append(start_mooncake_worker(core, self._mooncake, self._facts))
        return self.npu_router

    @classmethod
    def build_metric_definitions(cls, extra_config):
        """vLLM >= 0.28's metrics of the host tier, plus each configured lower tier's."""
        defs = dict(super().build_metric_definitions(extra_config))
        for name, key in (("disk", "disk_path"), ("mooncake", "mooncake_master")):
            if extra_config.get(key):
                defs.update(compat.tier_metric_definitions(*tier_metrics(name)))
        return defs

    def get_manager(self):
        """The host tier's manager (vLLM's), wrapped by ours when lower tiers are configured (``disk_path``,
        ``mooncake_master``), in ``tier_order``."""
        host = super().get_manager()
        if not self._tier_order:
            return host
        if self._tier_manager is None:
            tokens_per_key = self.geometry[0] * (self._engine_block_size or 1)
            world, engine = self._facts.world_size, self._facts.engine_id
            made = {}
            if self._disk is not None:
                d = self._disk
                made["disk"] = DiskTier(DiskTierConfig(
                    root=d.path, budget_bytes=d.budget_bytes, world_size=world, engine_id=engine,
                    tokens_per_key=tokens_per_key, read_timeout_s=d.read_timeout_s, read_queue_s=d.read_queue_s,
                    prefill_tokens_per_s=d.prefill_tokens_per_s, rescan_s=d.rescan_s, admit=d.admit))
            if self._mooncake is not None:
                made["mooncake"] = MooncakeTier(MooncakeTierConfig(
                    store=self._mooncake, world_size=world, engine_id=engine, tokens_per_key=tokens_per_key))
            # the prefetch window for waiting requests (NPUOffloadingConnector): a quarter of host at most
            self._tier_manager = TieredManager(host, [made[n] for n in self._tier_order],
                                               prefetch_chunks=self.geometry[1] // PREFETCH_HOST_SHARE)
        return self._tier_manager

    def get_worker(self, kv_caches):
        """vLLM >= 0.25: one worker for both directions."""
        if self._npu_worker is None:
            self._npu_worker = NPUOffloadingWorker(self._new_core(kv_caches))
        return self._npu_worker

    def get_handlers(self, kv_caches):
        """vLLM 0.21-0.24: (GPU->CPU store handler) and (CPU->GPU load handler) over one core."""
        if self._npu_handlers is None:
            self._npu_handlers = handler_pair(self._new_core(kv_caches))
        store, load = self._npu_handlers
        yield compat.GPULoadStoreSpec, compat.CPULoadStoreSpec, store
        yield compat.CPULoadStoreSpec, compat.GPULoadStoreSpec, load


__all__ = ["NPUOffloadingSpec", "canonical_refs", "core_from_canonical"]
