"""Multi-turn benchmark without a server: generator determinism and limits, config errors, CLI errors."""

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from benchmarks.multiturn import BenchError
from benchmarks.multiturn.dists import dist_from_spec, parse_dist
from benchmarks.multiturn.generate import generate, load_conversations

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = [sys.executable, str(ROOT / "scripts" / "bench_multiturn.py")]

CFG = {
    "filetype": "generate_conversations", "num_conversations": 12, "num_system_prompts": 2,
    "prompt_input": {
        "num_turns": {"distribution": "uniform", "min": 4, "max": 9},
        "common_prefix_num_tokens": {"distribution": "constant", "value": 40},
        "prefix_num_tokens": {"distribution": "lognormal", "average": 50, "max": 90},
        "num_tokens": {"distribution": "zipf", "alpha": 1.5, "max": 30},
    },
    "prompt_output": {"num_tokens": {"distribution": "uniform", "min": 5, "max": 12}},
}


def test_deterministic_for_seed():
    a, b, c = generate(CFG, seed=7), generate(CFG, seed=7), generate(CFG, seed=8)
    assert a == b
    assert a["conversations"] != c["conversations"]


def test_respects_lengths():
    data = generate(CFG, seed=1)
    systems = set()
    for conv in data["conversations"]:
        msgs = conv["messages"]
        assert msgs[0]["role"] == "system" and len(msgs[0]["content"].split()) == 40
        systems.add(msgs[0]["content"])
        body = msgs[1:]
        assert 2 <= len(body) // 2 <= 5 and len(body) % 2 == 0  # 4..9 messages -> 2..5 user turns
        for i, m in enumerate(body):
            assert m["role"] == ("user" if i % 2 == 0 else "assistant")
            n = len(m["content"].split())
            if m["role"] == "assistant":
                assert 5 <= n <= 12 and m["num_tokens"] == n
            elif i == 0:
                assert 1 <= n <= 90 + 30
            else:
                assert 1 <= n <= 30
    assert len(systems) == 2  # shared system prompts = common prefixes


def test_max_context_caps_history():
    cfg = {**CFG, "max_context_tokens": 250}
    for conv in generate(cfg, seed=2)["conversations"]:
        assert sum(len(m["content"].split()) for m in conv["messages"]) <= 250


def test_distributions_clamp_and_parse():
    rng = np.random.default_rng(0)
    for spec in ("7", "uniform:3,9", "lognormal:100,150", "zipf:1.2,40", "poisson:10,12"):
        xs = dist_from_spec(spec, "--x").sample(rng, 500)
        assert min(xs) >= 0 and max(xs) <= (7 if spec == "7" else int(spec.split(",")[-1]))
    assert parse_dist({"distribution": "lognormal", "mean": 3.0, "sigma": 0.5, "max": 10}, "x").sample(rng, 50)


@pytest.mark.parametrize("spec,msg", [
    ({"distribution": "gauss", "value": 1}, "allowed are constant, uniform"),
    ({"distribution": "uniform", "min": 5}, "needs 'max'"),
    ({"distribution": "zipf", "alpha": 1.0}, "alpha > 1"),
    ({"distribution": "constant", "value": -3}, "must be a number >= 0"),
])
def test_bad_distribution_named(spec, msg):
    with pytest.raises(BenchError, match=msg):
        parse_dist(spec, "prompt_input.num_tokens")


def test_text_file_and_roundtrip(tmp_path):
    txt = tmp_path / "book.txt"
    txt.write_text("alpha beta gamma delta epsilon zeta eta theta " * 20)
    data = generate({**CFG, "text_files": [str(txt)]}, seed=3)
    words = set(txt.read_text().split())
    assert all(set(m["content"].split()) <= words for c in data["conversations"] for m in c["messages"])
    out = tmp_path / "convs.json"
    out.write_text(json.dumps(data))
    convs = load_conversations(str(out))
    assert len(convs) == 12 and convs[0].turns[0][1] == data["conversations"][0]["messages"][2]["num_tokens"]
    cfg = tmp_path / "cfg.json"  # a generator config is read and generated on the fly
    cfg.write_text(json.dumps(CFG))
    assert [c.messages for c in load_conversations(str(cfg), seed=3)] == \
        [c["messages"] for c in generate(CFG, seed=3)["conversations"]]


def test_missing_text_file():
    with pytest.raises(BenchError, match="nope.txt"):
        generate({**CFG, "text_files": ["nope.txt"]})


def _cli(*args, timeout=60):
    t = time.monotonic()
    p = subprocess.run(SCRIPT + list(args), capture_output=True, text=True, timeout=timeout)
    return p, time.monotonic() - t


@pytest.mark.parametrize("args,msg", [
    (["run", "--url", "http://127.0.0.1:9", "--input", "/nonexistent/convs.json"], "does not exist"),
    (["run", "--url", "http://127.0.0.1:9", "-n", "2", "--clients", "0"], "clients = 0"),
    (["run", "--url", "http://127.0.0.1:9", "-n", "2", "--turns", "gauss:3"], "allowed are"),
    (["run", "--url", "http://127.0.0.1:9", "-n", "2", "--timeout", "3"], "cannot reach"),
    (["compare", "-n", "2"], "--url-off and --url-on"),
])
def test_cli_errors_are_clear_and_bounded(args, msg, tmp_path):
    p, took = _cli(*args, "--out", str(tmp_path))
    assert p.returncode == 2, p.stderr
    assert msg in p.stderr and p.stderr.strip().startswith("error:"), p.stderr
    assert took < 30


def test_cli_generate(tmp_path):
    out = tmp_path / "c.json"
    p, _ = _cli("generate", "-n", "3", "--turns", "2", "--system", "10", "--prefix", "0", "--user", "5",
                "--answer", "4", "--output", str(out))
    assert p.returncode == 0, p.stderr
    convs = json.loads(out.read_text())["conversations"]
    assert len(convs) == 3 and all(len(c["messages"]) == 5 for c in convs)


def test_report_and_plot_from_fake_runs(tmp_path):
    from benchmarks.multiturn.client import RequestResult
    from benchmarks.multiturn.plot import plot_ttft_by_turn
    from benchmarks.multiturn.report import format_compare, format_summary, summarize
    from benchmarks.multiturn.server_metrics import delta

    def fake(label, scale):
        res = [RequestResult(f"c{c}", t, 0, 0.0, 10.0 * scale * (t + 1), 2.0, 50.0 * scale, 100 + 20 * t, 8, 8,
                             "usage", True) for c in range(3) for t in range(4)]
        res.append(RequestResult("c9", 0, 1, error="HTTP 500: boom"))
        srv = delta({"prefix_queries": 10, "prefix_hits": 5}, {"prefix_queries": 110, "prefix_hits": 55,
                                                                "offload_load_bytes": 2**21})
        return summarize({"label": label, "url": "u", "model": "m", "results": res, "runtime_s": 2.0,
                          "warmup_s": 0.0, "planned": 13, "skipped": 0, "clients": 2, "max_active": 3,
                          "server": srv})

    off, on = fake("offload-off", 1.0), fake("offload-on", 0.5)
    assert off["completed"] == 12 and off["failed"] == 1 and off["requests_per_s"] == 6.0
    assert off["ttft_ms"]["p50"] == 25.0 and off["server"]["prefix_hit_rate"] == 0.5
    text = format_summary(off)
    assert "12 / 13" in text and "HTTP 500: boom" in text and "| server prefix hit %" in text
    table = format_compare(off, on)
    assert "| ttft_ms p50 turn 3" in table and "0.50x" in table and "offload loaded MiB" in table
    png = plot_ttft_by_turn([off, on], tmp_path / "p.png")
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("body,timeout,msg", [
    ("echo boom >&2; exit 3", 30, "exited with code 3"),
    ("sleep 60", 1.5, "not healthy after"),
])
def test_launcher_failures_are_bounded_and_cleaned_up(tmp_path, body, timeout, msg):
    """A server that dies or never gets healthy: clear error with the log tail, process group gone."""
    import os

    from benchmarks.multiturn.launcher import vllm_server

    fake = tmp_path / "fakepython"
    fake.write_text(f"#!/bin/sh\necho $$ > {tmp_path}/pid\n{body}\n")
    fake.chmod(0o755)
    t = time.monotonic()
    with pytest.raises(BenchError, match=msg):
        with vllm_server("m", python=str(fake), startup_timeout_s=timeout, log_path=tmp_path / "s.log"):
            pass
    assert time.monotonic() - t < 25
    pid = int((tmp_path / "pid").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_client_side_imports_neither_vllm_nor_torch():
    code = ("import sys; import benchmarks.multiturn.cli, benchmarks.multiturn.compare, "
            "benchmarks.multiturn.launcher; "
            "print(sorted(m for m in ('vllm', 'torch', 'transformers') if m in sys.modules))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 0 and p.stdout.strip() == "[]", p.stdout + p.stderr


def test_launcher_pins_the_server_to_the_cpus_asked_for(tmp_path):
    from benchmarks.multiturn.launcher import vllm_server

    fake = tmp_path / "fakepython"
    fake.write_text(f"#!/bin/sh\ngrep Cpus_allowed_list /proc/$$/status > {tmp_path}/cpus\nexit 3\n")
    fake.chmod(0o755)
    with pytest.raises(BenchError, match="exited with code 3"):
        with vllm_server("m", python=str(fake), startup_timeout_s=30, log_path=tmp_path / "s.log", cpus=[0]):
            pass
    assert (tmp_path / "cpus").read_text().split() == ["Cpus_allowed_list:", "0"]
