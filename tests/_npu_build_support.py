"""Build helpers for the NPU tests: fetch torch-npu's ACL headers once, compile csrc_npu."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc_npu"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_csrc_npu_{name}", CSRC / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


build_mod = _load("build")
fetch_mod = _load("fetch_headers")


def acl_include() -> tuple[Path | None, str]:
    """Headers for the tests: $NPU_OFFLOAD_ACL_INCLUDE, else the fetched wheel headers (cached)."""
    explicit = os.environ.get("NPU_OFFLOAD_ACL_INCLUDE")
    if explicit and (Path(explicit) / "acl" / "acl_rt.h").exists():
        return Path(explicit), ""
    try:
        return fetch_mod.fetch_headers(), ""
    except Exception as e:  # no network / no pip: the tests skip with this reason
        return None, f"ACL headers unavailable (torch-npu {fetch_mod.TORCH_NPU_VERSION} wheel could not be fetched): {e}"


def build_into(out: Path, include: Path, toggle: str | None, env: dict | None = None) -> Path:
    """Compile libnpu_offload_acl.so with VLLM_ASCEND_ENABLE_BATCH_MEMCPY=toggle (None = unset)."""
    saved = {k: os.environ.get(k) for k in ("VLLM_ASCEND_ENABLE_BATCH_MEMCPY", "NPU_OFFLOAD_ACL_INCLUDE",
                                            "ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH")}
    try:
        for k in ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH", "VLLM_ASCEND_ENABLE_BATCH_MEMCPY"):
            os.environ.pop(k, None)
        os.environ["NPU_OFFLOAD_ACL_INCLUDE"] = str(include)
        if toggle is not None:
            os.environ["VLLM_ASCEND_ENABLE_BATCH_MEMCPY"] = toggle
        os.environ.update(env or {})
        build_mod.build(CSRC, out, required=True)
        return out / build_mod.LIBRARY
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
