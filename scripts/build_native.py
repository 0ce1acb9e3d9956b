"""Build the native copy libraries in place (vllm_npu_offload/_native), as setup.py would.

Each backend is built when its toolkit is found and skipped otherwise, with the same
environment flags as setup.py (NPU_OFFLOAD_BUILD_CUDA / NPU_OFFLOAD_BUILD_NPU = 1|0|unset).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "vllm_npu_offload" / "_native"


def main() -> int:
    for folder, flag in (("csrc_cuda", "NPU_OFFLOAD_BUILD_CUDA"), ("csrc_npu", "NPU_OFFLOAD_BUILD_NPU")):
        mode = os.environ.get(flag, "").strip()
        if mode == "0":
            continue
        spec = importlib.util.spec_from_file_location(f"_{folder}_build", ROOT / folder / "build.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        try:
            built = mod.build(ROOT / folder, OUT, required=(mode == "1"))
            print(f"[build_native] {folder}: {built}")
        except mod.ToolkitMissing as e:
            if mode == "1":
                print(f"[build_native] {flag}=1 but {e}", file=sys.stderr)
                return 1
            print(f"[build_native] {folder}: skipped ({e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
