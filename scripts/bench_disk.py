"""The disk tier's read/write rate against the disk's own O_DIRECT rate on a path.

    $(bash scripts/setup_env.sh) scripts/bench_disk.py --path /mnt/nvme --gib 2 --json out.json
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.disk_bench import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
