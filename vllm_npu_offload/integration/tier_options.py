"""The disk tier's ``kv_connector_extra_config`` keys (``NPUOffloadingSpec``), checked at start-up.

- ``disk_path``: a directory for KV records (created owner-only if missing); the tier is off without it.
- ``disk_bytes_to_use``: the records' byte budget, all tensor-parallel ranks together (required).
- ``disk_admit``: ``all`` (default: every key stored to host is written) or ``reuse`` (a key is
  written once a request hits it again while it is still in host: less written, but a conversation
  whose next turn comes after its KV left host is never on disk).
- ``disk_read_timeout_s``: a read not done by then is a miss for its request (default 5).
- ``disk_read_queue_s``: the cost rule on a busy server: a read starts while the disk's queue of
  reads drains within this many seconds (default 1; below the deadline). A request waits about
  this long at most for its prefix from disk while the accelerator serves the others; what the
  queue cannot take is recomputed.
- ``disk_prefill_tokens_per_s``: the accelerator's prefill rate; when set, a read also starts only
  if the disk delivers the key sooner than this rate recomputes its tokens (0, default: off).
- ``disk_rescan_s``: how often records other servers wrote are picked up (default 10; 0: at
  start-up only).

The Mooncake Store tier's keys (``mooncake_*``, ``tiers/mooncake_store.py``) and ``tier_order``: the
order in which lower tiers are asked for a key the host does not hold (default disk, then
mooncake: a local disk needs no network round trip).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Mapping

from ..errors import OffloadConfigError
from ..tiers.mooncake_store import MooncakeConfig
from .options import _positive_int

logger = logging.getLogger(__name__)

DISK_KEYS = ("disk_path", "disk_bytes_to_use", "disk_admit", "disk_read_timeout_s", "disk_read_queue_s",
             "disk_prefill_tokens_per_s", "disk_rescan_s")
ADMIT_POLICIES = ("all", "reuse")
MOONCAKE_KEYS = tuple(f"mooncake_{f}" for f in MooncakeConfig.__dataclass_fields__)
TIER_KEYS = DISK_KEYS + MOONCAKE_KEYS + ("tier_order",)
TIER_NAMES = ("disk", "mooncake")


@dataclass(frozen=True)
class DiskOptions:
    path: str
    budget_bytes: int
    admit: str = "all"
    read_timeout_s: float = 5.0
    read_queue_s: float = 1.0
    prefill_tokens_per_s: float = 0.0
    rescan_s: float = 10.0


def _number(extra: Mapping[str, Any], key: str, default: float, positive: bool) -> float:
    if key not in extra:
        return default
    raw = extra[key]
    ok = isinstance(raw, (int, float)) and not isinstance(raw, bool) and (raw > 0 if positive else raw >= 0)
    if not ok:
        need = "a number > 0" if positive else "a number >= 0"
        raise OffloadConfigError(f"kv_connector_extra_config[{key!r}]={raw!r} must be {need}")
    return float(raw)


def disk_options(extra: Mapping[str, Any]) -> DiskOptions | None:
    """The disk tier's settings, or None when ``disk_path`` is not set (then no other disk key may be)."""
    path = extra.get("disk_path")
    if path is None:
        stray = [k for k in DISK_KEYS if k in extra]
        if stray:
            raise OffloadConfigError(f"kv_connector_extra_config sets {stray} but not 'disk_path': the disk tier "
                                     "needs a directory")
        return None
    if not isinstance(path, str) or not path.strip():
        raise OffloadConfigError(f"kv_connector_extra_config['disk_path']={path!r} must be a directory path")
    budget = _positive_int(extra, "disk_bytes_to_use")  # its error names the key
    if budget is None:
        raise OffloadConfigError(
            f"kv_connector_extra_config['disk_bytes_to_use']={budget!r}: with 'disk_path' set, give the disk "
            "tier's byte budget for all ranks together as a positive integer (e.g. 107374182400 for 100 GiB)"
        )
    admit = extra.get("disk_admit", "all")
    if admit not in ADMIT_POLICIES:
        raise OffloadConfigError(f"kv_connector_extra_config['disk_admit']={admit!r} must be one of {ADMIT_POLICIES}")
    timeout = _number(extra, "disk_read_timeout_s", 5.0, positive=True)
    queue_s = _number(extra, "disk_read_queue_s", min(1.0, timeout / 2), positive=True)
    if queue_s >= timeout:
        raise OffloadConfigError(
            f"kv_connector_extra_config['disk_read_queue_s']={extra['disk_read_queue_s']!r} must be below "
            f"'disk_read_timeout_s' ({timeout:g}): reads queued longer than the deadline would all be late")
    return DiskOptions(
        path=os.path.abspath(os.path.expanduser(path)),
        budget_bytes=budget,
        admit=admit,
        read_timeout_s=timeout,
        read_queue_s=queue_s,
        prefill_tokens_per_s=_number(extra, "disk_prefill_tokens_per_s", 0.0, positive=False),
        rescan_s=_number(extra, "disk_rescan_s", 10.0, positive=False),
    )


def mooncake_options(extra: Mapping[str, Any]) -> MooncakeConfig | None:
    """The Mooncake tier's settings, or None when ``mooncake_master`` is not set."""
    try:
        return MooncakeConfig.from_extra_config(extra)
    except ValueError as e:
        raise OffloadConfigError(f"kv_connector_extra_config: {e}") from None


def tier_order(extra: Mapping[str, Any], configured: list[str]) -> list[str]:
    """The configured lower tiers in the order a lookup asks them (``tier_order``)."""
    order = extra.get("tier_order", list(TIER_NAMES))
    if (not isinstance(order, (list, tuple)) or len(set(order)) != len(order)
            or any(o not in TIER_NAMES for o in order)):
        raise OffloadConfigError(f"kv_connector_extra_config['tier_order']={order!r} must list tiers of "
                                 f"{TIER_NAMES}, each once")
    missing = [t for t in configured if t not in order]
    if missing:
        raise OffloadConfigError(f"kv_connector_extra_config['tier_order']={order!r} leaves out the configured "
                                 f"tier(s) {missing}")
    return [t for t in order if t in configured]


def check_disk_path(opts: DiskOptions) -> bool:
    """Create the directory if needed; False if it exists but cannot be written (a read-only tier).
    A path that cannot be used at all is a start-up error naming the key."""
    try:
        os.makedirs(opts.path, mode=0o700, exist_ok=True)
    except OSError as e:
        raise OffloadConfigError(
            f"kv_connector_extra_config['disk_path']={opts.path!r} cannot be used: {e.strerror}"
        ) from None
    if not os.path.isdir(opts.path):
        raise OffloadConfigError(f"kv_connector_extra_config['disk_path']={opts.path!r} is not a directory")
    if not os.access(opts.path, os.R_OK | os.X_OK):
        raise OffloadConfigError(f"kv_connector_extra_config['disk_path']={opts.path!r} cannot be read")
    writable = os.access(opts.path, os.W_OK)
    if not writable:
        logger.warning("disk tier: %s is read-only; records there are served, none are written", opts.path)
    return writable


__all__ = ["DISK_KEYS", "DiskOptions", "MOONCAKE_KEYS", "TIER_KEYS", "check_disk_path", "disk_options",
           "mooncake_options", "tier_order"]
