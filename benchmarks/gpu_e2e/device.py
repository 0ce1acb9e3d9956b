"""Device-side entry point: run the selected parts in real vLLM 0.23 on the GPU.

  python -m benchmarks.gpu_e2e.device correctness ttft miss multiturn --out $OUT

Each part writes ``<part>.json`` and ``<part>.txt`` into ``--out`` and prints its table.
Engines run one per subprocess (engine.py). Exit 0, or 1 when a correctness check failed or a
part could not run. See docs/gpu_e2e.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

from .engine import ENV, EngineError, EngineSpec, start_all
from .tables import kv_bytes_per_token, parse_parts, spread, unique_prompts, write_part

os.environ.update(ENV)

# Llama-3-8B shape (KV 128 KiB per token in bf16)
L8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
           num_key_value_heads=8, max_position_embeddings=40960, rope_theta=500000.0, vocab_size=128256,
           bos_token_id=1, eos_token_id=2, pad_token_id=3)
L8B_KV_PER_TOKEN = kv_bytes_per_token(32, 8, 128, 2)
GiB = 1 << 30


def build_shape_model(out: Path, vocab_size: int) -> str:
    """Config-only 8B-shaped Llama (for load_format=dummy) + the tiny model's word tokenizer."""
    if (out / "config.json").exists():
        return str(out)
    from transformers import LlamaConfig

    from vllm_npu_offload.demo.tiny_model import build_tiny_llama

    tiny = build_tiny_llama(out.parent / "tiny-tok")
    out.mkdir(parents=True, exist_ok=True)
    cfg = LlamaConfig(**{**L8B, "vocab_size": vocab_size}, architectures=["LlamaForCausalLM"])
    cfg.save_pretrained(out)
    for f in tiny.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            (out / f.name).write_bytes(f.read_bytes())
    return str(out)


def _close(procs) -> None:
    for p in procs.values():
        p.close()


# ---------------------------------------------------------------------------- correctness
WHEN = {"r1": "first run", "r2": "after reset", "r3": "corrupted host page, after reset"}


def part_correctness(work: Path, a) -> dict:
    from vllm_npu_offload.demo.tiny_model import build_tiny_llama

    model = str(build_tiny_llama(work / "tiny8", seed=0, num_layers=8))
    prompts = [unique_prompts(1, 1000 + 100 * i, seed=11 + i)[0] for i in range(4)]  # 1000..1300 tokens
    mk = lambda label, kind, dtype: EngineSpec(label, kind, model, dtype=dtype, max_model_len=2048,
                                               kv_cache_bytes=GiB, gpu_util=0.05, cpu_bytes=GiB, max_num_seqs=8)
    specs = [mk("off-fp32", "off", "float32"), mk("native-fp32", "native", "float32"),
             mk("ours-fp32", "ours", "float32"), mk("simple-fp32", "simple", "float32"),
             mk("native-bf16", "native", "bfloat16"), mk("ours-bf16", "ours", "bfloat16")]
    t0 = time.perf_counter()
    procs = start_all(specs)
    res: dict = {"model": "random 8-layer Llama (tiny_model.py), saved weights", "prompt_tokens": [len(p) for p in prompts],
                 "max_tokens": a.max_tokens, "start_s": {k: p.start_s for k, p in procs.items()},
                 "start_wall_s": time.perf_counter() - t0, "runs": {}, "checks": []}
    try:
        for label, p in procs.items():
            if p.error:
                res["runs"][label] = {"error": p.error}
                continue
            try:
                r1 = p.call("generate", prompts=prompts, max_tokens=a.max_tokens)
                fr = p.call("flush_reset")
                r2 = p.call("generate", prompts=prompts, max_tokens=a.max_tokens)
                run = {"r1": r1, "reset": fr, "r2": r2}
                if label == "ours-fp32":
                    run["corrupt"] = p.call("corrupt_page")
                    run["reset3"] = p.call("flush_reset")
                    run["r3"] = p.call("generate", prompts=prompts, max_tokens=a.max_tokens)
                res["runs"][label] = run
            except EngineError as e:
                res["runs"][label] = {"error": str(e)}
    finally:
        _close(procs)
    toks = lambda r: [row["tokens"] for row in r["rows"]]
    host = lambda r: sum(row["cached"] for row in r["rows"])

    def check(dtype, engine, against, key, ref_label, ref_key, expect_equal=True, need_host=True):
        run, ref = res["runs"].get(engine, {}), res["runs"].get(ref_label, {})
        c = {"dtype": dtype, "engine": f"{engine} ({WHEN[key]})", "against": f"{ref_label} ({WHEN[ref_key]})",
             "expect_equal": expect_equal}
        err = run.get("error") or ref.get("error")
        if err:
            c.update(error=err, equal=False, **{"pass": False})
            return res["checks"].append(c)
        eq = toks(run[key]) == toks(ref[ref_key])
        c["host_tokens"] = host(run[key])
        ok = eq == expect_equal and (not need_host or c["host_tokens"] > 0)
        c.update(equal=eq, **{"pass": ok})
        res["checks"].append(c)

    check("float32", "off-fp32", "off-fp32", "r2", "off-fp32", "r1", need_host=False)
    for e in ("native-fp32", "ours-fp32", "simple-fp32"):
        check("float32", e, "off-fp32", "r1", "off-fp32", "r1", need_host=False)
        check("float32", e, "off-fp32", "r2", "off-fp32", "r1")
    check("float32", "ours-fp32", "off-fp32", "r3", "off-fp32", "r1", expect_equal=False)
    check("bfloat16", "ours-bf16", "native-bf16", "r1", "native-bf16", "r1", need_host=False)
    check("bfloat16", "ours-bf16", "native-bf16", "r2", "native-bf16", "r2")
    res["ok"] = all(c["pass"] for c in res["checks"])
    return res


# ---------------------------------------------------------------------------- 8B pool (ttft, miss)
def start_8b(work: Path, a) -> dict:
    model = build_shape_model(work / "llama8b", 128256)
    mk = lambda kind, label=None, env=None: EngineSpec(
        label or kind, kind, model, dtype="bfloat16", load_format="dummy", max_model_len=max(a.ttft_lengths) + 64,
        kv_cache_bytes=a.kv_gib * GiB, gpu_util=0.2, cpu_bytes=a.cpu_gib * GiB, max_num_seqs=64, env=env or {},
        cpus=tuple(a.cpus))
    # plus more engines of our spec, each with its own environment (an A/B in one run)
    base = (["off", "ours"] if a.no_native else ["off", "native", "ours"]) + (["null"] if a.null else [])
    specs = [mk(k) for k in base] + [mk("ours", label, env) for label, env in a.variant]
    t0 = time.perf_counter()
    procs = start_all(specs)
    errs = {k: p.error for k, p in procs.items() if p.error}
    print(f"[8b] engines up in {time.perf_counter() - t0:.0f}s: "
          + ", ".join(f"{k} {p.start_s or 0:.0f}s" for k, p in procs.items()) + (f"; errors {list(errs)}" if errs else ""),
          flush=True)
    return procs


def _reload(e, prompt, profile: bool = False) -> dict:
    """One timed reload: wait for stores, reset the device prefix cache, generate again."""
    fr = e.call("flush_reset")
    if not fr["ok"]:
        raise EngineError(f"reset_prefix_cache() kept failing ({fr})")
    return e.call("generate", prompts=prompt, max_tokens=1, steps=True, profile=profile)


def _keep_events(runs: list[dict]) -> dict:
    """The raw step timelines of the fastest, median and slowest rep (the rest: breakdowns)."""
    order = sorted(range(len(runs)), key=lambda i: runs[i]["wall_s"])
    pick = {"fastest": order[0], "median": order[len(order) // 2], "slowest": order[-1]} if order else {}
    return {k: {"rep": i, "events": runs[i].get("events", [])} for k, i in pick.items()}


def part_ttft(procs: dict, a) -> dict:
    """Reload TTFT: off (cold, device hit), then native and ours taking turns rep by rep (the
    one going first alternates), each rep with its step timeline (timeline.py)."""
    reps = a.reps
    res: dict = {"model": "Llama-3-8B shape, dummy weights, bf16", "reps": reps, "rows": [],
                 "kv_bytes_per_token": L8B_KV_PER_TOKEN, "errors": {}}
    ours = procs["ours"]
    try:
        res["bandwidth"] = ours.call("bandwidth", nbytes=GiB)
    except EngineError as e:
        res["errors"]["bandwidth"] = str(e)
    kinds = ("native", "ours")
    for L in a.ttft_lengths:
        row: dict = {"prompt_tokens": L}
        seed = 1000 + L
        # offload off: cold prefill of a new prompt, then the same prompt again (device prefix hit)
        cold, hit = [], []
        for r in range(min(reps, a.off_reps) + 1):
            p = unique_prompts(1, L, seed=seed + 100 + r)
            c = procs["off"].call("generate", prompts=p, max_tokens=1)["wall_s"]
            h = procs["off"].call("generate", prompts=p, max_tokens=1)["wall_s"]
            if r:
                cold.append(c)
                hit.append(h)
        row["cold_s"], row["device_hit_s"] = spread(cold), spread(hit)
        prompt = unique_prompts(1, L, seed=seed)
        live, runs = [], {k: [] for k in kinds}
        for kind in kinds:  # first run stores the prompt; one reload warms up
            try:
                row[f"{kind}_first_s"] = procs[kind].call("generate", prompts=prompt, max_tokens=1)["wall_s"]
                _reload(procs[kind], prompt)
                live.append(kind)
            except EngineError as e:
                res["errors"][f"{kind}-{L}"] = str(e)
        for r in range(reps):
            for kind in (live[:] if r % 2 == 0 else live[::-1]):  # a copy: a failing engine leaves ``live``
                try:
                    runs[kind].append(_reload(procs[kind], prompt))
                except EngineError as e:
                    res["errors"][f"{kind}-{L}"] = str(e)
                    live.remove(kind)
        for r in range(a.profile_reps):  # after the timed reps: the profiler slows what it records
            for kind in (live[:] if r % 2 == 0 else live[::-1]):
                try:
                    row.setdefault(f"{kind}_profiles", []).append(_reload(procs[kind], prompt, profile=True)["profile"])
                except EngineError as e:
                    res["errors"][f"{kind}-{L}-profile"] = str(e)
        for kind in kinds:
            xs = runs[kind]
            row[f"{kind}_s"] = spread([g["wall_s"] for g in xs]) if xs else {"n": 0}
            row[f"{kind}_host_tokens"] = [g["rows"][0]["cached"] for g in xs]
            row[f"{kind}_steps"] = [g["breakdown"] for g in xs]
            row[f"{kind}_step_events"] = _keep_events(xs)
        if runs["ours"]:
            xs = runs["ours"]
            row["ours_load_s"] = statistics.median(g["load_s"] for g in xs)
            row["ours_load_seen_s"] = statistics.median(g.get("load_wall_s", 0.0) for g in xs)  # submit -> poll saw it
            row["host_tokens"] = statistics.median(g["rows"][0]["cached"] for g in xs)
        bw = res.get("bandwidth", {}).get("h2d_gbps")
        if bw and row.get("host_tokens"):
            row["ideal_s"] = row["host_tokens"] * L8B_KV_PER_TOKEN / (bw * 1e9) + row["device_hit_s"]["median"]
        res["rows"].append(row)
        print(f"[ttft] {L}: {json.dumps({k: v for k, v in row.items() if k.endswith('_s')}, default=str)}", flush=True)
    try:  # which copy paths and staging our worker used (after its calibration ran)
        res["worker"] = ours.call("worker_info")
        print(f"[ttft] our worker: {json.dumps(res['worker'])}", flush=True)
    except EngineError as e:
        res["errors"]["worker_info"] = str(e)
    return res


def part_miss(procs: dict, a) -> dict:
    res: dict = {"model": "Llama-3-8B shape, dummy weights, bf16", "batch": a.miss_batch,
                 "prompt_tokens": a.miss_tokens, "max_tokens": a.miss_out, "runs": {k: [] for k in procs},
                 "store_gbps": [], "errors": {}, "variants": {label: env for label, env in a.variant}}
    kinds = [k for k in procs if not procs[k].error]
    for r in range(a.miss_reps + 1):
        prompts = unique_prompts(a.miss_batch, a.miss_tokens, seed=50_000 + r)
        got = {}
        for k in kinds[r % len(kinds):] + kinds[:r % len(kinds)]:  # rotate who goes first each round
            try:
                got[k] = procs[k].call("generate", prompts=prompts, max_tokens=a.miss_out, timeout=240, steps=True)
            except EngineError as e:
                res["errors"][f"{k}-{r}"] = str(e)
        if r and len(got) < len(kinds):  # a round some engine failed in pairs nothing: drop it for all
            res.setdefault("dropped_rounds", []).append(r)
        elif r:
            for k in kinds:
                g = got[k]
                res["runs"][k].append(g["wall_s"])
                res.setdefault("step_totals", {}).setdefault(k, []).append(g["totals"])
                res.setdefault("step_rows", {}).setdefault(k, []).append(g.get("step_rows", []))
                if k == "ours" and g["store_s"] > 0:
                    res["store_gbps"].append(g["store_bytes"] / g["store_s"] / 1e9)
        print(f"[miss] round {r}: " + ", ".join(f"{k} {got[k]['wall_s']:.3f}s" for k in kinds if r and k in got),
              flush=True)
    for k in procs:
        if procs[k].error:
            res["errors"][k] = procs[k].error
        elif procs[k].spec.kind == "ours":  # which paths and staging thresholds it ran with
            try:
                res.setdefault("worker", {})[k] = procs[k].call("worker_info")
            except EngineError as e:
                res["errors"][f"worker_info-{k}"] = str(e)
    return res


# ---------------------------------------------------------------------------- multi-turn
def _mt_conversations(a, seed: int) -> tuple[dict, list]:
    """The multi-turn workload; each ``seed`` gives new texts, so a later pass finds none of an
    earlier pass's prefixes cached."""
    from vllm_npu_offload.bench.multiturn.generate import Conversation, generate

    cfg = {"filetype": "generate_conversations", "num_conversations": a.mt_conversations, "text_files": [],
           "seed": seed, "num_system_prompts": 1, "max_context_tokens": 7000,
           "prompt_input": {"num_turns": {"distribution": "constant", "value": 2 * a.mt_turns},
                            "common_prefix_num_tokens": {"distribution": "constant", "value": 500},
                            "prefix_num_tokens": {"distribution": "uniform", "min": 1000, "max": 2000},
                            "num_tokens": {"distribution": "constant", "value": 100}},
           "prompt_output": {"num_tokens": {"distribution": "constant", "value": 32}}}
    return cfg, [Conversation(c["id"], c["messages"]) for c in generate(cfg)["conversations"]]


def part_multiturn(work: Path, a, out: Path) -> dict:
    """Multi-turn serving, one ``vllm serve`` per spec. With ``--mt-reps 1`` each server is started,
    run and stopped in turn; with more, all servers stay up and take turns pass by pass (the one
    going first alternates; every pass has new texts), so passes pair up like miss rounds."""
    import contextlib
    from concurrent.futures import ThreadPoolExecutor
    from dataclasses import replace
    from functools import partial

    from vllm_npu_offload.bench.multiturn.compare import run_one
    from vllm_npu_offload.bench.multiturn.driver import DriverConfig
    from vllm_npu_offload.bench.multiturn.launcher import PLAIN_CHAT_TEMPLATE, vllm_server
    from vllm_npu_offload.bench.multiturn.report import format_compare, run_payload, write_json
    from .engine import kv_transfer_config

    model = build_shape_model(work / "llama8b-v1000", 1000)  # server detokenizes: vocab = tokenizer's
    tmpl = work / "plain_chat_template.jinja"
    tmpl.write_text(PLAIN_CHAT_TEMPLATE)
    args = ["--dtype", "bfloat16", "--load-format", "dummy", "--enforce-eager", "--attention-backend", "TRITON_ATTN",
            "--block-size", "16", "--max-model-len", "8192", "--gpu-memory-utilization", "0.3",
            "--kv-cache-memory-bytes", str(int(a.mt_device_kv_gib * GiB)), "--enable-prefix-caching",
            "--chat-template", str(tmpl), "--served-model-name", "llama8b", "--max-num-seqs", "32", "--seed", "0"]
    cfg, convs = _mt_conversations(a, 0)
    dcfg = DriverConfig(url="http://127.0.0.1", model=None, clients=a.mt_clients, max_active=a.mt_conversations,
                        warmup=2, timeout_s=120, temperature=0.0, ignore_eos=True, max_requests=None, progress=False)
    env = {**ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}  # a normal server: engine core in its own process
    logs = work / "mt_logs"
    res: dict = {"workload": cfg, "server_args": args, "cpu_bytes": a.cpu_gib * GiB, "summaries": [], "errors": [],
                 "reps": a.mt_reps}
    payload = {}
    labels = ["off", "native", "ours"] + (["null"] if a.null else [])

    def server(label: str):
        extra = []
        if label in ("native", "null"):
            extra = ["--kv-transfer-config", json.dumps(kv_transfer_config(label, a.cpu_gib * GiB, 64))]
        return partial(vllm_server, model, args + extra, offload=label == "ours", cpu_bytes=a.cpu_gib * GiB,
                       block_size=64, env=env, startup_timeout_s=300, log_path=logs / f"server-{label}.log",
                       label=label, cpus=a.cpus)

    def one(label: str, conv_list: list, url: str | None, rep: int) -> None:
        t0 = time.perf_counter()
        try:
            run, s = run_one(conv_list, replace(dcfg, url=url) if url else dcfg, label, None if url else server(label))
        except Exception as e:  # noqa: BLE001 - record and go on with the next server
            res["errors"].append({"label": label, "rep": rep, "error": f"{type(e).__name__}: {e}"[-3000:]})
            return
        s["wall_with_start_s"], s["rep"] = time.perf_counter() - t0, rep
        res["summaries"].append(s)
        payload[label if a.mt_reps <= 1 else f"{label}#{rep}"] = run_payload(run, s)
        print(f"[multiturn] {label} pass {rep}: {s['requests_per_s']:.2f} req/s, TTFT p50 "
              f"{s['ttft_ms'].get('p50', 0):.0f} ms, TPOT p50 {s['tpot_ms'].get('p50', 0):.1f} ms, "
              f"{s['wall_with_start_s']:.0f}s", flush=True)

    if a.mt_reps <= 1:
        for label in labels:
            one(label, convs, None, 0)
    else:
        with contextlib.ExitStack() as stack:
            urls, cms = {}, {label: server(label)() for label in labels}
            with ThreadPoolExecutor(len(cms)) as pool:  # start together: each start takes about a minute
                futs = {label: pool.submit(cm.__enter__) for label, cm in cms.items()}
            for label, fut in futs.items():
                try:
                    urls[label] = fut.result()
                    stack.push(cms[label].__exit__)
                except Exception as e:  # noqa: BLE001
                    res["errors"].append({"label": label, "rep": -1, "error": f"{type(e).__name__}: {e}"[-3000:]})
            live = [k for k in labels if k in urls]
            for r in range(a.mt_reps):
                conv_r = convs if r == 0 else _mt_conversations(a, r)[1]
                for label in (live if r % 2 == 0 else live[::-1]):
                    one(label, conv_r, urls[label], r)
    by = {s["label"]: s for s in res["summaries"] if s["rep"] == 0}
    for k in labels[1:]:
        if "off" in by and k in by:
            res[f"compare_off_{k}"] = format_compare(by["off"], by[k])
    write_json(out / "multiturn_requests.json", payload)
    return res


# ---------------------------------------------------------------------------- main
def _variant(text: str) -> tuple[str, dict[str, str]]:
    label, _, rest = text.partition(":")
    pairs = [p.partition("=") for p in rest.split(",") if p]
    if not label or label in ("off", "native", "ours", "null") or not pairs or any(not k or not eq for k, eq, _ in pairs):
        raise argparse.ArgumentTypeError(f"--variant {text!r}: expected NEWLABEL:VAR=VAL[,VAR=VAL] "
                                         f"(a label other than off/native/ours/null)")
    return label, {k: v for k, _, v in pairs}


def _cpus(text: str) -> list[int]:
    """"4-7" or "4,5,8-9" -> [4, 5, 6, 7] / [4, 5, 8, 9]."""
    out: list[int] = []
    try:
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            a, b = int(lo), int(hi or lo)
            if b < a:
                raise ValueError(part)
            out += range(a, b + 1)
    except ValueError:
        out = []
    if not out or min(out) < 0:
        raise argparse.ArgumentTypeError(f"--cpus {text!r}: expected CPU numbers like 4-7 or 4,5,8-9")
    return sorted(set(out))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="gpu_e2e.device", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("parts", nargs="*", help="correctness ttft miss multiturn, or all (default)")
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_e2e_out"))
    ap.add_argument("--work", default="/tmp/gpu_e2e/work")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions after one warm-up (>= 5)")
    ap.add_argument("--cpus", type=_cpus, default=[],
                    help="run every engine (ttft/miss) or server (multiturn) on these CPUs (e.g. 4-7). They take "
                         "turns, so sharing costs nothing, and a slow spell of a core then hits native and ours alike")
    ap.add_argument("--profile-reps", type=int, default=0,
                    help="ttft: reloads per spec and length whose first forward is profiled (torch.profiler), after the timed reps")
    ap.add_argument("--off-reps", type=int, default=5,
                    help="ttft: offload-off reps (cold prefill + device hit; a 32k cold prefill takes seconds)")
    ap.add_argument("--miss-reps", type=int, default=12,
                    help="timed miss rounds after one warm-up (engines take turns going first)")
    ap.add_argument("--max-tokens", type=int, default=16, help="correctness: generated tokens per prompt")
    ap.add_argument("--ttft-lengths", type=lambda s: [int(x) for x in s.split(",")], default=[2048, 8192, 32768])
    ap.add_argument("--variant", action="append", default=[], type=_variant, metavar="LABEL:VAR=VAL[,VAR=VAL]",
                    help="one more engine of our spec in the 8B pool, with these environment variables; the "
                         "miss part runs it beside the others (repeatable)")
    ap.add_argument("--no-native", action="store_true",
                    help="8B pool without vLLM's native spec (room for one more variant; ttft needs native)")
    ap.add_argument("--null", action="store_true",
                    help="add vLLM's spec without copies (null_spec.py) to the 8B pool: the miss part then splits "
                         "the cost into vLLM's connector (null vs off) and the copies (native/ours vs null); "
                         "four engines need --kv-gib 13; not with ttft (a reload would stop it). With multiturn: a "
                         "fourth server, for workloads with no offload hits only (its first load stops it)")
    ap.add_argument("--kv-gib", type=int, default=18, help="device KV per 8B engine (GiB)")
    ap.add_argument("--cpu-gib", type=int, default=8, help="host KV per offload engine (GiB)")
    ap.add_argument("--miss-batch", type=int, default=48)
    ap.add_argument("--miss-tokens", type=int, default=2000)
    ap.add_argument("--miss-out", type=int, default=64)
    ap.add_argument("--mt-conversations", type=int, default=32)
    ap.add_argument("--mt-turns", type=int, default=4)
    ap.add_argument("--mt-reps", type=int, default=1,
                    help="multiturn passes; above 1 all servers stay up and take turns pass by pass, with new texts")
    ap.add_argument("--mt-clients", type=int, default=8)
    ap.add_argument("--mt-device-kv-gib", type=float, default=4.0, help="multiturn: device KV per server (GiB)")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        parts = parse_parts(a.parts)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.null and "ttft" in parts:
        print("error: --null engines store no bytes and stop at a reload; run ttft without it", file=sys.stderr)
        return 2
    if a.no_native and "ttft" in parts:
        print("error: --no-native leaves ttft nothing to compare with; run ttft without it", file=sys.stderr)
        return 2
    if a.cpus and a.mt_reps > 1 and "multiturn" in parts:
        print("error: --cpus with --mt-reps > 1 puts every server, up at once, on the same CPUs; idle vLLM servers "
              "still use CPU there (TPOT doubled in the one run that tried it): leave --cpus out", file=sys.stderr)
        return 2
    bad = sorted(set(a.cpus) - os.sched_getaffinity(0))
    if bad:
        print(f"error: --cpus {bad} not available here (allowed: {sorted(os.sched_getaffinity(0))})", file=sys.stderr)
        return 2
    out, work = Path(a.out), Path(a.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    rc, tables, procs = 0, {}, None
    try:
        for part in parts:
            t0 = time.perf_counter()
            try:
                if part == "correctness":
                    res = part_correctness(work, a)
                    rc |= 0 if res["ok"] else 1
                elif part in ("ttft", "miss"):
                    if procs is None:
                        procs = start_8b(work, a)
                    res = part_ttft(procs, a) if part == "ttft" else part_miss(procs, a)
                    res["engine_start_s"] = {k: p.start_s for k, p in procs.items()}
                    res["engine_errors"] = {k: p.error for k, p in procs.items() if p.error}
                else:
                    if procs is not None:
                        _close(procs)
                        procs = None
                    res = part_multiturn(work, a, out)
            except Exception as e:  # noqa: BLE001 - the other parts still run
                res = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-6000:]}
                rc = 1
                print(res["traceback"], file=sys.stderr)
            res["part_wall_s"] = time.perf_counter() - t0
            tables[part] = write_part(out, part, res)
            print(f"\n== {part} ({res['part_wall_s']:.0f}s) ==\n{tables[part]}\n", flush=True)
    finally:
        if procs is not None:
            _close(procs)
    print("\n".join(f"\n== {k} ==\n{v}" for k, v in tables.items()))
    return rc


if __name__ == "__main__":
    sys.exit(main())
