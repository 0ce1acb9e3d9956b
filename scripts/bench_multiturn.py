#!/usr/bin/env python3
"""Multi-turn serving benchmark (KV offload off vs on). See docs/multiturn.md.

  python scripts/bench_multiturn.py compare --tiny                      # CPU, end to end, offline
  python scripts/bench_multiturn.py run --url http://127.0.0.1:8000    # one running server
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.multiturn.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
