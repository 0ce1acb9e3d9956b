"""The device calls of a full GPU yardstick, in order, with their expected wall time and priority.

``scripts/dev/gpu_e2e.sh prepare`` prints them (``python -m benchmarks.gpu_e2e.plan --parts N``);
docs/gpu_e2e.md explains them. Every call stays under the 10-minute limit: the estimates are for
an H200 in vLLM's default mode, and ``--budget-s`` (540 s) skips whatever would end later (what
ran is written to $OUT and comes back). Priorities: 1 = staging with the uniform layout's
correctness beside LMCache's, the smoke of every layout and the disk tier at the capacity load beside
host-only and vLLM's fs tier (about 18 minutes on the GPU); 2 = LMCache + disk at the capacity load,
the capacity bound (host KV for everything) beside ours + disk and vLLM's fs tier,
LMCache's reload TTFT on a later turn's shape, LMCache at 8 clients, the Mooncake and disk pairs,
the reliability part, the disk tier's no-reuse cost and the host tier's yardstick: correctness of every
layout, serving at 8 and 32 clients, reload TTFT and the no-reuse cost, the Gemma-2 and MLA layouts;
3 = the shorter pair and the Simple connectors. On two GPUs (``--tp 2``) the TP 2 disk run is
second after the stage calls.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class Call:
    what: str
    args: str  # gpu_e2e.sh run ARGS ("" for a stage-only call)
    est_s: int  # expected wall time of the command (H200, default mode, warm compile cache where noted)
    priority: int
    env: str = ""  # variables before the command (VAR=VAL ...)


# After the stage calls. The smoke comes first: it finds GPU-only failures of every new config in
# two short calls. est_s: engine/server starts in default mode ~60-120 s per wave (torch.compile +
# CUDA-graph capture; the second wave loads the first's compiled graphs), passes ~15-20 s per server.
RUNS = (
    # --budget-s: this one runs after install in the same call. LMCache beside ours (docs/benchmarks.md
    # section 10): float32, the whole-prompt check (LMCache fails it) and bfloat16 against native
    Call("LMCache: correctness (float32 against off, the whole-prompt check over scrubbed device KV, "
         "bfloat16 against native)", "correctness --layouts uniform --lmcache --budget-s 420", 200, 1),
    Call("smoke: every layout's engines start (4 layers), store, reset, reload", "smoke --layouts all --budget-s 420",
         240, 1),
    # the tiers (docs/benchmarks.md sections 7-9): a disk-heavy call starts on an emptied disk folder
    Call("the disk tier at the capacity load: ours host-only, ours + disk, vLLM's fs tier, 2 passes each",
         "serve --layouts uniform --loads cap --servers ours,ours-disk,native-fs --passes 2 --budget-s 555", 470, 1),
    # runs M (one H100, 2026-12-06, 461 s) and L (one H200; the install in its call cut LMCache's third pass)
    Call("LMCache + disk against ours + disk at the capacity load, 3 passes",
         "serve --layouts uniform --loads cap --servers ours-disk,lmcache-disk --passes 3 --budget-s 555", 530, 2),
    # the capacity bound of issue #51's load, ours with host KV for every conversation of a pass, beside
    # ours + disk and vLLM's fs tier (run U, one H100, 2026-12-06: 380 s; four servers do not fit an H100)
    Call("the capacity bound (ours with host KV for every conversation) beside ours + disk and vLLM's fs tier, "
         "3 paired passes",
         "serve --layouts uniform --loads cap --servers ours-disk,native-fs,ours/allhost --passes 3 --budget-s 580",
         420, 2),
    # LMCache loads nothing for a prompt it holds whole (section 10): a later turn's shape, the stored
    # prompt plus 256 new tokens, is what it does load. --no-off: four engines do not fit an H100
    Call("LMCache: reload TTFT at 8k / 32k stored + 256 new tokens, beside native and ours",
         "ttft --layouts uniform --lmcache --no-off --ttft-lengths 8192,32768 --ttft-suffix 256 --budget-s 420",
         230, 2),
    Call("LMCache: serving, 8 clients, 3 passes beside ours and native",
         "serve --layouts uniform --loads 8 --servers lmcache,ours,native --passes 3 --budget-s 540", 370, 2),
    Call("two instances behind a round-robin router at the capacity load: host-only vs the Mooncake tier, its "
         "master killed mid-pass", "pair --pair-load cap --passes 2 --budget-s 500", 420, 2),
    # both servers of the disk pair on one folder: a turn finds the other server's earlier turns there.
    # On an H100 four servers do not fit: one pair after the other (2026-12-06: 187 + 66 s of starts, 4
    # passes of 44-57 s, over two calls)
    Call("two instances behind a round-robin router at the capacity load: host-only vs the disk tier on one "
         "shared folder", "pair --pairs host,disk --pair-load cap --passes 2 --no-pair-outage --budget-s 540",
         480, 2),
    Call("reliability: faults on, a soak, kill -9 under load and a restart on a 10 GiB disk budget",
         "reliability --layouts uniform --budget-s 540", 460, 2, env=f"GPU_E2E_DISK_BYTES={10 << 30}"),
    Call("the disk tier's and LMCache's cost when nothing is reused: off, ours, ours + disk, LMCache (miss rounds)",
         "miss --layouts uniform --disk --no-native --lmcache --miss-reps 10 --miss-batch 32 --budget-s 500", 260, 2),
    Call("smoke-serve (vLLM's client, 1 tiny pass, 8 server configs) + correctness of all layouts",
         "smoke-serve correctness --layouts all", 480, 2),
    Call("serving, 8 clients: uniform and per-layer native/ours, off, upper bound",
         "serve --layouts uniform --loads 8 --servers off,native,ours,perlayer:native,perlayer:ours,upper", 480, 2),
    Call("serving, 32 clients: uniform", "serve --layouts uniform --loads 32 --servers off,native,ours,upper", 420, 2),
    Call("uniform: reload TTFT 2k/8k/32k and the no-reuse cost (miss rounds)", "ttft miss --layouts uniform --miss-reps 10",
         500, 2),
    Call("serving, 32 clients: per-layer (Ascend's layout)",
         "serve --layouts perlayer --loads 32 --servers off,native,ours,uniform:native", 420, 2),
    Call("per-layer and MLA: reload TTFT", "ttft --layouts perlayer,mla", 450, 2),
    Call("multigroup (Gemma-2 shape): reload TTFT", "ttft --layouts multigroup", 330, 2),
    Call("serving, multigroup, 8 clients", "serve --layouts multigroup --loads 8", 380, 2),
    # Gemma-2's KV is 2.6x the 8B's per token: at 32 clients three servers do not fit one H200
    Call("serving, multigroup, 32 clients (native and ours only)",
         "serve --layouts multigroup --loads 32 --servers native,ours", 330, 2),
    Call("serving, MLA, 8 clients", "serve --layouts mla --loads 8", 330, 2),
    Call("serving, MLA, 32 clients", "serve --layouts mla --loads 32", 360, 2),
    Call("two instances behind a round-robin router, shorter conversations: host-only vs the Mooncake tier",
         "pair --passes 2", 480, 3),
    Call("serving, 8 clients: Simple connectors (ours, vLLM's)",
         "serve --layouts uniform --loads 8 --servers off,native,simple,vsimple", 400, 3),
    Call("serving, 32 clients: Simple connectors", "serve --layouts uniform --loads 32 --servers off,native,simple,vsimple",
         420, 3),
)
# Issue #24, on two GPUs of one host (kind nvidia-h200-x2; ask `status` first): every engine and server
# with tensor_parallel_size 2 (NCCL; the image's NVLink-multicast-off variables stay set). The H200 x2
# machine's memory starts at ~31 GiB and grows as it is used (KINDS.md): --grow-host-gib touches memory
# before the plan and our start-up check read it.
# Estimates from the first run (2 x H200, 2026-11-27): correctness 165 s, ttft 179 s, serve 483 s.
TP_RUNS = (
    Call("TP 2: correctness (fp32 = off, bf16 ours = native, negative control on every rank) + per-rank host "
         "bytes and NUMA of host KV vs GPU", "correctness --layouts uniform --tp 2 --budget-s 420", 180, 1),
    # issue #51's TP 2 run: each rank writes its own records (the serve table lists them by rank)
    Call("TP 2: the disk tier at the capacity load, ours host-only and ours + disk, each rank's records",
         "serve --layouts uniform --loads cap --tp 2 --servers ours,ours-disk --passes 2 --grow-host-gib 128 "
         "--budget-s 540", 500, 1),
    Call("TP 2: reload TTFT at 8k/32k, native vs ours", "ttft --layouts uniform --tp 2 --ttft-lengths 8192,32768 "
         "--grow-host-gib 64", 200, 1),
    Call("TP 2: serving, 8 clients, both connectors beside native", "serve --layouts uniform --loads 8 --tp 2 "
         "--servers off,native,ours,simple --grow-host-gib 128", 490, 1),
    # Ascend's layout (per-layer K/V pages), where one GPU measured ours ahead of native (issue #22)
    Call("TP 2: reload TTFT at 8k/32k, per-layer layout", "ttft --layouts perlayer --tp 2 --ttft-lengths 8192,32768 "
         "--grow-host-gib 64", 200, 2),
    Call("TP 2: serving, 32 clients, per-layer layout, native vs ours", "serve --layouts perlayer --loads 32 --tp 2 "
         "--servers native,ours --grow-host-gib 128", 490, 2),
)
STAGE_S = 20  # copying one part into /tmp (the machine's start is extra)
INSTALL_S = 90  # unpack ~100 MB xz, pip-install the wheels, build the CUDA copy library


def calls(parts: int, rel: str = ".gpu", max_priority: int = 3, tp: int = 1) -> list[dict]:
    """Every device call: the stage calls (the last also installs and runs the first run), then the
    rest of RUNS (one GPU) or TP_RUNS (``tp`` > 1, issue #24)."""
    s = f"bash {rel}/e2e_src/scripts/dev/gpu_e2e.sh"
    runs = RUNS if tp <= 1 else tuple(Call(c.what, c.args.replace("--tp 2", f"--tp {tp}"), c.est_s, c.priority)
                                      for c in TP_RUNS)
    out = []
    for i in range(1, parts + 1):
        cmd, est, what = f"{s} stage {rel}/part{i}", STAGE_S, f"stage part {i} of {parts}"
        if i == parts:
            cmd += f" && {s} install && {s} run {runs[0].args}"
            est += INSTALL_S + runs[0].est_s
            what += f" + install + {runs[0].what}"
        out.append({"what": what, "carry": [f"{rel}/part{i}", f"{rel}/e2e_src"], "command": cmd, "est_s": est,
                    "priority": 1})
    for c in runs[1:]:
        if c.priority <= max_priority:
            out.append({"what": c.what, "carry": [f"{rel}/e2e_src"],
                        "command": f"{c.env + ' ' if c.env else ''}{s} run {c.args}", "est_s": c.est_s,
                        "priority": c.priority})
    return out


def render(cs: list[dict]) -> str:
    lines, total = [], {1: 0, 2: 0, 3: 0}
    for n, c in enumerate(cs, 1):
        total[c["priority"]] += c["est_s"]
        lines.append(f"  step {n} (priority {c['priority']}, ~{c['est_s'] / 60:.1f} min): {c['what']}\n"
                     f"    carry {c['carry']}\n    command: {c['command']}")
    cum = 0
    sums = []
    for p in (1, 2, 3):
        cum += total[p]
        sums.append(f"priority <= {p}: ~{cum / 60:.0f} min")
    return "\n".join(lines) + "\n  expected device time (machine starts extra): " + ", ".join(sums)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gpu_e2e.plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", type=int, required=True)
    ap.add_argument("--rel", default=".gpu")
    ap.add_argument("--max-priority", type=int, default=3)
    ap.add_argument("--tp", type=int, default=1, help="the tensor-parallel calls (issue #24, kind nvidia-h200-x2)")
    a = ap.parse_args(argv)
    print(render(calls(a.parts, a.rel, a.max_priority, a.tp)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
