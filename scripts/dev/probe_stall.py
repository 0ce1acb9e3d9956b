#!/usr/bin/env python3
"""Do stores delay model kernels enqueued after them? See benchmarks/stall.py."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.stall import main  # noqa: E402

sys.exit(main())
