"""Layer-wise loads (``layerwise_load``) of NPUOffloadingConnector under the installed vLLM's real
Scheduler and OffloadingConnectorScheduler (CPU tensors, no model; the harness calls every
attention layer's ``wait_for_layer_load`` between ``start_load_kv`` and ``get_finished``, as the
forward does): a qualifying host hit is scheduled in the step that loads it, one transfer per layer
group, never reported in ``finished_recving``, restores every byte, and its host blocks are pinned
through that step and released after it; a short hit keeps the asynchronous path; a failed layer
group's blocks come back as invalid blocks and vLLM recomputes (or fails) the request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from layerwise_faults import fail_layer_group  # noqa: E402
from harness import (  # noqa: E402
    BLOCK,
    HEAD,
    HEADS,
    NB,
    PAGE,
    PROMPT,
    Engine,
    block_bytes,
    host_block,
    kv_cache_config,
    parts_of,
    stacked_caches,
    vllm_config,
)
from vllm.v1.request import RequestStatus  # noqa: E402

from vllm_npu_offload.copy.base import Direction  # noqa: E402
from vllm_npu_offload.errors import OffloadConfigError  # noqa: E402
from vllm_npu_offload.integration import compat  # noqa: E402
from vllm_npu_offload.integration.connector import NPUOffloadingConnector  # noqa: E402

pytestmark = pytest.mark.skipif(compat.layerwise_unsupported() is not None,
                                reason="layer-wise loads run on vLLM 0.23 and 0.32 (compat.LAYERWISE_RELEASES)")

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
GROUPS = 2
MODULE = "vllm_npu_offload.integration.connector"


@dataclass
class Spy:
    """Per step: the scheduler output, the loads pending right after scheduling (and the manager's
    reference counts of their host blocks then), what the worker reported as finished loads and as
    invalid blocks."""

    outputs: list = field(default_factory=list)
    pending: list = field(default_factory=list)
    pins: list = field(default_factory=list)
    recving: list = field(default_factory=list)
    invalid: list = field(default_factory=list)


def build(tiny_model, min_tokens: int = 32, policy: str | None = None, mode=True, min_new_tokens: int | None = None):
    extra = {"cpu_bytes_to_use": 64 * PAGE * len(LAYERS), "layerwise_load": mode,
             "layerwise_min_tokens": min_tokens, "layerwise_groups": GROUPS}
    if min_new_tokens is not None:
        extra["layerwise_min_new_tokens"] = min_new_tokens
    vc = vllm_config(tiny_model, extra, "NPUOffloadingConnector", MODULE)
    if policy is not None:
        vc.kv_transfer_config.kv_load_failure_policy = policy
    caches = stacked_caches(LAYERS)
    eng = Engine.build(vc, kv_cache_config(NB, LAYERS, HEADS, HEAD, PAGE), caches, NPUOffloadingConnector)
    return eng, caches


def spy(eng: Engine) -> Spy:
    s = Spy()
    lw = eng.sched.connector._lw_sched
    schedule, w = eng.sched.schedule, eng.worker
    get_finished, errors = w.get_finished, w.get_block_ids_with_load_errors

    def scheduled():
        out = schedule()
        s.outputs.append(out)
        s.pending.append(dict(lw.pending))
        s.pins.append({j: ref_counts(eng, load.keys) for j, load in lw.pending.items()})
        return out

    def finished(ids):
        out = get_finished(ids)
        s.recving.append(set(out[1] or ()))
        return out

    def load_errors():
        out = errors()
        s.invalid.append(set(out))
        return out

    eng.sched.schedule, w.get_finished, w.get_block_ids_with_load_errors = scheduled, finished, load_errors
    return s


def store_then_wipe(eng: Engine, caches: dict, prompt: list[int]) -> dict:
    """Run ``prompt`` (stores), then zero the device KV and reset the prefix cache: the next run of
    ``prompt`` can only get its KV from host. Returns host block -> the bytes it must hold."""
    parts = parts_of(caches)
    eng.run(prompt)
    stored = {}
    for job in eng.jobs:
        assert job.direction is Direction.D2H
        for i, dev in enumerate(job.device_blocks):
            stored[host_block(job.chunks, i, 1)] = block_bytes(parts, dev)
    assert len(stored) == len(prompt) // BLOCK
    for p in parts:
        p.zero_()
    eng.reset_device_prefix_cache()
    eng.jobs.clear()
    return stored


def ref_counts(eng: Engine, keys) -> list[int]:
    return [eng.manager._policy.get(k).ref_cnt for k in keys]


def test_qualifying_hit_loads_in_the_step_that_computes_it(tiny_model):
    eng, caches = build(tiny_model)
    parts = parts_of(caches)
    stored = store_then_wipe(eng, caches, PROMPT)
    s = spy(eng)
    moved_before = eng.moved["load"]
    req = eng.add(PROMPT)
    eng.step()
    first = s.outputs[0]
    hit = len(PROMPT) // BLOCK * BLOCK  # 96 of 100 tokens: 4 left to compute
    assert first.num_scheduled_tokens == {req.request_id: len(PROMPT) - hit}  # scheduled in the load's step
    (job_id,) = first.kv_connector_metadata.layerwise_jobs
    assert set(first.kv_connector_metadata.load_jobs) == {job_id}
    pinned = s.pending[0][job_id]
    assert len(pinned.keys) == hit // BLOCK and all(c > 0 for c in s.pins[0][job_id])  # pinned while it loads
    # one transfer per layer group (our own negative job ids), each over every hit block
    loads = [j for j in eng.jobs if j.direction is Direction.H2D]
    assert len(loads) == GROUPS and all(j.job_id < 0 for j in loads)
    assert all(len(j.device_blocks) == hit // BLOCK for j in loads)
    for i, dev in enumerate(loads[0].device_blocks):
        want = stored[host_block(loads[0].chunks, i, 1)]
        assert all(torch.equal(a, b) for a, b in zip(block_bytes(parts, dev), want)), f"device block {dev}"
    # after the step: running with the hit counted and a token sampled; host blocks released
    assert req.status == RequestStatus.RUNNING
    assert req.num_computed_tokens == len(PROMPT) and req.num_output_tokens == 1
    assert not eng.sched.connector._lw_sched.pending
    assert ref_counts(eng, pinned.keys) == [0] * len(pinned.keys)
    eng.settle()
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert all(req.request_id not in r for r in s.recving)  # never through finished_recving
    assert not any(s.invalid)
    # vLLM's own load stats count the layer-wise bytes (every layer's page of every hit block)
    assert eng.moved["load"] - moved_before == hit // BLOCK * sum(p[0].nbytes for p in parts)


def test_whole_block_aligned_prompt_recomputes_its_last_block(tiny_model):
    """A hit of the whole prompt leaves nothing to compute: the last block is computed instead."""
    prompt = PROMPT[:96]
    eng, caches = build(tiny_model)
    store_then_wipe(eng, caches, prompt)
    s = spy(eng)
    req = eng.add(prompt)
    eng.step()
    assert s.outputs[0].num_scheduled_tokens == {req.request_id: BLOCK}
    assert len(s.outputs[0].kv_connector_metadata.layerwise_jobs) == 1
    assert all(len(j.device_blocks) == 96 // BLOCK - 1 for j in eng.jobs if j.direction is Direction.H2D)
    assert req.num_output_tokens == 1


def test_short_hit_keeps_the_asynchronous_path(tiny_model):
    eng, caches = build(tiny_model, min_tokens=len(PROMPT))
    store_then_wipe(eng, caches, PROMPT)
    s = spy(eng)
    req = eng.add(PROMPT)
    eng.step()
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert not s.outputs[0].kv_connector_metadata.layerwise_jobs and s.outputs[0].kv_connector_metadata.load_jobs
    eng.settle()
    assert any(req.request_id in r for r in s.recving)
    assert all(j.job_id >= 0 for j in eng.jobs)  # upstream's job, through vLLM's own worker path


def test_auto_loads_layer_by_layer_only_while_no_other_request_runs(tiny_model):
    """``"auto"`` under the real scheduler: the hit arriving while another request decodes keeps the
    asynchronous path; once that request has finished (vLLM's finish hook reached the connector),
    the same hit, alone, loads in the step that computes it."""
    eng, caches = build(tiny_model, mode="auto", min_new_tokens=2)  # PROMPT leaves 4 tokens to compute
    lw = eng.sched.connector._lw_sched
    assert lw.opts.auto and lw.opts.min_tokens == 32  # a set threshold is kept
    store_then_wipe(eng, caches, PROMPT)
    s = spy(eng)
    busy = eng.add([t + 1 for t in PROMPT], max_tokens=20)
    eng.step()
    eng.step()
    assert busy.status == RequestStatus.RUNNING
    req = eng.add(PROMPT)
    eng.step()
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS and lw.auto_declined == 1
    assert not s.outputs[-1].kv_connector_metadata.layerwise_jobs and s.outputs[-1].kv_connector_metadata.load_jobs
    eng.settle()
    assert busy.status == req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    for p in parts_of(caches):
        p.zero_()
    eng.reset_device_prefix_cache()
    again = eng.add(PROMPT)
    eng.step()
    assert len(s.outputs[-1].kv_connector_metadata.layerwise_jobs) == 1 and lw.auto_declined == 1
    assert again.status == RequestStatus.RUNNING and again.num_output_tokens == 1
    eng.settle()


def test_auto_leaves_a_bare_reload_asynchronous(tiny_model):
    """``"auto"``'s default ``layerwise_min_new_tokens`` (512): a hit with only 4 tokens left to
    compute, alone, keeps the asynchronous path (a bare reload has no forward to hide copies under)."""
    eng, caches = build(tiny_model, mode="auto")
    lw = eng.sched.connector._lw_sched
    assert lw.opts.min_new_tokens == 512
    store_then_wipe(eng, caches, PROMPT)
    s = spy(eng)
    req = eng.add(PROMPT)
    eng.step()
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS and lw.auto_declined == 0
    assert not s.outputs[-1].kv_connector_metadata.layerwise_jobs and s.outputs[-1].kv_connector_metadata.load_jobs
    eng.settle()
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_failed_layer_group_becomes_invalid_blocks(tiny_model, policy):
    eng, caches = build(tiny_model, policy=policy)
    store_then_wipe(eng, caches, PROMPT)
    fail_layer_group(eng.core, 1)
    s = spy(eng)
    req = eng.add(PROMPT)
    eng.step()
    (job_id,) = s.outputs[0].kv_connector_metadata.layerwise_jobs
    loaded = {b for j in eng.jobs if j.direction is Direction.H2D for b in j.device_blocks}
    assert s.invalid[0] == loaded and len(loaded) == len(PROMPT) // BLOCK
    assert req.num_output_tokens == 0  # the step's token, computed on that KV, was dropped
    keys = s.pending[0][job_id].keys
    assert not eng.sched.connector._lw_sched.pending and ref_counts(eng, keys) == [0] * len(keys)
    if policy == "fail":
        assert req.status == RequestStatus.FINISHED_ERROR
        return
    assert req.num_computed_tokens == 0 and req.status == RequestStatus.RUNNING
    eng.step()
    assert s.outputs[1].num_scheduled_tokens == {req.request_id: len(PROMPT)}  # recomputed from scratch
    eng.settle()
    assert req.num_output_tokens == 2 and all(req.request_id not in r for r in s.recving)


def test_two_kv_groups_are_refused(tiny_model):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec, SlidingWindowSpec

    for mode in (True, "auto"):  # the error names the value set
        vc = vllm_config(tiny_model, {"cpu_bytes_to_use": 64 * PAGE * 4, "layerwise_load": mode},
                         "NPUOffloadingConnector", MODULE)
        kcc = kv_cache_config(NB, LAYERS, HEADS, HEAD, PAGE)
        full = kcc.kv_cache_groups[0].kv_cache_spec
        window = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32,
                                   sliding_window=4096)
        kcc.kv_cache_groups = [KVCacheGroupSpec(LAYERS[0::2], full), KVCacheGroupSpec(LAYERS[1::2], window)]
        with pytest.raises(OffloadConfigError, match=rf"\['layerwise_load'\]={mode!r} needs a model with one "
                                                     r"KV-cache group; this one has 2 \(FullAttentionSpec, "
                                                     r"SlidingWindowSpec\)"):
            NPUOffloadingConnector(vc, KVConnectorRole.WORKER, kcc)


def test_layerwise_keys_in_vllms_own_connector_are_refused(tiny_model):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

    vc = vllm_config(tiny_model, {"cpu_bytes_to_use": 64 * PAGE * 4, "layerwise_load": True})
    with pytest.raises(OffloadConfigError, match=r"\['layerwise_load'\]=True is read only by NPUOffloadingConnector"):
        OffloadingConnector(vc, KVConnectorRole.SCHEDULER, kv_cache_config(NB, LAYERS, HEADS, HEAD, PAGE))
