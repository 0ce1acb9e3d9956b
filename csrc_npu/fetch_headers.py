"""Fetch the ACL headers that the torch-npu wheel ships, for building without CANN.

There is no pip package with the CANN runtime, but torch-npu wheels carry
``torch_npu/include/acl/*.h``. This downloads one pinned wheel (``pip download
--no-deps``, never installed: torch-npu would break ``import torch`` through its
autoload hook) and unpacks only ``include/``. Used by CI and the tests:

    python csrc_npu/fetch_headers.py            # prints the include dir to use
    NPU_OFFLOAD_ACL_INCLUDE=$(python csrc_npu/fetch_headers.py) python csrc_npu/build.py
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

TORCH_NPU_VERSION = "2.13.0"  # acl_rt.h 1.17.0: declares aclrtMemcpyBatchAsync(V2), aclrtHostRegisterV2
# Pin the wheel's tags too, so every host (any Python, any arch) gets the same headers.
WHEEL_TAGS = ("--platform", "manylinux_2_28_x86_64", "--python-version", "3.11", "--only-binary=:all:")
INCLUDE_PREFIX = "torch_npu/include/"


def default_cache() -> Path:
    root = os.environ.get("NPU_OFFLOAD_HEADER_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "vllm-npu-offload"
    )
    return Path(root) / f"torch_npu-{TORCH_NPU_VERSION}"


def _pip_commands() -> list[list[str]]:
    """pip of this interpreter, then NPU_OFFLOAD_PIP, then pip on PATH (uv venvs have no pip)."""
    cmds = [[sys.executable, "-m", "pip"]]
    if os.environ.get("NPU_OFFLOAD_PIP"):
        cmds.insert(0, os.environ["NPU_OFFLOAD_PIP"].split())
    for name in ("pip3", "pip"):
        if shutil.which(name):
            cmds.append([shutil.which(name)])
    return cmds


def _download(dest: Path) -> Path:
    errors = []
    for pip in _pip_commands():
        cmd = [*pip, "download", "--no-deps", *WHEEL_TAGS, f"torch-npu=={TORCH_NPU_VERSION}", "-d", str(dest), "-q",
               "--timeout", "30", "--retries", "2"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(dest.glob(f"torch_npu-{TORCH_NPU_VERSION}-*.whl"))
        if r.returncode == 0 and wheels:
            return wheels[0]
        errors.append(f"{' '.join(cmd)}: rc={r.returncode} {r.stderr.strip()[-300:]}")
    raise RuntimeError("could not download the torch-npu wheel for its ACL headers:\n" + "\n".join(errors))


def fetch_headers(cache: Path | None = None) -> Path:
    """The include dir (containing ``acl/acl_rt.h``), downloading the wheel once per cache."""
    cache = Path(cache) if cache else default_cache()
    include = cache / INCLUDE_PREFIX
    if (include / "acl" / "acl_rt.h").exists():
        return include
    cache.mkdir(parents=True, exist_ok=True)
    wheel_dir = cache / "wheel"
    wheel_dir.mkdir(exist_ok=True)
    wheels = sorted(wheel_dir.glob(f"torch_npu-{TORCH_NPU_VERSION}-*.whl")) or [_download(wheel_dir)]
    tmp = cache / "extract.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    with zipfile.ZipFile(wheels[0]) as z:
        z.extractall(tmp, [n for n in z.namelist() if n.startswith(INCLUDE_PREFIX)])
    (cache / "torch_npu").mkdir(exist_ok=True)
    os.replace(tmp / INCLUDE_PREFIX, include)  # atomic: a half-extracted tree is never used
    shutil.rmtree(tmp, ignore_errors=True)
    if os.environ.get("NPU_OFFLOAD_KEEP_WHEEL") != "1":
        shutil.rmtree(wheel_dir, ignore_errors=True)
    if not (include / "acl" / "acl_rt.h").exists():
        raise RuntimeError(f"torch-npu {TORCH_NPU_VERSION} wheel has no {INCLUDE_PREFIX}acl/acl_rt.h")
    return include


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", type=Path, default=None, help=f"cache dir (default {default_cache()})")
    print(fetch_headers(ap.parse_args().cache))
