"""Drive vLLM 0.23's real Scheduler and worker-role connector without a model.

The scheduler-role connector (``OffloadingConnector`` with its ``CPUOffloadingManager``, or a
``SimpleCPUOffloadConnector`` with its ``SimpleCPUOffloadScheduler``) lives inside
``Scheduler``; a separate worker-role connector gets CPU "device" KV tensors through
``register_kv_caches``. Each step runs what the engine core and model runner would: schedule,
connector worker hooks, a fake model output, ``update_from_output``. For the offloading
connector every job the spec's ``OffloadWorkerCore`` receives is recorded so tests can check
bytes block by block.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, resolve_kv_cache_block_sizes
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from vllm_npu_offload.copy.base import Direction

BLOCK = 16
NB = 24  # device blocks
HEADS, HEAD = 2, 32
PAGE = 2 * BLOCK * HEADS * HEAD * 4  # K+V bytes per block and layer (float32)
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
PROMPT = list(range(1, 101))  # 100 tokens: 6 full blocks
SPEC_EXTRA = {"spec_name": "NPUOffloadingSpec", "spec_module_path": "vllm_npu_offload.integration.spec"}

init_none_hash(sha256)


def vllm_config(
    model: str, extra: dict, connector: str = "OffloadingConnector", module: str | None = None, spec: bool = True
) -> VllmConfig:
    """``spec``: add the NPUOffloadingSpec keys (``OffloadingConnector`` family) to ``extra``."""
    model_config = ModelConfig(model=model, dtype="float32", seed=0)
    return VllmConfig(
        model_config=model_config,
        scheduler_config=SchedulerConfig(
            max_num_seqs=4,
            max_num_batched_tokens=512,
            max_model_len=2048,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector=connector,
            kv_connector_module_path=module,
            kv_role="kv_both",
            kv_connector_extra_config={**(SPEC_EXTRA if spec else {}), **extra},
        ),
        device_config=DeviceConfig("cpu"),
    )


def kv_cache_config(num_blocks: int, layers: list[str], heads: int, head_size: int, page_bytes: int) -> KVCacheConfig:
    """One full-attention group; each layer owns ``page_bytes`` per block (as vLLM sizes its tensors)."""
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[KVCacheTensor(size=num_blocks * page_bytes, shared_by=[name]) for name in layers],
        kv_cache_groups=[
            KVCacheGroupSpec(
                layers,
                FullAttentionSpec(block_size=BLOCK, num_kv_heads=heads, head_size=head_size, dtype=torch.float32),
            )
        ],
    )


@dataclass
class Job:
    job_id: int
    direction: Direction
    device_blocks: list[int]
    chunks: list[int]


@dataclass
class Engine:
    sched: Scheduler
    worker: object  # worker-role connector
    jobs: list[Job] = field(default_factory=list)
    _next_req: int = 0

    @classmethod
    def build(cls, vc: VllmConfig, kcc: KVCacheConfig, kv_caches: dict, connector_cls, record: bool = True) -> "Engine":
        """``record``: log every job our spec's core receives (needs NPUOffloadingSpec)."""
        block_size, hash_block_size = resolve_kv_cache_block_sizes(kcc, vc)
        vc.cache_config.num_gpu_blocks = kcc.num_blocks
        sched = Scheduler(
            vllm_config=vc,
            kv_cache_config=kcc,
            log_stats=True,
            structured_output_manager=StructuredOutputManager(vc),
            block_size=block_size,
            hash_block_size=hash_block_size,
        )
        worker = connector_cls(vc, KVConnectorRole.WORKER, kcc)
        with set_current_vllm_config(vc):
            worker.register_kv_caches(kv_caches)
        eng = cls(sched, worker)
        if record and hasattr(worker, "connector_worker"):  # OffloadingConnector family
            eng._record(eng.core)
        return eng

    @property
    def spec(self):
        return self.worker.connector_worker.spec

    @property
    def manager(self):
        return self.sched.connector.connector_scheduler.manager

    @property
    def core(self):
        store, load = self.spec._npu_handlers
        assert store.core is load.core
        return store.core

    def _record(self, core) -> None:
        submit = core.submit

        def recording(job_id, direction, device_block_ids, group_sizes, block_indices, chunk_ids):
            self.jobs.append(Job(job_id, direction, [int(b) for b in device_block_ids], [int(c) for c in chunk_ids]))
            return submit(job_id, direction, device_block_ids, group_sizes, block_indices, chunk_ids)

        core.submit = recording

    def run(self, prompt: list[int], max_tokens: int = 2, max_steps: int = 50) -> Request:
        """Add one request and step until it has finished and no offload job is pending."""
        self._next_req += 1
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        req = Request(
            f"req-{self._next_req}", prompt, params, None,
            block_hasher=get_request_block_hasher(self.sched.cache_config.block_size, sha256),
        )
        self.sched.add_request(req)
        for _ in range(max_steps):
            if not self.sched.requests and not self.transfers_pending():
                return req
            self.step()
        raise AssertionError(f"request did not finish in {max_steps} steps")

    def transfers_pending(self) -> bool:
        c = self.sched.connector
        if hasattr(c, "connector_scheduler"):  # OffloadingConnector
            return bool(c.connector_scheduler._jobs)
        m = c.scheduler_manager  # SimpleCPUOffloadConnector
        return bool(m._store_event_to_blocks or m._reqs_to_load or getattr(c, "_store_releaser", None)
                    and c._store_releaser.events)

    def step(self) -> None:
        so = self.sched.schedule()
        meta = so.kv_connector_metadata
        w = self.worker
        w.handle_preemptions(meta)
        w.bind_connector_metadata(meta)
        w.start_load_kv(None)
        w.wait_for_save()
        sending, recving = w.get_finished(so.finished_req_ids)
        invalid = w.get_block_ids_with_load_errors()
        worker_meta = w.build_connector_worker_meta() or OffloadingWorkerMetadata()
        w.clear_connector_metadata()
        ids = [r.request_id for r in self.sched.running]
        out = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[[7] for _ in ids],
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=None,
            kv_connector_output=KVConnectorOutput(
                finished_sending=sending, finished_recving=recving, kv_connector_worker_meta=worker_meta,
                invalid_block_ids=invalid,
            ),
        )
        self.sched.update_from_output(so, out)

    def reset_device_prefix_cache(self) -> None:
        assert self.sched.kv_cache_manager.reset_prefix_cache()


def stacked_caches(layers: list[str] = LAYERS, num_blocks: int = NB, heads: int = HEADS, head_size: int = HEAD,
                   seed: int = 1) -> dict:
    """Upstream layout: one random (num_blocks, 2, block, heads, head) tensor per layer."""
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(num_blocks, 2, BLOCK, heads, head_size, generator=g) for n in layers}


def parts_of(kv_caches: dict) -> list[torch.Tensor]:
    return [p for v in kv_caches.values() for p in (v if isinstance(v, (tuple, list)) else (v,))]


def block_bytes(parts: list[torch.Tensor], b: int) -> list[torch.Tensor]:
    return [p[b].contiguous().reshape(-1).view(torch.uint8).clone() for p in parts]


def host_block(chunks: list[int], i: int, bpc: int) -> int:
    """Host block holding the ``i``-th device block of a job that starts at a chunk boundary."""
    return chunks[i // bpc] * bpc + i % bpc
