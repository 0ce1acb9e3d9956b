"""Soak a server with every tier on under the multi-turn client; see benchmarks/soak.py.

    $(bash scripts/setup_env.sh) scripts/soak.py --tiny --minutes 30 --json soak.json
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.soak import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
