"""Tensor parallelism on vLLM 0.23's real scheduler, two ranks simulated on the CPU: each rank is
a worker-role NPUSimpleCPUOffloadConnector over its own shard of the KV (its heads), and the
workers' outputs are combined by vLLM's own KVOutputAggregator, as the engine does.

What the ranks must agree on (issue 24): a store becomes loadable only once every rank has
stored it; a load finishes only once every rank has loaded; a store one rank failed is never
loadable (no rank serves half a block) and its host blocks are released; each rank's host
bytes are its own shard, byte for byte.
"""

from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm")
if not vllm.__version__.startswith("0.23"):
    pytest.skip(f"needs vLLM 0.23 (installed: {vllm.__version__})", allow_module_level=True)

import torch  # noqa: E402
from harness import BLOCK, block_bytes, kv_cache_config, parts_of, stacked_caches, vllm_config  # noqa: E402
from simple_fakes import failing_copies  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import ParallelConfig, set_current_vllm_config  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, resolve_kv_cache_block_sizes  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from vllm_npu_offload.copy.base import Direction  # noqa: E402
from vllm_npu_offload.integration.simple_connector import NPUSimpleCPUOffloadConnector  # noqa: E402

TP = 2
NB = 24
HEADS, HEAD = 2, 32  # KV heads per rank
PAGE = 2 * BLOCK * HEADS * HEAD * 4
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
PROMPT = list(range(1, 101))  # 6 full blocks
MODULE = "vllm_npu_offload.integration.simple_connector"


class Ranks:
    """The scheduler plus one worker connector per rank; ``hold`` delays a rank's reports."""

    def __init__(self, model: str):
        vc = vllm_config(model, {"cpu_bytes_to_use": TP * 32 * PAGE * len(LAYERS)}, "NPUSimpleCPUOffloadConnector",
                         MODULE, spec=False)
        vc.parallel_config = ParallelConfig(tensor_parallel_size=TP)
        kcc = kv_cache_config(NB, LAYERS, HEADS, HEAD, PAGE)
        block_size, hash_block_size = resolve_kv_cache_block_sizes(kcc, vc)
        vc.cache_config.num_gpu_blocks = NB
        self.sched = Scheduler(vllm_config=vc, kv_cache_config=kcc, log_stats=True,
                               structured_output_manager=StructuredOutputManager(vc), block_size=block_size,
                               hash_block_size=hash_block_size)
        self.caches = [stacked_caches(seed=rank + 1) for rank in range(TP)]  # each rank: its own heads
        self.workers = []
        for caches in self.caches:
            w = NPUSimpleCPUOffloadConnector(vc, KVConnectorRole.WORKER, kcc)
            with set_current_vllm_config(vc):
                w.register_kv_caches(caches)
            self.workers.append(w)
        self.aggregator = KVOutputAggregator(TP)
        self.host_hits: dict[str, int] = {}  # request -> tokens the scheduler found on host
        conn, matched = self.sched.connector, self.sched.connector.get_num_new_matched_tokens

        def spy(request, num_computed_tokens):
            n, is_async = matched(request, num_computed_tokens)
            self.host_hits[request.request_id] = max(self.host_hits.get(request.request_id, 0), n or 0)
            return n, is_async

        conn.get_num_new_matched_tokens = spy
        self.hold: set[int] = set()  # ranks whose worker outputs are not reported yet
        self._held: dict[int, list] = {}
        self._n = 0

    @property
    def manager(self):
        return self.sched.connector.scheduler_manager

    def step(self) -> None:
        so = self.sched.schedule()
        meta = so.kv_connector_metadata
        ids = [r.request_id for r in self.sched.running]
        outs = []
        for rank, w in enumerate(self.workers):
            w.handle_preemptions(meta)
            w.bind_connector_metadata(meta)
            w.start_load_kv(None)
            w.wait_for_save()
            sending, recving = w.get_finished(so.finished_req_ids)
            kv = KVConnectorOutput(finished_sending=sending, finished_recving=recving,
                                   kv_connector_worker_meta=w.build_connector_worker_meta(),
                                   invalid_block_ids=w.get_block_ids_with_load_errors())
            w.clear_connector_metadata()
            if rank in self.hold:  # this rank's results arrive later, all at once
                self._held.setdefault(rank, []).append(kv)
                kv = KVConnectorOutput()
            outs.append(ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                          sampled_token_ids=[[7] for _ in ids], logprobs=None,
                                          prompt_logprobs_dict={}, pooler_output=None, kv_connector_output=kv))
        for rank in [r for r in self._held if r not in self.hold]:
            late = self._held.pop(rank)
            outs[rank].kv_connector_output = _merge(late + [outs[rank].kv_connector_output])
        self.sched.update_from_output(so, self.aggregator.aggregate(outs))

    def pending(self) -> bool:
        m = self.manager
        return bool(self.sched.requests or m._store_event_to_blocks or m._reqs_to_load or self._held
                    or self.sched.connector._store_releaser.events)

    def run(self, prompt: list[int], max_steps: int = 60) -> Request:
        self._n += 1
        req = Request(f"req-{self._n}", prompt, SamplingParams(max_tokens=2, ignore_eos=True), None,
                      block_hasher=get_request_block_hasher(BLOCK, sha256))
        self.sched.add_request(req)
        for _ in range(max_steps):
            if not self.pending():
                return req
            self.step()
        raise AssertionError(f"request did not finish in {max_steps} steps (held ranks: {sorted(self.hold)})")


def _merge(outputs: list[KVConnectorOutput]) -> KVConnectorOutput:
    """One rank's outputs of several steps as one (a rank that reports late)."""
    sending, recving, invalid, meta = set(), set(), set(), None
    for o in outputs:
        sending |= o.finished_sending or set()
        recving |= o.finished_recving or set()
        invalid |= o.invalid_block_ids or set()
        m = o.kv_connector_worker_meta
        if m is not None:
            meta = m if meta is None else meta.aggregate(m)
    return KVConnectorOutput(finished_sending=sending or None, finished_recving=recving or None,
                             kv_connector_worker_meta=meta, invalid_block_ids=invalid)


def loadable(r: Ranks) -> bool:
    return bool(r.manager.cpu_block_pool.cached_block_hash_to_block)


def test_a_store_is_loadable_only_after_every_rank_stored_it(tiny_model):
    r = Ranks(tiny_model)
    assert r.manager._expected_worker_count == TP
    r.hold = {1}
    request = Request("req-held", PROMPT, SamplingParams(max_tokens=2, ignore_eos=True), None,
                      block_hasher=get_request_block_hasher(BLOCK, sha256))
    r.sched.add_request(request)
    for _ in range(20):
        r.step()
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert r.manager._store_event_to_blocks and not loadable(r)  # rank 0 alone: not loadable
    r.hold = set()
    for _ in range(5):
        if not r.pending():
            break
        r.step()
    assert not r.manager._store_event_to_blocks and loadable(r)


def test_both_ranks_load_their_own_shard_byte_exact(tiny_model):
    r = Ranks(tiny_model)
    r.run(PROMPT)
    saved = [[block_bytes(parts_of(c), b) for b in range(NB)] for c in r.caches]
    assert saved[0][1][0].ne(saved[1][1][0]).any()  # the ranks' shards differ
    for c in r.caches:
        for p in parts_of(c):
            p.zero_()
    assert r.sched.kv_cache_manager.reset_prefix_cache()
    second = r.run(PROMPT)
    assert second.status == RequestStatus.FINISHED_LENGTH_CAPPED and r.host_hits[second.request_id] >= 96
    for rank, c in enumerate(r.caches):
        w = r.workers[rank].worker_handler
        assert w.core.stats.failed == 0 and w.core.is_idle()
        loaded = [b for b in range(NB) if any(p[b].any() for p in parts_of(c))]
        assert len(loaded) >= 6
        for b in loaded:  # each loaded block holds this rank's bytes of the block it was stored from
            assert any(all(torch.equal(x, y) for x, y in zip(block_bytes(parts_of(c), b), s)) for s in saved[rank])


def test_a_store_one_rank_failed_is_never_loadable_and_released(tiny_model):
    r = Ranks(tiny_model)
    free_before = r.manager.cpu_block_pool.get_num_free_blocks()
    with failing_copies(r.workers[1].worker_handler, Direction.D2H):  # rank 0 stores fine
        assert r.run(PROMPT).status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert r.workers[0].worker_handler.core.stats.failed == 0
    assert r.workers[1].worker_handler.core.stats.failed >= 1
    assert not loadable(r)
    assert r.manager.cpu_block_pool.get_num_free_blocks() == free_before  # released on both sides
    assert r.sched.kv_cache_manager.reset_prefix_cache()
    again = r.run(PROMPT)
    assert r.host_hits[again.request_id] == 0  # no host hit from a half-stored block
