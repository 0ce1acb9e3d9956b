#!/usr/bin/env python3
"""Slice-ramp sweep of staged transfers (first slice size x growth factor), on the device alone
and as launched, for the page sizes where fixed per-transfer costs matter most. Prints a table
and writes JSON. Used to choose staging.MIN_SLICE_BYTES / GROWTH (docs/benchmarks.md)."""

import argparse
import itertools
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from vllm_npu_offload import staging  # noqa: E402
from benchmarks.core_bench import SHAPES, bench_shape  # noqa: E402
from vllm_npu_offload.platform import get_platform  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", default="tiny-1k,qwen2.5-0.5b-fp8,qwen2.5-0.5b,llama-8b")
    ap.add_argument("--first-kib", default="256,512,2048", help="MIN_SLICE_BYTES values, KiB")
    ap.add_argument("--growth", default="2,4,8")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    platform = get_platform()
    rows = []
    print(f"device: {platform.device_name()}")
    print("| shape | first KiB | growth | dir | exec % | gpu % |")
    print("|---|---|---|---|---|---|")
    for name in a.shapes.split(","):
        for first, growth in itertools.product(map(int, a.first_kib.split(",")), map(int, a.growth.split(","))):
            staging.MIN_SLICE_BYTES, staging.GROWTH = first * 1024, growth
            res = bench_shape(platform, SHAPES[name], a.reps, hosts=("random",))
            for r in res["rows"]:
                rows.append({"shape": name, "first_kib": first, "growth": growth, "dir": r["dir"],
                             "exec_pct": r["staged_exec_pct"], "gpu_pct": r["staged_gpu_pct"]})
                print(f"| {name} | {first} | {growth} | {r['dir']} | {r['staged_exec_pct']:.0f} | "
                      f"{r['staged_gpu_pct']:.0f} |", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": platform.device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
