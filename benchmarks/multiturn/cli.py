"""Command line: ``generate`` | ``run`` | ``compare`` | ``serve`` (see docs/multiturn.md).

Every user error ends with one line ``error: ...`` naming the bad value and exit status 2;
nothing waits without a bound (request, health and shutdown timeouts)."""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
import tempfile
from functools import partial
from pathlib import Path

from . import BenchError
from .dists import dist_from_spec

WORKLOAD = dict(conversations=24, turns="uniform:6,9", system="500", prefix="lognormal:1000,5000",
                user="uniform:120,160", answer="uniform:80,120", max_context=None, clients=4)
# --tiny: sized for 2 CPU cores. 8 open conversations growing to ~800 tokens (3.5k unique in all)
# overflow the 64-block (2k-token) device cache, so each history is evicted before its next turn.
TINY_WORKLOAD = dict(conversations=8, turns="6", system="256", prefix="64", user="64", answer="16",
                     max_context=1400, clients=2)
TINY_GPU_BLOCKS, TINY_MAX_MODEL_LEN = 64, 1536


def _add_workload(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("workload (ignored with --input)")
    g.add_argument("--input", "-i", help="conversations JSON (ours or vLLM's OpenAI-style list) or a "
                   "generate_conversations config; default: generate from the flags below")
    g.add_argument("--conversations", "-n", type=int, help="number of conversations N (default 24)")
    g.add_argument("--turns", "-t", help="user turns per conversation, distribution (default uniform:6,9)")
    g.add_argument("--system", help="shared system prompt words = common prefix (default 500)")
    g.add_argument("--num-system-prompts", type=int, default=1, help="distinct shared system prompts")
    g.add_argument("--prefix", help="unique first-turn prefix words (default lognormal:1000,5000)")
    g.add_argument("--user", help="user words per turn (default uniform:120,160)")
    g.add_argument("--answer", help="answer tokens per turn = max_tokens (default uniform:80,120)")
    g.add_argument("--max-context", type=int, help="end a conversation before its history would exceed "
                   "this many words (keep under the server's max-model-len)")
    g.add_argument("--text-file", action="append", default=[], help="local text file(s) to draw words from "
                   "(default: vocabulary words w0..w959)")
    g.add_argument("--seed", type=int, default=0)


def _add_driver(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("load")
    g.add_argument("--clients", "-k", type=int, help="concurrent clients K (default 4; 2 with --tiny)")
    g.add_argument("--max-active", type=int, default=None, help="open conversations at once (default 2K)")
    g.add_argument("--warmup", type=int, default=2, help="throwaway requests before timing")
    g.add_argument("--max-requests", type=int, default=None, help="stop after this many requests")
    g.add_argument("--model", default=None, help="model name to request (default: the server's first)")
    g.add_argument("--timeout", type=float, default=120.0, help="per-request timeout, seconds")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--no-ignore-eos", action="store_true", help="do not send vLLM's ignore_eos "
                   "(needed for non-vLLM servers; answers may then be shorter)")
    g.add_argument("--no-progress", action="store_true")
    g.add_argument("--out", "-o", default="bench_out", help="output folder for JSON and PNG")


def _add_server(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("servers started here (not with --url*)")
    g.add_argument("--tiny", action="store_true", help="offline tiny random model on CPU with a small "
                   "workload: the whole comparison in a few minutes, no downloads")
    g.add_argument("--server-model", help="model path/name for the started vLLM servers")
    g.add_argument("--server-args", default="", help="extra api_server flags, one quoted string, e.g. "
                   "\"--max-model-len 8192 --gpu-memory-utilization 0.9\"")
    g.add_argument("--cpu-bytes", type=int, help="host bytes for offloaded KV with offload on "
                   "(default 8 GiB; 256 MiB with --tiny)")
    g.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for /health")
    g.add_argument("--python", default=sys.executable, help="interpreter that has vLLM")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="bench_multiturn", description="Multi-turn serving benchmark (KV offload).")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="write a conversations JSON")
    _add_workload(g)
    g.add_argument("--output", required=True, help="where to write the JSON")
    r = sub.add_parser("run", help="replay against one running server")
    r.add_argument("--url", required=True, help="e.g. http://127.0.0.1:8000")
    r.add_argument("--label", default="run")
    _add_workload(r)
    _add_driver(r)
    c = sub.add_parser("compare", help="offload off vs on, same workload")
    c.add_argument("--url-off", help="running server without offload")
    c.add_argument("--url-on", help="running server with offload")
    _add_workload(c)
    _add_driver(c)
    _add_server(c)
    s = sub.add_parser("serve", help="start one server (offload on/off) and keep it until Ctrl-C")
    s.add_argument("--offload", action="store_true")
    _add_server(s)
    return ap


def _config(a: argparse.Namespace) -> dict:
    d = lambda spec, name: dist_from_spec(spec, name).to_dict()
    turns = dist_from_spec(a.turns, "--turns")
    msgs = turns.to_dict()  # vLLM counts messages: 2 per user turn
    for k in ("value", "min", "max"):
        if k in msgs:
            msgs[k] = int(msgs[k]) * 2
    if a.num_system_prompts < 1:
        raise BenchError(f"--num-system-prompts = {a.num_system_prompts}: must be >= 1")
    cfg = {"filetype": "generate_conversations", "num_conversations": a.conversations, "text_files": a.text_file,
           "seed": a.seed, "num_system_prompts": a.num_system_prompts,
           "prompt_input": {"num_turns": msgs, "common_prefix_num_tokens": d(a.system, "--system"),
                            "prefix_num_tokens": d(a.prefix, "--prefix"), "num_tokens": d(a.user, "--user")},
           "prompt_output": {"num_tokens": d(a.answer, "--answer")}}
    if a.max_context is not None:
        cfg["max_context_tokens"] = a.max_context
    return cfg


def _conversations(a: argparse.Namespace):
    from .generate import Conversation, generate, load_conversations

    if a.input:
        return load_conversations(a.input, a.seed)
    if a.conversations < 1:
        raise BenchError(f"--conversations = {a.conversations}: must be >= 1")
    return [Conversation(c["id"], c["messages"]) for c in generate(_config(a))["conversations"]]


def _driver_cfg(a: argparse.Namespace, url: str):
    from .driver import DriverConfig

    cfg = DriverConfig(url=url, model=a.model, clients=a.clients, max_active=a.max_active, warmup=a.warmup,
                       timeout_s=a.timeout, temperature=a.temperature, ignore_eos=not a.no_ignore_eos,
                       max_requests=a.max_requests, progress=not a.no_progress)
    cfg.validate()
    return cfg


def _fill_workload(a: argparse.Namespace, tiny: bool) -> None:
    """Unset workload flags take the defaults (the small --tiny ones with --tiny)."""
    for k, v in (TINY_WORKLOAD if tiny else WORKLOAD).items():
        if getattr(a, k, 0) is None:
            setattr(a, k, v)


def _server_factories(a: argparse.Namespace, work: Path) -> dict:
    from .launcher import tiny_server_setup, vllm_server

    if a.tiny:
        model, args, env = tiny_server_setup(work, TINY_MAX_MODEL_LEN, TINY_GPU_BLOCKS)
        block = 32
    else:
        if not a.server_model:
            raise BenchError("compare needs --url-off and --url-on, --server-model MODEL, or --tiny")
        model, args, env, block = a.server_model, [], {}, None
    args = args + shlex.split(a.server_args)
    cpu_bytes = a.cpu_bytes or ((256 << 20) if a.tiny else (8 << 30))
    if cpu_bytes < (1 << 20):
        raise BenchError(f"--cpu-bytes = {cpu_bytes}: too small for offloaded KV (use >= 1 MiB)")
    mk = lambda off: partial(vllm_server, model, args, offload=not off, cpu_bytes=cpu_bytes, block_size=block,
                             env=env, startup_timeout_s=a.startup_timeout, python=a.python,
                             log_path=work / f"server-{'off' if off else 'on'}.log",
                             label="offload-off" if off else "offload-on")
    return {"offload-off": mk(True), "offload-on": mk(False)}


def _main(argv: list[str] | None) -> int:
    a = build_parser().parse_args(argv)
    if a.cmd != "serve":
        _fill_workload(a, a.cmd == "compare" and a.tiny)
    if a.cmd == "generate":
        from .generate import generate
        from .report import write_json

        data = generate(_config(a))
        write_json(a.output, data)
        print(f"wrote {len(data['conversations'])} conversations to {a.output}")
        return 0
    if a.cmd == "serve":
        return _serve(a)
    if a.cmd == "compare" and a.tiny and a.max_active is None:
        a.max_active = a.conversations  # all open at once: histories overflow the small device cache
    convs = _conversations(a)
    out = Path(a.out)
    if a.cmd == "run":
        from .compare import run_one
        from .plot import plot_ttft_by_turn
        from .report import format_summary, run_payload, write_json

        run, s = run_one(convs, _driver_cfg(a, a.url), a.label, None)
        print(format_summary(s))
        write_json(out / f"{a.label}.json", run_payload(run, s))
        png = plot_ttft_by_turn([s], out / f"{a.label}_ttft_by_turn.png")
        print(f"wrote {out / (a.label + '.json')}" + (f" and {png}" if png else ""))
        return 0 if s["failed"] == 0 else 1
    from .compare import compare

    if bool(a.url_off) != bool(a.url_on):
        raise BenchError("give both --url-off and --url-on, or neither (then servers are started here)")
    dcfg = _driver_cfg(a, a.url_off or "http://127.0.0.1")
    if a.url_off:
        servers = {"offload-off": a.url_off, "offload-on": a.url_on}
    else:
        work = out / "work"
        work.mkdir(parents=True, exist_ok=True)
        servers = _server_factories(a, work.resolve())
    res = compare(convs, dcfg, out, servers)
    print("\n" + res["table"])
    print(f"\nwrote {res['json']}" + (f" and {res['png']}" if res["png"] else ""))
    return 0 if all(s["failed"] == 0 for s in res["summaries"]) else 1


def _serve(a: argparse.Namespace) -> int:
    import time

    work = Path(tempfile.mkdtemp(prefix="bench-mt-"))
    f = _server_factories(a, work)["offload-on" if a.offload else "offload-off"]
    with f() as url:
        print(f"serving on {url} (offload {'on' if a.offload else 'off'}); Ctrl-C stops it", flush=True)
        while True:
            time.sleep(3600)


def main(argv: list[str] | None = None) -> int:
    """Exit 0 = all requests ok, 1 = some failed, 2 = bad input or unreachable/failed server."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the launcher's cleanup on SIGTERM
    try:
        return _main(argv)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
