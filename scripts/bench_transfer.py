#!/usr/bin/env python3
"""Transfer benchmark: per-copy loop, batch DMA, SM copy, the chosen path and one
contiguous copy, per model config and direction. See benchmarks/transfer.py."""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.transfer import CONFIGS, run  # noqa: E402


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", choices=("cuda", "npu", "cpu"), default=None, help="default: detect")
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help=f"comma list of {','.join(CONFIGS)} ('' = none, e.g. with --sweep only)")
    ap.add_argument("--reps", type=int, default=20, help="timed repetitions (median reported)")
    ap.add_argument("--sweep", nargs="?", const="1,4,16,64,256", default=None,
                    help="block counts to sweep (default list 1,4,16,64,256)")
    ap.add_argument("--sweep-configs", default="llama-8b,qwen2.5-0.5b,llama-70b-tp4")
    ap.add_argument("--interference", action="store_true", help="GEMM slowdown per path (for --configs)")
    ap.add_argument("--sm-variants", action="store_true", help="SM path over grid sizes and tile bytes (--configs)")
    ap.add_argument("--no-table", action="store_true", help="skip the main table (only interference/variants)")
    ap.add_argument("--json", default=None, help="write the results here")
    a = ap.parse_args()
    run(a.device, [c for c in a.configs.split(",") if c], a.reps, _ints(a.sweep) if a.sweep else None,
        [c for c in a.sweep_configs.split(",") if c], a.interference, a.sm_variants, a.json,
        table=not a.no_table)


if __name__ == "__main__":
    main()
