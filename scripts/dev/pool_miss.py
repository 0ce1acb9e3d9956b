#!/usr/bin/env python3
"""Pool the rounds of several GPU e2e miss runs and print the paired cost table.

  python3 scripts/dev/pool_miss.py RUN1/miss.json.gz RUN2/gpu_e2e.log ...

Each argument is a run's miss.json (or .gz) or its log; rounds are paired within a run.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.gpu_e2e.tables import cost_split_table, load_miss_runs, pool_miss_runs, table  # noqa: E402

if len(sys.argv) < 2:
    sys.exit(__doc__)
runs = pool_miss_runs([load_miss_runs(a) for a in sys.argv[1:]])
print(table(["engine", "rounds"], [[k, len(v)] for k, v in runs.items()]))
print()
print(cost_split_table(runs) or "(no offload-off rounds in every run: nothing to compare)")
