"""``NPUOffloadingSpec``: our worker inside vLLM's own ``OffloadingConnector``.

Select it with ``kv_connector_extra_config = {"spec_name": "NPUOffloadingSpec",
"spec_module_path": "vllm_npu_offload.integration.spec", "cpu_bytes_to_use": ...}``.
The scheduler side (``CPUOffloadingManager`` with LRU/ARC) is vLLM's, unchanged; the
worker side is ``OffloadWorkerCore`` and works on CUDA, Ascend NPU and CPU.
"""

from __future__ import annotations

import dataclasses
import logging

from ..copy.base import Direction
from ..errors import OffloadConfigError
from ..memory import round_up
from ..offload_worker import DeviceKVTensor, GroupRef, OffloadWorkerCore, device_platform
from . import compat
from .options import resolve_cpu_bytes, validate_extra_config

logger = logging.getLogger(__name__)

_DIRECTION_NAMES = {Direction.D2H: ("GPU", "CPU"), Direction.H2D: ("CPU", "GPU")}


def core_from_canonical(kv_caches, blocks_per_chunk: int, num_chunks: int) -> OffloadWorkerCore:
    """Build the version-independent worker from vLLM's ``CanonicalKVCaches``."""
    tensors = [t.tensor for t in kv_caches.tensors]
    device = [DeviceKVTensor.from_block_view(t.tensor, t.page_size_bytes) for t in kv_caches.tensors]
    refs = [[GroupRef(r.tensor_idx, r.page_size_bytes) for r in group] for group in kv_caches.group_data_refs]
    return OffloadWorkerCore(device, refs, blocks_per_chunk, num_chunks, device_platform(tensors))


class _WorkerMixin:
    """Shared by every API generation: vLLM specs in, TransferResults out."""

    core: OffloadWorkerCore

    def _submit(self, job_id: int, direction: Direction, gpu_spec, cpu_spec) -> bool:
        self.core.submit(
            job_id,
            direction,
            gpu_spec.block_ids,
            list(gpu_spec.group_sizes),
            list(gpu_spec.block_indices),
            cpu_spec.block_ids,
        )
        return True

    def get_finished(self):
        out = []
        for r in self.core.poll():
            if not r.success:
                logger.error("KV offload job %d (%s) failed: %s", r.job_id, r.direction.name, r.error)
            out.append(
                compat.make_transfer_result(r.job_id, r.success, r.num_bytes, r.seconds, _DIRECTION_NAMES[r.direction])
            )
        return out

    def wait(self, job_ids) -> None:
        self.core.wait(job_ids)

    def shutdown(self) -> None:
        self.core.shutdown()


if compat.OffloadingWorker is not None:

    class NPUOffloadingWorker(_WorkerMixin, compat.OffloadingWorker):
        def __init__(self, core: OffloadWorkerCore):
            self.core = core

        def submit_store(self, job_id, src_spec, dst_spec) -> bool:
            return self._submit(job_id, Direction.D2H, src_spec, dst_spec)

        def submit_load(self, job_id, src_spec, dst_spec, *args, **kwargs) -> bool:
            return self._submit(job_id, Direction.H2D, dst_spec, src_spec)


class NPUOffloadingSpec(compat.CPUOffloadingSpec):
    """CPU offloading spec whose worker runs on any device through ``NPUDmaCopyBackend``."""

    def __init__(self, config):
        if compat.API != "config":
            raise RuntimeError(
                f"NPUOffloadingSpec for vLLM {compat.VLLM_VERSION} (API {compat.API!r}) is not supported yet"
            )
        extra = dict(config.extra_config)
        block_sizes = {g.tokens_per_block for g in config.groups}
        opts = validate_extra_config(
            extra,
            engine_block_size=block_sizes.pop() if len(block_sizes) == 1 else None,
            allowed_policies=compat.registered_cache_policies(),
        )
        per_chunk = config.worker_kv_bytes_per_block * config.parallel.world_size * config.cache.blocks_per_chunk
        if per_chunk > 0:
            extra["cpu_bytes_to_use"] = resolve_cpu_bytes(opts, per_chunk, self.BLOCK_SIZE_ALIGNMENT)
        elif opts.cpu_bytes_to_use is None:
            extra["cpu_bytes_to_use"] = 1  # placeholder until the KV size per block is known
        extra.pop("num_cpu_blocks", None)
        super().__init__(dataclasses.replace(config, extra_config=extra))
        if per_chunk > 0 and self.num_chunks <= 0:
            need = round_up(per_chunk, self.BLOCK_SIZE_ALIGNMENT)
            raise OffloadConfigError(
                f"kv_connector_extra_config['cpu_bytes_to_use']={extra['cpu_bytes_to_use']} holds no offloaded "
                f"block; one needs {need} bytes across all ranks"
            )

    def _uses_shared_region(self) -> bool:
        # Each rank owns an exact-size private host buffer (no shared mmap region).
        return False

    def get_worker(self, kv_caches):
        if self._worker is None:
            core = core_from_canonical(kv_caches, self.blocks_per_chunk, self.num_chunks)
            self._worker = NPUOffloadingWorker(core)
        return self._worker


__all__ = ["NPUOffloadingSpec", "core_from_canonical"]
