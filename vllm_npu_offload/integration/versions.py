"""Which vLLM releases the adapters support, checked before anything imports vLLM's internals.

vLLM < 0.21 has no ``vllm.v1.kv_offload.base`` (the offloading API moved there in 0.21), so
importing our spec or connectors on it would fail deep inside an import chain; this module turns
that into one error naming the installed version and the supported range. It imports no vLLM
code itself (the caller passes the version), so it is testable anywhere.
"""

from __future__ import annotations

import logging
import re

logger = logging.getLogger(__name__)

OLDEST = (0, 21, 0)  # first with kv_offload/base.py (and the first vLLM-Ascend with SimpleCPUOffload)
NEWEST_TESTED = (0, 33, 0)  # the newest release scripts/dev/version_matrix.sh ran (docs/support.md)
SUPPORTED_RANGE = "vLLM >= 0.21.0 (tested 0.21.0 to 0.33.0; vLLM-Ascend 0.21.0rc1 and later)"


class UnsupportedVLLMVersion(RuntimeError):
    """The installed vLLM is outside the range the adapters support."""


def _release(version: str) -> tuple[int, int, int] | None:
    """(major, minor, micro) of a vLLM version string ('0.27.1+cpu', '0.34.0rc1.dev5+g1a2b'), or
    None when it is not a release number (a source checkout's 'dev', 'unknown')."""
    m = re.match(r"^v?(\d+)\.(\d+)(?:\.(\d+))?", version.strip())
    if m is None:
        return None
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def check_vllm_version(version: str) -> str:
    """Raise ``UnsupportedVLLMVersion`` for a vLLM older than ``OLDEST``; return ``"tested"``,
    ``"untested"`` (newer than the newest tested release, or not a release number: it may work,
    the API check in ``compat`` decides) for the others."""
    rel = _release(version)
    if rel is None or rel > NEWEST_TESTED[:2] + (10**6,):
        return "untested"
    if rel < OLDEST:
        raise UnsupportedVLLMVersion(
            f"vllm-npu-offload does not support the installed vLLM {version}: supported is {SUPPORTED_RANGE}. "
            f"vLLM before 0.21 has no vllm.v1.kv_offload.base, which the spec and both connectors build on; "
            f"install a supported vLLM (or the vLLM-Ascend release that pairs with one)"
        )
    return "tested"


def require_supported_vllm() -> None:
    """Check the installed vLLM (if any) once, before an adapter module imports its internals."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return  # the adapter's own 'import vllm...' says vLLM is missing
    import vllm

    version = str(getattr(vllm, "__version__", "unknown"))
    if check_vllm_version(version) == "untested":
        logger.warning(
            "vllm-npu-offload: vLLM %s is newer than the newest tested release (%s); supported is %s",
            version, ".".join(map(str, NEWEST_TESTED)), SUPPORTED_RANGE,
        )
