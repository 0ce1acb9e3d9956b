"""Worker side of ``NPUSimpleCPUOffloadConnector`` (vLLM types <-> ``simple_core``).

Same method names as vLLM's ``SimpleCPUOffloadWorker`` so the upstream connector's
delegation works unchanged; the logic lives in ``SimpleOffloadCore`` (bookkeeping)
and ``CoreTransport`` (the worker core that NPUOffloadingSpec uses too: CUDA, NPU, CPU).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Sequence

import torch
from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadMetadata, SimpleCPUOffloadWorkerMetadata

from ..copy.base import Direction
from ..errors import OffloadConfigError
from ..host_layout import HostLayout
from ..host_limits import check_host_allocation
from ..device_kv import DeviceKVTensor, dedupe_segments, device_platform, placement_segments, tensor_segments
from ..simple_core import CoreTransport, SimpleOffloadCore, StepPlan

from . import compat
from .options import SimpleOptions, staging_bytes_option

logger = logging.getLogger(__name__)


@dataclass
class NPUSimpleWorkerMetadata(SimpleCPUOffloadWorkerMetadata):
    """Adds failed stores. A failed store also counts in ``completed_store_events`` (so
    the per-event worker count still reaches world_size) and is listed here, so the
    scheduler side releases its blocks without making the host copy loadable."""

    failed_store_events: dict[int, int] = field(default_factory=dict)

    def aggregate(self, other):
        merged = dict(self.completed_store_events)
        for k, v in other.completed_store_events.items():
            merged[k] = merged.get(k, 0) + v
        failed = dict(self.failed_store_events)
        for k, v in getattr(other, "failed_store_events", {}).items():
            failed[k] = failed.get(k, 0) + v
        return NPUSimpleWorkerMetadata(completed_store_events=merged, failed_store_events=failed)


def step_plan(meta: SimpleCPUOffloadMetadata) -> StepPlan:
    return StepPlan(
        load_event=meta.load_event,
        load_host_blocks=meta.load_cpu_blocks,
        load_device_blocks=meta.load_gpu_blocks,
        load_event_to_reqs=meta.load_event_to_reqs,
        store_event=meta.store_event,
        store_device_blocks=meta.store_gpu_blocks,
        store_host_blocks=meta.store_cpu_blocks,
        need_flush=meta.need_flush,
    )


def flatten_kv_values(kv_caches: dict) -> list[tuple[str, torch.Tensor]]:
    """(layer, tensor) for tensor, list (Mamba) and tuple (Ascend K/V, MLA parts) values."""
    out = []
    for name, v in kv_caches.items():
        if isinstance(v, torch.Tensor):
            out.append((name, v))
        elif isinstance(v, (list, tuple)):
            for i, t in enumerate(v):
                if not isinstance(t, torch.Tensor):
                    raise OffloadConfigError(
                        f"kv_caches[{name!r}][{i}] is {type(t).__name__}; allowed: torch.Tensor"
                    )
                out.append((f"{name}.{i}", t))
        else:
            raise OffloadConfigError(
                f"kv_caches[{name!r}] is {type(v).__name__}; allowed: torch.Tensor, list or tuple of tensors"
            )
    return out


def kv_segments(kv_caches: dict, kv_cache_config) -> list[DeviceKVTensor]:
    """Device block regions. Plain tensors follow the allocation placement vLLM
    describes (``KVCacheTensor`` offsets/strides); lists/tuples are analysed per tensor."""
    num_blocks = kv_cache_config.num_blocks
    placements = list(getattr(kv_cache_config, "kv_cache_tensors", None) or [])
    plain = all(isinstance(v, torch.Tensor) for v in kv_caches.values())
    segs: list[DeviceKVTensor] = []
    # vLLM >= 0.29 places layers with layers/layer_stride/block_stride/offset; 0.26-0.28's KVCacheTensor
    # has block_stride and offset but names layers in shared_by: those are analysed per tensor.
    if plain and placements and all(hasattr(p, "layer_stride") for p in placements):
        for p in placements:
            name = next((n for n in p.layers if n in kv_caches), None)
            if name is None:
                continue
            st = kv_caches[name].untyped_storage()
            segs += placement_segments(
                st.data_ptr(), st.nbytes(), p.offset, p.layer_stride, p.block_stride, len(p.layers), num_blocks
            )
    else:
        for _, t in flatten_kv_values(kv_caches):
            segs += tensor_segments(t, num_blocks)
    return dedupe_segments(segs)


@dataclass(frozen=True)
class HostSize:
    """This rank's host KV for the Simple connector: one record per host block, holding every
    device segment's page (all layers, K and V), as ``HostLayout`` lays it out."""

    blocks: int  # exactly the CPU blocks vLLM's simple scheduler hands out ids for
    record_bytes: int  # one host block: the segments' pages, 64-byte aligned
    capacity: int  # this rank's share of the size key

    @property
    def nbytes(self) -> int:
        return self.blocks * self.record_bytes

    def describe(self) -> str:
        return (f"{self.blocks} host blocks x {self.record_bytes} bytes "
                f"for a per-rank capacity of {self.capacity} bytes")


def host_size(kv_cache_config, cpu_capacity_bytes: int, page_bytes: Sequence[int]) -> HostSize:
    """Host blocks = the scheduler's CPU block count, derived by vLLM's own code for the
    installed version (0.21-0.28 divide the capacity by the sum of their per-layer tensors, >= 0.29
    by the one shared allocation), so every block id it hands out exists here and no block is
    allocated that it never uses."""
    blocks = compat.simple_scheduler_cpu_blocks(kv_cache_config, cpu_capacity_bytes)
    size = HostSize(blocks, HostLayout.build(page_bytes, 1, blocks).record_bytes, cpu_capacity_bytes)
    if size.nbytes > cpu_capacity_bytes * 1.01:
        logger.warning(
            "NPUSimpleCPUOffloadWorker: %s need %d bytes, %.1f%% above this rank's capacity: the registered KV "
            "caches hold more bytes per block than vLLM's scheduler counted when it derived its block count",
            size.describe(), size.nbytes, 100 * (size.nbytes / cpu_capacity_bytes - 1),
        )
    return size


class NPUSimpleCPUOffloadWorker:
    def __init__(self, vllm_config, kv_cache_config, cpu_capacity_bytes: int, options: SimpleOptions | None = None):
        # options: the validated extra config; its size key and value name the setting in errors
        self.options = options or SimpleOptions("cpu_bytes_to_use", cpu_capacity_bytes)
        if cpu_capacity_bytes <= 0:
            raise OffloadConfigError(
                f"kv_connector_extra_config[{self.options.size_key!r}]={cpu_capacity_bytes} must be a positive "
                "byte count"
            )
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.cpu_capacity_bytes = cpu_capacity_bytes
        self.staging_bytes = staging_bytes_option(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or [None]
        # vLLM maps flat invalid block ids to requests only with one KV cache group;
        # with several it wants failed requests (failed_recving; vLLM 0.23 has none).
        self.report_block_errors = len(groups) == 1
        self.core: SimpleOffloadCore | None = None
        self.transport: CoreTransport | None = None
        self._meta: SimpleCPUOffloadMetadata | None = None

    def register_kv_caches(self, kv_caches: dict) -> None:
        if not kv_caches:
            logger.warning("NPUSimpleCPUOffloadWorker: no KV caches to offload")
            return
        segments = kv_segments(kv_caches, self.kv_cache_config)
        platform = device_platform([t for _, t in flatten_kv_values(kv_caches)])
        size = host_size(self.kv_cache_config, self.cpu_capacity_bytes, [s.page_bytes for s in segments])
        check_host_allocation(size.nbytes, self.options.size_key, self.options.size_value, size.describe())
        self.transport = CoreTransport.from_segments(segments, size.blocks, platform, staging_bytes=self.staging_bytes)
        self.core = SimpleOffloadCore(self.transport)
        logger.info(
            "NPUSimpleCPUOffloadWorker on %s: %d segments, %d host blocks x %d bytes = %d bytes (%.2f GiB, %s) "
            "for a per-rank capacity of %d bytes",
            platform.kind, len(segments), size.blocks, size.record_bytes, self.transport.host.nbytes,
            self.transport.host.nbytes / 2**30, "pinned" if self.transport.host.pinned else "pageable",
            self.cpu_capacity_bytes,
        )

    # -- step hooks ---------------------------------------------------------------------
    def bind_connector_metadata(self, metadata: SimpleCPUOffloadMetadata) -> None:
        self._meta = metadata
        if self.core is not None:
            self.core.bind(step_plan(metadata))

    def clear_connector_metadata(self) -> None:
        self._meta = None

    def start_load_kv(self) -> None:
        if self.core is not None:
            self.core.launch(Direction.H2D)

    def wait_for_save(self) -> None:
        if self.core is not None:
            self.core.launch(Direction.D2H)

    def handle_preemptions(self, metadata: SimpleCPUOffloadMetadata) -> None:
        if metadata.need_flush and self.core is not None:
            self.core.flush()

    # -- reporting ----------------------------------------------------------------------
    def collect(self) -> tuple[set[str], set[str]]:
        if self.core is None:
            return set(), set()
        fin, failed = self.core.collect()
        if self.report_block_errors:
            return fin, set()
        self.core.take_load_errors()  # reported per request instead
        return fin, failed

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # Finished/aborted requests with a load in flight are still reported when it
        # completes: the scheduler defers their cleanup until then.
        fin, failed = self.collect()
        if failed and not compat.SIMPLE_HAS_FAILED_RECVING:
            # vLLM 0.23 (the engine calls get_finished) has no per-request load failure and maps
            # load-error block ids to requests for one KV-cache group only. Finishing these requests
            # would serve wrong KV, withholding them would hang them: fail the step instead.
            raise RuntimeError(
                f"simple offload: host KV loads failed for requests {sorted(failed)} with "
                f"{len(self.kv_cache_config.kv_cache_groups)} KV-cache groups; vLLM {compat.VLLM_VERSION} "
                "cannot fail or recompute them (it has no failed_recving)"
            )
        return None, fin or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self.core is None or not self.report_block_errors:
            return set()
        return self.core.take_load_errors()

    def build_connector_worker_meta(self) -> NPUSimpleWorkerMetadata | None:
        if self.core is None:
            return None
        ok, bad = self.core.take_store_results()
        if not ok and not bad:
            return None
        return NPUSimpleWorkerMetadata(
            completed_store_events={e: 1 for e in ok | bad},
            failed_store_events={e: 1 for e in bad},
        )

    def shutdown(self) -> None:
        if self.core is not None:
            self.core.shutdown()
            self.core = None
