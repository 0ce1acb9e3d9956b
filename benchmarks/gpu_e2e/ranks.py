"""What each tensor-parallel rank's worker reports, run where that worker lives.

With ``tensor_parallel_size`` 1 our worker core lives in the engine's process; with N > 1 vLLM runs
one worker process per GPU, and the engine reaches them only through ``LLM.collective_rpc``, which
calls a function with the worker as its first argument. Every function here takes that argument
(None in-process) and reads this process's worker cores (``live_workers``), so one code path serves
both: ``on_ranks`` picks how to call it.
"""

from __future__ import annotations

import os
from typing import Any, Callable


def on_ranks(llm, tp: int, fn: Callable, **kw) -> list:
    """``fn(worker, **kw)`` on every rank: in this process for one rank, else through vLLM's RPC."""
    if tp <= 1:
        return [fn(None, **kw)]
    return llm.collective_rpc(fn, kwargs=kw)


def rank_of(worker) -> int:
    return int(getattr(worker, "rank", 0)) if worker is not None else 0


def totals(worker=None) -> dict:
    """This rank's transfer totals (load, store) as plain dicts."""
    from vllm_npu_offload.stats import TOTALS

    load, store = TOTALS.snapshot()
    return {"load": vars(load), "store": vars(store)}


TIMES = ("seconds", "wall_seconds")


def sum_totals(per_rank: list[dict]) -> dict:
    """Totals over ranks: bytes, jobs and failures add up; times are the ranks' mean (each rank
    copies its share on its own link at the same time, so a sum would count that time N times)."""
    out: dict[str, dict[str, Any]] = {}
    for d in per_rank[0]:
        acc = sum_counters(r[d] for r in per_rank) or {}
        out[d] = {k: v / len(per_rank) if k in TIMES else v for k, v in acc.items()}
    return out


def runner_info(worker) -> dict:
    """Whether vLLM allocated cross-layer blocks, its KV block count and KV-cache groups, from this
    worker's model runner (empty where the worker has none)."""
    runner = getattr(worker, "model_runner", None)
    if runner is None:
        return {}
    out: dict[str, Any] = {"cross_layer_blocks": getattr(runner, "cross_layers_kv_cache", None) is not None}
    kcc = getattr(runner, "kv_cache_config", None)
    if kcc is not None:
        out["num_blocks"] = int(getattr(kcc, "num_blocks", 0))
        out["kv_cache_groups"] = [{"layers": len(g.layer_names), "spec": type(g.kv_cache_spec).__name__,
                                   "block_size": getattr(g.kv_cache_spec, "block_size", None),
                                   "page_bytes": getattr(g.kv_cache_spec, "page_size_bytes", None),
                                   "sliding_window": getattr(g.kv_cache_spec, "sliding_window", None)}
                                  for g in getattr(kcc, "kv_cache_groups", [])]
    return out


def layerwise_stats() -> dict | None:
    """This process's worker connector's layer-wise counters (None: not NPUOffloadingConnector, or the
    mode off)."""
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
    except ImportError:
        return None
    if not has_kv_transfer_group():
        return None
    stats = getattr(get_kv_transfer_group(), "layerwise_stats", None)
    return stats() if stats is not None else None


def sum_counters(per_rank) -> dict | None:
    """Counters (dicts of numbers) added up over ranks; None when no rank has any."""
    have = [c for c in per_rank if c]
    if not have:
        return None
    return {k: sum(c.get(k, 0) for c in have) for k in have[0]}


def worker_info(worker=None) -> dict:
    """How this rank's worker core moves KV: copy paths, staging, the calibrated choice, its host
    bytes, and where the host KV sits against the GPU (what the start-up log and ``info`` say, and
    the NUMA node of sampled host pages as the kernel reports them)."""
    from vllm_npu_offload.info import PROVIDERS
    from vllm_npu_offload.numa import page_nodes
    from vllm_npu_offload.offload_worker import live_workers

    numa_line = dict(PROVIDERS)["numa"]()
    out = []
    for core in live_workers():
        st = core.stager
        out.append({
            "rank": rank_of(worker), "pid": os.getpid(),
            "direct": {"load": core.backend.choice.load, "store": core.backend.choice.store},
            "staged_from_blocks": {d.name: core.staged_from(d) for d in core.staged_min_blocks},
            "staging": None if st is None else {"slots": st.geometry.slots, "slot_blocks": st.geometry.slot_blocks,
                                                 "local": st.local_path.name, "link": st.link_path.name},
            "record_bytes": core.layout.record_bytes, "host_bytes": core.host.nbytes,
            "device_tensors": len(core.device_tensors),
            "page_bytes": sorted({t.page_bytes for t in core.device_tensors}),
            "groups": [len(refs) for refs in core.group_refs],
            "pinned": core.host.pinned, "numa": core.host.numa.describe(), "numa_info": numa_line,
            "host_page_nodes": page_nodes(core.host.base, core.host.nbytes),
        })
    return {"cores": out, "layerwise": layerwise_stats()}


def corrupt_page(worker=None, seed: int = 0) -> dict:
    """Overwrite with random bytes every stored host page (non-zero block) of the first tensor's
    region of this rank's worker: a negative control that must change the tokens. Every page, not
    the first one only: with a sliding-window group the first stored block can lie outside the
    window and is then never loaded (the multigroup layout's first run showed it)."""
    import torch

    from vllm_npu_offload.offload_worker import live_workers

    cores = live_workers()
    if len(cores) != 1:
        return {"ok": False, "rank": rank_of(worker), "why": f"{len(cores)} live worker cores"}
    view = cores[0].host_view(0)
    stored = [b for b in range(view.shape[0]) if bool(view[b].any())]
    if not stored:
        return {"ok": False, "rank": rank_of(worker), "why": "host region 0 is all zeros"}
    g = torch.Generator().manual_seed(seed + rank_of(worker))
    for b in stored:
        view[b].copy_(torch.randint(0, 256, view[b].shape, dtype=torch.uint8, generator=g))
    return {"ok": True, "rank": rank_of(worker), "region": 0, "blocks": len(stored),
            "bytes": len(stored) * int(view.shape[1])}


def _tensors(x) -> list:
    """The tensors in a model runner's ``kv_caches`` (a list of tensors, or of tuples/lists of them)."""
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    return [x] if hasattr(x, "untyped_storage") else []


def scrub_device_kv(worker, seed: int = 0) -> dict:
    """Random values over every KV-cache tensor of this worker's model runner (each storage once:
    per-layer views of one cross-layer buffer share it). What the device held before a reset then
    cannot pass for a reload: a connector that reports a hit and does not load it gives other
    tokens (the check LMCache's whole-prompt hits need, whose retrieve vLLM 0.23 never ran)."""
    import torch

    runner = getattr(worker, "model_runner", None)
    tensors = _tensors(getattr(runner, "kv_caches", None) or [])
    if not tensors:
        return {"ok": False, "rank": rank_of(worker), "why": "no KV-cache tensors in this worker's model runner"}
    g = torch.Generator(device=tensors[0].device).manual_seed(seed + rank_of(worker))
    seen, nbytes = set(), 0
    for t in tensors:
        st = t.untyped_storage()
        if st.data_ptr() in seen:
            continue
        seen.add(st.data_ptr())
        # the whole storage in the tensor's dtype: normal values for float caches (no NaN that a padded
        # CUDA-graph row could read), random bytes for byte-typed (fp8) ones
        whole = torch.empty(0, dtype=t.dtype, device=t.device).set_(st, 0, (st.nbytes() // t.element_size(),))
        if whole.is_floating_point():
            whole.normal_(generator=g)
        else:
            whole.random_(0, 256, generator=g)
        nbytes += st.nbytes()
    if tensors[0].is_cuda:
        torch.cuda.synchronize(tensors[0].device)
    return {"ok": True, "rank": rank_of(worker), "tensors": len(seen), "bytes": nbytes}


__all__ = ["corrupt_page", "on_ranks", "scrub_device_kv", "sum_totals", "totals", "worker_info"]
