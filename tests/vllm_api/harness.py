"""Drive the installed vLLM's real Scheduler and worker-role connector without a model
(any release from 0.21 on; scripts/dev/setup_vllm.sh builds one venv per release).

The scheduler-role connector (``OffloadingConnector`` with its ``CPUOffloadingManager``, or a
``SimpleCPUOffloadConnector`` with its ``SimpleCPUOffloadScheduler``) lives inside
``Scheduler``; a separate worker-role connector gets CPU "device" KV tensors through
``register_kv_caches``. Each step runs what the engine core and model runner would: schedule,
connector worker hooks, a fake model output, ``update_from_output``. For the offloading
connector every job the spec's ``OffloadWorkerCore`` receives is recorded so tests can check
bytes block by block.

What differs between releases is kept to this file: how ``KVCacheTensor`` describes the
device allocation (``placed_layers``), how a spec is constructed (``make_spec``) and how the
model runner collects transfer results (``step``).
"""

from __future__ import annotations

import dataclasses
import re
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
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, resolve_kv_cache_block_sizes
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from vllm_npu_offload.copy.base import Direction
from vllm_npu_offload.integration import compat

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


# vLLM >= 0.29 describes each layer's place in one allocation (KVCacheTensor.layers / layer_stride /
# block_stride / offset) and its model runner hands out views into it; older releases give every
# layer (KVCacheTensor.shared_by) its own tensor.
placed_layers = "layers" in {f.name for f in dataclasses.fields(KVCacheTensor)}


def kv_cache_config(num_blocks: int, layers: list[str], heads: int, head_size: int, page_bytes: int) -> KVCacheConfig:
    """One full-attention group; each layer owns ``page_bytes`` per block, placed as the installed
    vLLM places it (see ``stacked_caches``)."""
    if placed_layers:
        region = num_blocks * page_bytes
        tensors = [
            KVCacheTensor(size=region * len(layers), layers=[n], layer_stride=region, block_stride=page_bytes,
                          offset=i * region)
            for i, n in enumerate(layers)
        ]
    else:
        tensors = [KVCacheTensor(size=num_blocks * page_bytes, shared_by=[name]) for name in layers]
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=tensors,
        kv_cache_groups=[
            KVCacheGroupSpec(
                layers,
                FullAttentionSpec(block_size=BLOCK, num_kv_heads=heads, head_size=head_size, dtype=torch.float32),
            )
        ],
    )


def _worker_reads_attn_backends() -> bool:
    """vLLM 0.21-0.22's OffloadingConnectorWorker asks each layer's attention backend for its KV
    shape (the model's layers, found in the static forward context); later releases do not."""
    import inspect

    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import OffloadingConnectorWorker

    return "get_attn_backend" in inspect.getsource(OffloadingConnectorWorker.register_kv_caches)


class _BlocksFirstBackend:
    """The KV shape of ``stacked_caches``: (num_blocks, 2, block, heads, head), blocks outermost."""

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
        return (num_blocks, 2, block_size, num_kv_heads, head_size)


def register_attention_layers(vc: VllmConfig, layers: list[str]) -> None:
    """Stand in for the model's attention layers where the worker-side connector looks them up."""
    if not _worker_reads_attn_backends():
        return
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    class FakeAttention(AttentionLayerBase):
        def get_attn_backend(self):
            return _BlocksFirstBackend

        def get_kv_cache_spec(self, vllm_config):
            return None

    ctx = vc.compilation_config.static_forward_context
    for name in layers:
        ctx.setdefault(name, FakeAttention())


def make_spec(cls, vc: VllmConfig, kcc: KVCacheConfig):
    """Construct an ``OffloadingSpec`` subclass as the installed vLLM's factory does."""
    if compat.API == "config":  # >= 0.26: the spec takes an OffloadingConfig
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import build_offloading_config

        return cls(build_offloading_config(vc, kcc))
    return cls(vc, kcc)


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
    layers: list[str] = field(default_factory=list)  # attention layers, in forward order (the layer hooks)
    moved: dict = field(default_factory=lambda: {"store": 0, "load": 0})  # bytes vLLM's stats counted
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
        register_attention_layers(vc, [n for g in kcc.kv_cache_groups for n in g.layer_names])
        with set_current_vllm_config(vc):
            worker.register_kv_caches(kv_caches)
        eng = cls(sched, worker, layers=[n for g in kcc.kv_cache_groups for n in g.layer_names])
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
        return spec_core(self.spec)

    def _record(self, core) -> None:
        submit = core.submit

        def recording(job_id, direction, device_block_ids, group_sizes, block_indices, chunk_ids):
            self.jobs.append(Job(job_id, direction, [int(b) for b in device_block_ids], [int(c) for c in chunk_ids]))
            return submit(job_id, direction, device_block_ids, group_sizes, block_indices, chunk_ids)

        core.submit = recording

    def add(self, prompt: list[int], max_tokens: int = 2) -> Request:
        """Add one request (``step`` runs it)."""
        self._next_req += 1
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        req = Request(
            f"req-{self._next_req}", prompt, params, None,
            block_hasher=get_request_block_hasher(self.sched.cache_config.block_size, sha256),
        )
        self.sched.add_request(req)
        return req

    def run(self, prompt: list[int], max_tokens: int = 2, max_steps: int = 50) -> Request:
        """Add one request and step until it has finished and no offload job is pending."""
        req = self.add(prompt, max_tokens)
        self.settle(max_steps)
        return req

    def settle(self, max_steps: int = 50) -> None:
        """Step until no request is left and no offload job is pending."""
        for _ in range(max_steps):
            if not self.sched.requests and not self.transfers_pending():
                return
            self.step()
        raise AssertionError(f"requests did not finish in {max_steps} steps")

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
        for name in self.layers:  # the forward: each attention layer's hook (maybe_transfer_kv_layer)
            w.wait_for_layer_load(name)
        w.wait_for_save()
        failed = {}
        if hasattr(KVConnectorBase_V1, "get_transfer_results"):  # what the model runner calls (>= 0.30)
            res = w.get_transfer_results(so.finished_req_ids)
            sending, recving = res.finished_sending, res.finished_recving
            failed = {"failed_recving": res.failed_recving}
        else:
            sending, recving = w.get_finished(so.finished_req_ids)
        invalid = w.get_block_ids_with_load_errors()
        if hasattr(w, "connector_worker"):  # OffloadingConnector family: vLLM's transfer stats
            self._count_stats(w)
        worker_meta = w.build_connector_worker_meta() or OffloadingWorkerMetadata()
        ts = getattr(worker_meta, "transfer_stats", None)  # >= 0.26: stats travel in the worker metadata
        if ts is not None:
            self.moved["store"] += ts.store.bytes
            self.moved["load"] += ts.load.bytes
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
                invalid_block_ids=invalid, **failed,
            ),
        )
        self.sched.update_from_output(so, out)

    def _count_stats(self, w) -> None:
        """0.21-0.25: the worker-side connector's KVConnectorStats (one op per finished job)."""
        stats = w.get_kv_connector_stats()
        for key, ops in (getattr(stats, "data", None) or {}).items():
            if key in ("GPU_to_CPU", "CPU_to_GPU"):
                size = sum(op["op_size"] if isinstance(op, dict) else op.op_size for op in ops)
                self.moved["store" if key == "GPU_to_CPU" else "load"] += size

    def reset_device_prefix_cache(self) -> None:
        assert self.sched.kv_cache_manager.reset_prefix_cache()


def stacked_caches(layers: list[str] = LAYERS, num_blocks: int = NB, heads: int = HEADS, head_size: int = HEAD,
                   seed: int = 1) -> dict:
    """Upstream layout: a random (num_blocks, 2, block, heads, head) tensor per layer; views into one
    allocation where ``kv_cache_config`` places layers in one (``placed_layers``)."""
    g = torch.Generator().manual_seed(seed)
    if placed_layers:
        buf = torch.randn(len(layers), num_blocks, 2, BLOCK, heads, head_size, generator=g)
        return {n: buf[i] for i, n in enumerate(layers)}
    return {n: torch.randn(num_blocks, 2, BLOCK, heads, head_size, generator=g) for n in layers}


def spec_core(spec):
    """The ``OffloadWorkerCore`` behind our spec's worker side (handlers or one worker)."""
    if spec._npu_handlers is not None:  # 0.21-0.24: two handlers over one core
        store, load = spec._npu_handlers
        core_of = (lambda h: h.core) if hasattr(store, "core") else (lambda h: h.shared.core)
        assert core_of(store) is core_of(load)
        return core_of(store)
    return spec._npu_worker.core


def parts_of(kv_caches: dict) -> list[torch.Tensor]:
    return [p for v in kv_caches.values() for p in (v if isinstance(v, (tuple, list)) else (v,))]


def block_bytes(parts: list[torch.Tensor], b: int) -> list[torch.Tensor]:
    return [p[b].contiguous().reshape(-1).view(torch.uint8).clone() for p in parts]


def host_block(chunks: list[int], i: int, bpc: int) -> int:
    """Host block holding the ``i``-th device block of a job that starts at a chunk boundary."""
    return chunks[i // bpc] * bpc + i % bpc


_EXTRA_READ = re.compile(r"""(?:extra_config|kv_connector_extra_config)\s*(?:\.get\(\s*|\[\s*)["']([a-z_]+)["']""")


def extra_keys_read(*rel_paths: str) -> set[str]:
    """kv_connector_extra_config keys the installed vLLM's sources under ``rel_paths`` (files or
    folders, relative to the vllm package) read by name: ``extra_config.get("k"``, ``extra_config["k"]``."""
    import pathlib

    import vllm

    root = pathlib.Path(vllm.__file__).parent
    keys: set[str] = set()
    for rel in rel_paths:
        path = root / rel
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path] if path.exists() else []
        for f in files:
            keys |= set(_EXTRA_READ.findall(f.read_text()))
    return keys


# The OffloadingConnector family (tiering/ is TieringOffloadingSpec's, never ours) and the simple connector.
OFFLOADING_SOURCES = ("v1/kv_offload/factory.py", "v1/kv_offload/base.py", "v1/kv_offload/config.py",
                      "v1/kv_offload/cpu", "distributed/kv_transfer/kv_connector/v1/offloading_connector.py",
                      "distributed/kv_transfer/kv_connector/v1/offloading")
SIMPLE_SOURCES = ("distributed/kv_transfer/kv_connector/v1/simple_cpu_offload_connector.py", "v1/simple_kv_offload")

