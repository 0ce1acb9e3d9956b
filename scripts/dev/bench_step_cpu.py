#!/usr/bin/env python3
"""Engine-step CPU per transfer (plan, enqueue, poll), staged and direct, on this CPU with the
ACL emulation (needs ACL headers: NPU_OFFLOAD_ACL_INCLUDE or a fetchable torch-npu wheel).
See benchmarks/step_cpu.py."""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from benchmarks.step_cpu import DEFAULT_BLOCKS, HOSTS, MODES, STEP_SHAPES, run  # noqa: E402


def _names(s: str) -> list[str]:
    return [x for x in s.split(",") if x]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", default=",".join(STEP_SHAPES), help="comma list of KV shapes")
    ap.add_argument("--blocks", default=",".join(map(str, DEFAULT_BLOCKS)), help="blocks per transfer (per KV group)")
    ap.add_argument("--bpc", type=int, default=4, help="engine blocks per host chunk (64-token offload blocks)")
    ap.add_argument("--hosts", default=",".join(HOSTS),
                    help="host chunks: random, seq (consecutive), rev (consecutive, descending: vLLM's reuse order)")
    ap.add_argument("--modes", default=",".join(MODES), help="staged, direct")
    ap.add_argument("--reps", type=int, default=200, help="timed transfers per row (after the warm-up)")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--native-dir", default=None, help="build the ACL library + emulation here (default: a temp dir)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--baseline-tree", default=None,
                    help="another checkout (e.g. `git worktree add /tmp/base <commit>`): time its package too, "
                         "rep by rep in turn with this one, and print before / after")
    ap.add_argument("--fused", action="store_true",
                    help="time OffloadWorkerCore.submit as the connectors call it (plan + enqueue in one, the "
                         "common transfer planned inline): all of it under enqueue, plan 0")
    a = ap.parse_args()
    run(_names(a.shapes), tuple(int(b) for b in _names(a.blocks)), a.bpc, a.reps, a.warmup,
        tuple(_names(a.hosts)), tuple(_names(a.modes)), a.native_dir, a.json, a.baseline_tree, fused=a.fused)


if __name__ == "__main__":
    main()
