#!/usr/bin/env python3
"""Do stores delay model kernels enqueued after them? See vllm_npu_offload/bench/stall.py."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from vllm_npu_offload.bench.stall import main  # noqa: E402

sys.exit(main())
