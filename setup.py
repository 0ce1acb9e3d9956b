"""Build vllm-npu-offload.

The package is pure Python. Native batch-copy libraries are optional plain C-ABI shared
objects (loaded with ctypes, driver/ACL symbols resolved at run time), so they never
depend on torch's C++ ABI. Each backend's build step lives beside its sources
(``csrc_cuda/build.py``, ``csrc_npu/build.py``) and is skipped cleanly when its toolkit
is absent. Environment flags:

- ``NPU_OFFLOAD_BUILD_CUDA``  = 1 (required) | 0 (skip) | unset (build when nvcc/cuda.h exist)
- ``NPU_OFFLOAD_BUILD_NPU``   = 1 (required) | 0 (skip) | unset (build when ACL headers exist)
- ``VLLM_ASCEND_ENABLE_BATCH_MEMCPY`` = 1 (aclrtMemcpyBatchAsync) | 0 (per-copy loop) | unset (probe headers)
- ``NPU_OFFLOAD_CUDA_BATCH_MEMCPY``   = 1 (cuMemcpyBatchAsync) | 0 (per-copy loop) | unset (probe headers)
"""

from __future__ import annotations

import importlib.util
import os

from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
NATIVE_DIR = Path("vllm_npu_offload") / "_native"


def _load_builder(folder: str):
    path = ROOT / folder / "build.py"
    if not path.exists():
        return None
    spec = importlib.util.spec_from_file_location(f"_{folder}_build", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class BuildWithNative(build_py):
    """Build the pure-Python package, then each native backend whose toolkit is present."""

    def run(self):
        super().run()
        out_dir = Path(self.build_lib) / NATIVE_DIR
        out_dir.mkdir(parents=True, exist_ok=True)
        for folder, flag in (("csrc_cuda", "NPU_OFFLOAD_BUILD_CUDA"), ("csrc_npu", "NPU_OFFLOAD_BUILD_NPU")):
            mode = os.environ.get(flag, "").strip()
            if mode == "0":
                print(f"[vllm-npu-offload] {folder}: skipped ({flag}=0)")
                continue
            builder = _load_builder(folder)
            if builder is None:
                if mode == "1":
                    raise SystemExit(f"[vllm-npu-offload] {flag}=1 but {folder}/build.py is missing")
                continue
            try:
                built = builder.build(ROOT / folder, out_dir, required=(mode == "1"))
            except builder.ToolkitMissing as e:
                if mode == "1":
                    raise SystemExit(f"[vllm-npu-offload] {flag}=1 but {e}") from None
                print(f"[vllm-npu-offload] {folder}: skipped ({e})")
                continue
            print(f"[vllm-npu-offload] {folder}: built {built}")


setup(
    name="vllm-npu-offload",
    version="0.1.0",
    description="KV cache offload between accelerator and pinned host memory for vLLM / vLLM-Ascend",
    long_description=(ROOT / "README.md").read_text() if (ROOT / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["vllm_npu_offload", "vllm_npu_offload.*"]),
    package_data={"vllm_npu_offload": ["_native/*.so"]},
    install_requires=["numpy", "crc32c>=2.7"],
    extras_require={
        "test": ["pytest"],
        # The Mooncake Store tier (docs/mooncake_tier.md). TCP on any machine; on CUDA servers install
        # mooncake-transfer-engine-cuda13 instead, on Ascend mooncake-transfer-engine-npu (protocol ascend).
        # All need the system libraries libibverbs1 libnl-3-200 libnl-route-3-200 libnuma1 libcurl4.
        "mooncake": ["mooncake-transfer-engine-non-cuda==0.3.13.post1"],
    },
    cmdclass={"build_py": BuildWithNative},
    zip_safe=False,
)
