#!/usr/bin/env python3
"""Pool the passes of several GPU e2e serve runs: server A against server B, paired within each pass.

  python3 scripts/dev/pool_serve.py [--layout perlayer] [--clients 32] [--a ours] [--b native] \\
      [--from-pass N] [--json OUT.json] RUN1/serve.json.gz RUN2/serve.json ...

Prints a table per run and the pooled passes: req/s change (a / b - 1) and the later-turn TTFT and
TPOT p50 ratios (a / b), each as median (95% interval of the median), mean +- standard error, range,
and how many passes a was worse in. A run without both servers on that layout and load adds nothing.
``--from-pass 1`` leaves each run's first pass out (every server's first traffic: warm-up falls on the
server that goes first).
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.gpu_e2e.tables import pooled_serve_table, serve_pass_pairs  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("runs", nargs="+")
ap.add_argument("--layout", default="perlayer")
ap.add_argument("--clients", type=int, default=32)
ap.add_argument("--a", default="ours")
ap.add_argument("--b", default="native")
ap.add_argument("--from-pass", type=int, default=0, help="leave out each run's passes before this one")
ap.add_argument("--json", default="")
args = ap.parse_args()

groups = {}
for path in args.runs:
    passes = serve_pass_pairs(path, args.layout, args.clients, args.a, args.b, args.from_pass)
    if passes:
        groups[path] = passes
if not groups:
    sys.exit(f"no run has passes of both {args.a} and {args.b} on {args.layout} at {args.clients} clients")
groups[f"pooled ({len(groups)} runs)"] = [p for ps in list(groups.values()) for p in ps]
text, doc = pooled_serve_table(groups)
print(f"{args.a} against {args.b}, {args.layout}, {args.clients} clients, paired within each pass"
      + (f", passes from {args.from_pass}" if args.from_pass else ""))
print(text)
if args.json:
    Path(args.json).write_text(json.dumps({"a": args.a, "b": args.b, "layout": args.layout,
                                           "clients": args.clients, "from_pass": args.from_pass, "groups": doc,
                                           "passes": groups}, indent=1))
