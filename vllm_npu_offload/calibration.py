"""On-disk cache of copy-path measurements, shared by every calibrated choice.

Measurements (which copy path wins per page size; from how many blocks a staged
transfer beats a direct one) are taken once per GPU/NPU model and KV geometry and kept
in ``~/.cache/vllm_npu_offload/copy_calibration.json`` (``NPU_OFFLOAD_CACHE_DIR``
moves it); ``NPU_OFFLOAD_CALIBRATE=0`` skips measuring and uses heuristics instead.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Callable

from . import env

logger = logging.getLogger(__name__)

ENV_CALIBRATE = "NPU_OFFLOAD_CALIBRATE"
ENV_CACHE_DIR = "NPU_OFFLOAD_CACHE_DIR"
CACHE_FILE = "copy_calibration.json"

_MEMO: dict[str, dict] = {}


def enabled() -> bool:
    return env.get(ENV_CALIBRATE)


def cache_path() -> Path:
    root = env.get(ENV_CACHE_DIR)
    if not root:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vllm_npu_offload"
    return Path(root) / CACHE_FILE


def load_cache(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def store_cache(path: Path, key: str, entry: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = load_cache(path)
        data[key] = entry
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, path)  # atomic: concurrent workers never see a torn file
    except OSError as e:
        logger.warning("could not write calibration cache %s: %s", path, e)


def cached(key: str, measure: Callable[[], dict]) -> dict:
    """The entry for ``key``: from this process, else the cache file, else ``measure()`` (then stored)."""
    if key not in _MEMO:
        path = cache_path()
        entry = load_cache(path).get(key)
        if entry is None:
            entry = measure()
            store_cache(path, key, entry)
            logger.info("calibrated %s: %s", key, entry)
        _MEMO[key] = entry
    return _MEMO[key]
