#!/usr/bin/env python3
"""Whole-transfer benchmark through the worker core (direct vs staged vs one contiguous
copy), and GEMM interference. See benchmarks/core_bench.py."""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.core_bench import DEFAULT_SHAPES, run  # noqa: E402


def _names(s: str) -> list[str]:
    return [x for x in s.split(",") if x]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", choices=("cuda", "npu", "cpu"), default=None, help="default: detect")
    ap.add_argument("--shapes", default=",".join(DEFAULT_SHAPES), help="comma list of KV shapes ('' = none)")
    ap.add_argument("--reps", type=int, default=10, help="timed repetitions (median reported)")
    ap.add_argument("--staging-bytes", type=int, default=None, help="device staging memory (default: the product's)")
    ap.add_argument("--interference", nargs="?", const="llama-8b,qwen2.5-0.5b", default=None,
                    help="GEMM slowdown while transfers run, for these shapes")
    ap.add_argument("--json", default=None, help="write the results here")
    a = ap.parse_args()
    run(a.device, _names(a.shapes), a.reps, a.interference is not None, _names(a.interference or ""),
        a.staging_bytes, a.json)


if __name__ == "__main__":
    main()
