"""Host sizing at real model shapes, for both connectors, on the installed vLLM (0.21-0.33).

Each case builds vLLM's own ``KVCacheConfig`` (``get_kv_cache_configs`` over per-layer KV specs of
a real model shape, per tensor-parallel rank) and device KV tensors placed the way that vLLM's
model runner places them (0.21-0.28: one tensor per ``KVCacheTensor``, shared by one layer of each
group; >= 0.29: one allocation that every layer views). The device KV is a reservation of virtual
memory that nothing touches, and no host KV is allocated: the sizes come from the same functions
the connectors call right before they allocate (``kv_segments`` + ``host_size`` for the Simple
connector, ``NPUOffloadingSpec.geometry`` + ``HostLayout`` for the spec).

The bug this guards (issue 20): the Simple connector sized host blocks by one layer's bytes, which
the 2-8-layer test models never showed: 16 GiB at 32 layers became 512 GiB.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GiB = 1 << 30
BLOCK = 16  # engine block (tokens)
DEVICE_KV = 4 * GiB  # per rank
CPU_TOTAL = 16 * GiB  # cpu_bytes_to_use: total over the ranks
OFFLOADED_BLOCK = 64  # the spec's block_size (tokens): 4 engine blocks per host chunk


@dataclass(frozen=True)
class Model:
    name: str
    layers: int
    kv_heads: int  # before tensor parallelism
    head_size: int
    dtype: torch.dtype = torch.bfloat16
    mla: bool = False  # one latent "head", replicated on every rank
    window: int | None = None  # sliding window on every other layer (Gemma-2), full attention on the rest


MODELS = {
    m.name: m
    for m in (
        Model("llama3-8b", 32, 8, 128),
        Model("llama3-8b-fp8", 32, 8, 128, dtype=torch.float8_e4m3fn),
        Model("llama3-70b", 80, 8, 128),
        Model("deepseek-v3-mla", 61, 1, 576, mla=True),
        Model("deepseek-v3-mla-fp8", 61, 1, 576, dtype=torch.float8_e4m3fn, mla=True),
        Model("gemma2-9b", 42, 8, 256, window=4096),
    )
}
CASES = [  # (model, tensor-parallel size)
    ("llama3-8b", 1), ("llama3-8b", 2), ("llama3-8b", 4), ("llama3-8b", 8), ("llama3-8b-fp8", 1), ("llama3-70b", 8),
    ("deepseek-v3-mla", 1), ("deepseek-v3-mla", 2), ("deepseek-v3-mla-fp8", 1), ("gemma2-9b", 1), ("gemma2-9b", 2),
]
CASE_IDS = [f"{m}-tp{tp}" for m, tp in CASES]


def layer_name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def layer_specs(model: Model, tp: int) -> dict:
    """layer name -> vLLM KV spec on one rank."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

    heads = 1 if model.mla else max(1, model.kv_heads // tp)
    out = {}
    for i in range(model.layers):
        if model.mla:
            spec = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=model.head_size, dtype=model.dtype)
        elif model.window and i % 2 == 0:
            spec = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=heads, head_size=model.head_size,
                                     dtype=model.dtype, sliding_window=model.window)
        else:
            spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=heads, head_size=model.head_size, dtype=model.dtype)
        out[layer_name(i)] = spec
    return out


def real_kv_cache_config(vllm_config, model: Model, tp: int):
    """The KVCacheConfig vLLM gives each rank for ``DEVICE_KV`` bytes of device KV."""
    from vllm.config import set_current_vllm_config

    specs = [layer_specs(model, tp)]
    with set_current_vllm_config(vllm_config):
        try:
            from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
        except ImportError:  # 0.33: the engine core groups the layers first, then builds the configs
            from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs

            return get_kv_cache_configs(vllm_config, specs, [DEVICE_KV],
                                        get_global_kv_cache_groups(vllm_config, specs))[0]
        return get_kv_cache_configs(vllm_config, specs, [DEVICE_KV])[0]


class Reservation:
    """Untouched device-KV stand-in: virtual memory only (the kernel maps no page until written)."""

    def __init__(self, nbytes: int):
        self.buf = torch.empty(nbytes, dtype=torch.int8)

    def tensor(self, offset: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(0, dtype=dtype)
        el = torch.empty(0, dtype=dtype).element_size()
        assert offset % el == 0
        return t.set_(self.buf.untyped_storage(), offset // el, shape, torch.empty(shape, device="meta").stride())


def device_caches(kv_cache_config, model: Model, tp: int) -> dict:
    """layer name -> device KV tensor, placed as vLLM's model runner places it."""
    tensors = kv_cache_config.kv_cache_tensors
    nb = kv_cache_config.num_blocks
    specs = layer_specs(model, tp)
    if hasattr(tensors[0], "layer_stride"):  # >= 0.29: every layer views one allocation
        res = Reservation(tensors[0].size)
        return {name: res.buf for t in tensors for name in t.layers}
    res = Reservation(sum(t.size for t in tensors))  # 0.21-0.28: one tensor per KVCacheTensor (shared_by)
    out, offset = {}, 0
    for t in tensors:
        for name in t.shared_by:
            spec = specs[name]
            if model.mla:  # (num_blocks, block, 576)
                shape = (nb, BLOCK, spec.head_size)
            else:  # TRITON_ATTN / FLASH_ATTN: K and V outermost
                shape = (2, nb, BLOCK, spec.num_kv_heads, spec.head_size)
            out[name] = res.tensor(offset, shape, spec.dtype)
            assert out[name].numel() * out[name].element_size() == t.size, (name, shape, t.size)
        offset += t.size
    out["_reservation"] = res  # keeps the buffer alive; not a layer
    return out


def layers_only(caches: dict) -> dict:
    return {k: v for k, v in caches.items() if not k.startswith("_")}


@dataclass(frozen=True)
class Sizing:
    """What one rank would allocate, and what vLLM's scheduler side counts."""

    host_bytes: int
    host_blocks: int  # host blocks (Simple) or engine blocks in host chunks (spec)
    scheduler_blocks: int
    capacity: int  # this rank's share of cpu_bytes_to_use
    page_bytes: tuple[int, ...]


def device_pages(kv_cache_config, caches: dict) -> tuple[int, ...]:
    """Page bytes of every distinct device KV region (what both connectors copy per block)."""
    from vllm_npu_offload.integration.simple_worker import kv_segments

    return tuple(s.page_bytes for s in kv_segments(layers_only(caches), kv_cache_config))


def simple_sizing(kv_cache_config, caches: dict, tp: int) -> Sizing:
    """The Simple connector's host KV, from the functions its worker runs in register_kv_caches."""
    from vllm_npu_offload.integration import compat
    from vllm_npu_offload.integration.simple_worker import host_size

    cap = CPU_TOTAL // tp  # vLLM's SimpleCPUOffloadConnector: cpu_bytes_to_use // world_size
    pages = device_pages(kv_cache_config, caches)
    size = host_size(kv_cache_config, cap, pages)
    sched = compat.simple_scheduler_cpu_blocks(kv_cache_config, cap)
    return Sizing(size.nbytes, size.blocks, sched, cap, pages)


def spec_sizing(spec, pages: tuple[int, ...], tp: int) -> Sizing:
    """NPUOffloadingSpec's host KV: its geometry (what vLLM's scheduler-side manager gets) and the
    host layout its worker core builds over the device pages."""
    from vllm_npu_offload.host_layout import HostLayout

    bpc, chunks = spec.geometry
    layout = HostLayout.build(pages, bpc, chunks)
    return Sizing(layout.nbytes, layout.num_blocks, chunks * bpc, CPU_TOTAL // tp, pages)


def make_spec(vc, kv_cache_config):
    """NPUOffloadingSpec built as the installed vLLM builds it (config API or the legacy pair)."""
    from vllm_npu_offload.integration import compat
    from vllm_npu_offload.integration.spec import NPUOffloadingSpec

    if compat.API == "config":
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import build_offloading_config

        vc.kv_transfer_config.engine_id = vc.kv_transfer_config.engine_id or "sizing"
        return NPUOffloadingSpec(build_offloading_config(vc, kv_cache_config))
    return NPUOffloadingSpec(vc, kv_cache_config)


def assert_fits_share(s: Sizing, slack: int) -> None:
    """Host blocks cover the scheduler's; bytes within 1% of the share, never above it + ``slack``."""
    assert s.host_blocks >= s.scheduler_blocks, s
    assert s.host_bytes <= s.capacity + slack, (s.host_bytes / s.capacity, s)
    assert s.host_bytes >= 0.99 * s.capacity, (s.host_bytes / s.capacity, s)


def expected_block_bytes(model: Model, tp: int) -> int:
    """KV bytes of one engine block on one rank, from the model shape alone (the layers count)."""
    el = torch.empty(0, dtype=model.dtype).element_size()
    if model.mla:
        return model.layers * BLOCK * model.head_size * el
    return model.layers * 2 * BLOCK * max(1, model.kv_heads // tp) * model.head_size * el


SPEC = ("OffloadingConnector", None, {"spec_name": "NPUOffloadingSpec",
                                      "spec_module_path": "vllm_npu_offload.integration.spec",
                                      "block_size": OFFLOADED_BLOCK})
SIMPLE = ("NPUSimpleCPUOffloadConnector", "vllm_npu_offload.integration.simple_connector", {})


# vLLM >= 0.29 names the placement (CacheConfig.kv_cache_layout): layer-outer pages per layer, or
# block-outer (every layer of a block in one run: cross-layer). 0.23 has one per-layer placement;
# its OffloadingConnector may register cross-layer blocks instead (register_cross_layers_kv_cache).
LAYOUTS = {"per-layer": "LBNHC", "cross-layer": "BLNHC"}


def vllm_config(model_dir: str, tp: int, connector: tuple, size: dict | None = None, layout: str = "per-layer"):
    """A VllmConfig with ``tp`` tensor-parallel ranks and one of our connectors (no model run)."""
    from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, ParallelConfig,
                             SchedulerConfig, VllmConfig)

    name, module, extra = connector
    vc = VllmConfig(
        model_config=ModelConfig(model=model_dir, dtype="bfloat16", seed=0),
        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=2048, max_model_len=2048,
                                         is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        parallel_config=ParallelConfig(tensor_parallel_size=tp),
        kv_transfer_config=KVTransferConfig(kv_connector=name, kv_connector_module_path=module, kv_role="kv_both",
                                            kv_connector_extra_config={**extra,
                                                                       **(size or {"cpu_bytes_to_use": CPU_TOTAL})}),
        device_config=DeviceConfig("cpu"),
    )
    if hasattr(vc.cache_config, "get_resolved_kv_cache_layout"):  # the engine core resolves it (0.32)
        vc.cache_config.kv_cache_layout = LAYOUTS[layout]
    return vc


def tp8_model_dir(tiny_model: str, out) -> str:
    """The tiny Llama's tokenizer and config with 64 attention / 8 KV heads, so that vLLM accepts
    tensor_parallel_size up to 8 (only the config is read: the KV specs above give the shapes)."""
    import json
    import shutil
    from pathlib import Path

    out = Path(out)
    if not (out / "config.json").exists():
        shutil.copytree(tiny_model, out, dirs_exist_ok=True)
        cfg = json.loads((out / "config.json").read_text())
        cfg.update(num_attention_heads=64, num_key_value_heads=8)
        (out / "config.json").write_text(json.dumps(cfg))
    return str(out)


# -- the checks both test modules run ------------------------------------------------------


def build(model_dir: str, name: str, tp: int, connector: tuple, layout: str, size: dict | None = None):
    """(model, vllm_config, vLLM's KVCacheConfig for one rank, device caches)."""
    model = MODELS[name]
    vc = vllm_config(model_dir, tp, connector, size, layout)
    cfg = real_kv_cache_config(vc, model, tp)
    return model, vc, cfg, device_caches(cfg, model, tp)


def check_simple(model_dir: str, name: str, tp: int, layout: str) -> Sizing:
    model, _, cfg, caches = build(model_dir, name, tp, SIMPLE, layout)
    s = simple_sizing(cfg, caches, tp)
    assert_fits_share(s, slack=0)
    if not model.window:  # hybrid groups share one region per layer pair: fewer bytes than layers x page
        assert sum(s.page_bytes) == expected_block_bytes(model, tp)
    return s


def check_spec(model_dir: str, name: str, tp: int, layout: str) -> Sizing:
    """Host bytes and chunks of NPUOffloadingSpec; then the legacy num_cpu_blocks key and the
    staging area, the other two places that turn bytes into blocks."""
    from vllm_npu_offload.host_layout import HostLayout
    from vllm_npu_offload.integration import compat
    from vllm_npu_offload.staging import DEFAULT_STAGING_BYTES, StagingGeometry

    model, vc, cfg, caches = build(model_dir, name, tp, SPEC, layout)
    pages = device_pages(cfg, caches)
    if layout == "cross-layer" and compat.API != "config":
        pages = (sum(pages),)  # 0.23's register_cross_layers_kv_cache: one page of every layer per block
    if not model.window:
        assert sum(pages) == expected_block_bytes(model, tp)
    spec = make_spec(vc, cfg)
    s = spec_sizing(spec, pages, tp)
    assert_fits_share(s, slack=64 * s.host_blocks)
    bpc = spec.geometry[0]
    assert bpc == OFFLOADED_BLOCK // BLOCK

    legacy = make_spec(vllm_config(model_dir, tp, SPEC, {"num_cpu_blocks": 1000}, layout), cfg)
    assert legacy.geometry == (bpc, 1000)  # exactly that many offloaded blocks on every rank

    layout_ = HostLayout.build(pages, bpc, spec.geometry[1])
    geo = StagingGeometry.for_area(DEFAULT_STAGING_BYTES // 2, layout_)
    assert geo.record_bytes == layout_.record_bytes  # a staging record is a whole host block
    assert geo.slot_blocks >= bpc and geo.area_bytes <= DEFAULT_STAGING_BYTES // 2
    return s
