#!/usr/bin/env python3
"""Whole staged transfers, A/B on one GPU machine (issue #22): ``probe_whole_split.py`` for each
variant in turn, ``--rounds`` times in alternating order, then medians per shape, direction and
variant of the critical path and of whole / spin / floor % of one contiguous copy.

A variant is ``LABEL=TREE`` or ``LABEL=TREE:VAR=VAL,VAR=VAL``: a checkout (its own library is
built into it first) and the environment its probe runs with. E.g., on the device, with this
the code in the repository root and an older tree carried as ``.gpu/base``:

    python3 scripts/dev/ab_whole.py --out $OUT/ab base=.gpu/base new=. \\
        inl=.:NPU_OFFLOAD_STAGE_LOAD_INLINE_IDS=1

Machines of one kind differ by up to 1.8x in the engine's Python, so only variants
measured in one run compare. Writes ``summary.json`` and the probe's
own tables and JSON under ``--out`` (tar them: the device returns few files), prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics as st
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from vllm_npu_offload.numa import parse_cpulist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_front_end_cuda import build  # noqa: E402
SHAPES = "qwen2.5-0.5b-fp8@172,qwen2.5-0.5b@86,llama-70b-tp8@26"  # 2 and 4 KiB pages, 16.1-16.2 MiB


def parse_variant(text: str) -> tuple[str, Path, dict[str, str]]:
    """``LABEL=TREE[:VAR=VAL,...]`` -> (label, tree, env)."""
    label, sep, rest = text.partition("=")
    if not sep or not label or not rest:
        raise SystemExit(f"variant {text!r}: expected LABEL=TREE or LABEL=TREE:VAR=VAL,...")
    tree, _, env_text = rest.partition(":")
    env = {}
    for item in filter(None, env_text.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"variant {text!r}: {item!r} is not VAR=VAL")
        env[key] = value
    path = Path(tree).resolve()
    if not (path / "scripts" / "dev" / "probe_whole_split.py").is_file():
        raise SystemExit(f"variant {label!r}: {path} has no scripts/dev/probe_whole_split.py")
    return label, path, env


def parse_cpus(text: str | None) -> set[int] | None:
    """``--cpus`` ("4" or "4,5" or "4-7") -> the CPUs every probe runs on (None: the parent's). On the
    2 x H200 host of 2026-11-27 unpinned rounds were bimodal: the Python before the native call took
    13-15 us in some rounds and 27-31 us in others, for both trees alike (docs/benchmarks.md,
   ), which hides a 1-2 us change."""
    if not text:
        return None
    cpus: set[int] = set()
    for part in text.split(","):  # sysfs cpulist syntax, read by the package's own parser part by part
        try:
            if not part:  # the sysfs reader skips empty parts; a typed list must not have any
                raise ValueError(part)
            cpus |= parse_cpulist(part)
        except ValueError:
            raise SystemExit(f"--cpus {text!r}: {part!r} is not a CPU number or a range A-B") from None
    allowed = os.sched_getaffinity(0)
    if not cpus or not cpus <= allowed:
        raise SystemExit(f"--cpus {text!r}: CPUs {sorted(cpus - allowed) or text} are not among this process's "
                         f"{sorted(allowed)}")
    return cpus


def run_probe(cmd: list[str], cpus: set[int] | None, **kw) -> subprocess.CompletedProcess:
    """``subprocess.run`` with the child pinned to ``cpus`` before it starts (its threads inherit it)."""
    pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    return subprocess.run(cmd, preexec_fn=pin, **kw)


def summarize(runs: dict[str, list[dict]]) -> dict:
    """Per (shape, direction, variant): medians over the variant's runs (us, %) and the % ranges."""
    out: dict = {}
    for label, docs in runs.items():
        for doc in docs:
            for shape, dirs in doc["shapes"].items():
                for d, r in dirs.items():
                    out.setdefault(f"{shape} {d}", {}).setdefault(label, []).append(r)
    table = {}
    for key, by_label in out.items():
        table[key] = {}
        for label, rows in by_label.items():
            pct = {name: [100 * r[a] / r[b] for r in rows] for name, (a, b) in
                   {"whole%": ("ref", "whole"), "spin%": ("ref_spin", "spin"), "floor%": ("ref", "floor")}.items()}
            row = {k: st.median(r[k] for r in rows) for k in ("plan", "pre_native", "finish")}
            row["critical"] = row["plan"] + row["pre_native"] + row["finish"]
            row.update({k: st.median(v) for k, v in pct.items()})
            row.update({f"{k} range": [min(v), max(v)] for k, v in pct.items()})
            row["runs"] = len(rows)
            table[key][label] = row
    return table


TARGET = 90.0  # issue #22: every whole transfer of 16 MB or more at 90% of one contiguous copy


def at_target(table: dict, target: float = TARGET) -> dict[str, dict]:
    """Per variant: the rows (shape, direction) whose median whole % reaches ``target``, of how many,
    and the lowest row (the target holds for every row or not at all)."""
    out: dict[str, dict] = {}
    for key, by_label in table.items():
        for label, row in by_label.items():
            v = out.setdefault(label, {"rows": 0, "at": 0, "lowest": None})
            v["rows"] += 1
            v["at"] += row["whole%"] >= target
            if v["lowest"] is None or row["whole%"] < v["lowest"][1]:
                v["lowest"] = [key, row["whole%"]]
    return out


def paired(runs: dict[str, list[dict]]) -> dict:
    """Per variant after the first: its critical path over the first variant's, and its whole % less
    the first's, round by round and row by row (the same round ran the two within seconds of each
    other: the host moves by up to 2x between rounds, so pairs compare where medians of rounds may
    not); median and range over every (round, shape, direction)."""
    labels = list(runs)
    base = runs[labels[0]]
    out = {}
    for label in labels[1:]:
        ratio, points = [], []
        for b_doc, doc in zip(base, runs[label]):
            for shape, dirs in b_doc["shapes"].items():
                for d, b in dirs.items():
                    r = doc["shapes"][shape][d]
                    crit = [x["plan"] + x["pre_native"] + x["finish"] for x in (b, r)]
                    ratio.append(crit[1] / crit[0])
                    points.append(100 * r["ref"] / r["whole"] - 100 * b["ref"] / b["whole"])
        out[label] = {"critical_ratio": [min(ratio), st.median(ratio), max(ratio)],
                      "whole_points": [min(points), st.median(points), max(points)], "pairs": len(ratio)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("variants", nargs="+", help="LABEL=TREE[:VAR=VAL,...]")
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--cpus", default=None, help="run every probe on these CPUs (\"4\", \"4,5\", \"4-7\"): "
                    "steadier rounds on a host whose Python speed moves between rounds")
    a = ap.parse_args()
    cpus = parse_cpus(a.cpus)
    variants = [parse_variant(v) for v in a.variants]
    if len({v[0] for v in variants}) != len(variants):
        raise SystemExit("variant labels must differ")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for tree in sorted({v[1] for v in variants}):
        build(tree, tree / "vllm_npu_offload" / "_native")  # each tree's own library, into its package
    runs: dict[str, list[dict]] = {v[0]: [] for v in variants}
    for rnd in range(a.rounds):
        for label, tree, env in (variants if rnd % 2 == 0 else variants[::-1]):
            js, txt = out / f"{label}{rnd}.json", out / f"{label}{rnd}.txt"
            cmd = [sys.executable, str(tree / "scripts" / "dev" / "probe_whole_split.py"), "--reps", str(a.reps),
                   "--detail", "", "--shapes", a.shapes, "--json", str(js)]
            run_env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]),
                           **env)
            with open(txt, "w") as f:
                r = run_probe(cmd, cpus, cwd=tree, env=run_env, stdout=f, stderr=subprocess.STDOUT)
            if r.returncode:
                raise SystemExit(f"{label} round {rnd} failed (rc {r.returncode}): {txt}")
            runs[label].append(json.loads(js.read_text()))
    table = summarize(runs)
    pairs = paired(runs)
    targets = at_target(table)
    (out / "summary.json").write_text(json.dumps({"variants": a.variants, "rounds": a.rounds,
                                                  "cpus": sorted(cpus) if cpus else None, "table": table,
                                                  "paired": pairs, "at_target": targets}, indent=1))
    cols = ("plan", "pre_native", "finish", "critical", "whole%", "spin%", "floor%")
    print(f"medians of {a.rounds} rounds, us and % of one contiguous copy"
          + (f"; probes pinned to CPUs {sorted(cpus)}" if cpus else ""))
    print(f"{'shape dir':28s} {'variant':8s}" + "".join(f"{c:>11s}" for c in cols))
    for key, by_label in table.items():
        for label, row in by_label.items():
            print(f"{key:28s} {label:8s}" + "".join(f"{row[c]:11.1f}" for c in cols))
    first = variants[0][0]
    for label, p in pairs.items():
        c, w = p["critical_ratio"], p["whole_points"]
        print(f"{label} against {first}, paired by round ({p['pairs']} pairs): critical path {c[1]:.2f}x "
              f"({c[0]:.2f}-{c[2]:.2f}), whole {w[1]:+.1f} points ({w[0]:+.1f}..{w[2]:+.1f})")
    for label, t in targets.items():
        print(f"{label}: {t['at']} of {t['rows']} rows at {TARGET:.0f}% or more by median; lowest "
              f"{t['lowest'][0]} {t['lowest'][1]:.1f}%")


if __name__ == "__main__":
    main()
