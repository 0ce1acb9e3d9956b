"""How much host memory this process may take and page-lock, checked before allocating.

Pure Python (no torch, no vLLM), Linux-aware, harmless elsewhere (every reader returns
``None`` when it cannot tell, and a check without a number passes):

- ``available_host_bytes()``: ``MemAvailable`` from ``/proc/meminfo``, lowered to what the
  process's memory cgroup still allows (v2 ``memory.max``, v1 ``memory.limit_in_bytes``; the
  cgroup and every parent). Reclaimable page cache (``inactive_file``) counts as free, as
  the kernel would reclaim it before the OOM killer runs.
- ``memlock_limit()``: the soft ``RLIMIT_MEMLOCK`` (``ulimit -l``), ``None`` if unlimited.
- ``check_host_allocation(nbytes, key, ...)``: ``OffloadConfigError`` naming the key, the
  bytes this rank would allocate and the bytes available, raised before torch's allocator
  fails with ``DefaultCPUAllocator: can't allocate memory`` (or the OOM killer steps in).
- ``pin_failure_hint(nbytes)``: the sentence to log when page-locking fails.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from pathlib import Path

from .errors import OffloadConfigError

PROC = Path("/proc")  # tests point these at fake trees
CGROUP = Path("/sys/fs/cgroup")

# cgroup v1 writes "no limit" as a huge page-rounded number (9223372036854771712).
_V1_UNLIMITED = 1 << 62


def fmt_bytes(n: int) -> str:
    """``10.0 TiB``, ``256.0 MiB``, ``512 B``."""
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(x) < 1024 or unit == "TiB":
            return f"{int(x)} B" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    raise AssertionError("unreachable")


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _stat_field(path: Path, name: str) -> int:
    try:
        for line in path.read_text().splitlines():
            k, _, v = line.partition(" ")
            if k == name:
                return int(v)
    except (OSError, ValueError):
        pass
    return 0


def meminfo_available() -> int | None:
    """``MemAvailable`` in bytes, or ``None`` (not Linux, or a kernel older than 3.14)."""
    try:
        for line in (PROC / "meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                parts = line.split()
                return int(parts[1]) * (1024 if len(parts) > 2 and parts[2] == "kB" else 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _own_cgroups() -> dict[str, str]:
    """``{"v2": path}`` and/or ``{"v1": path}`` of the memory cgroup, from ``/proc/self/cgroup``."""
    out: dict[str, str] = {}
    try:
        lines = (PROC / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hier == "0" and controllers == "":
            out["v2"] = path
        elif "memory" in controllers.split(","):
            out["v1"] = path
    return out


def _walk_up(root: Path, rel: str) -> list[Path]:
    """``root/rel`` and its parents up to ``root`` (or just ``root`` when ``rel`` is not mounted
    there, as inside a container that sees its own cgroup at the mount point)."""
    leaf = root / rel.lstrip("/")
    if not leaf.is_dir():
        return [root]
    dirs = [leaf]
    while dirs[-1] != root and root in dirs[-1].parents:
        dirs.append(dirs[-1].parent)
    return dirs


@dataclass(frozen=True)
class CgroupLimit:
    limit: int
    used: int  # usage minus reclaimable page cache
    where: str

    @property
    def free(self) -> int:
        return max(0, self.limit - self.used)


def cgroup_limit() -> CgroupLimit | None:
    """The tightest memory cgroup limit over this process's cgroup and its parents."""
    groups = _own_cgroups()
    found: list[CgroupLimit] = []
    if "v2" in groups:
        for d in _walk_up(CGROUP, groups["v2"]):
            try:
                raw = (d / "memory.max").read_text().strip()
            except OSError:
                continue
            if raw == "max":
                continue
            usage = _read_int(d / "memory.current") or 0
            used = usage - _stat_field(d / "memory.stat", "inactive_file")
            found.append(CgroupLimit(int(raw), max(0, used), f"cgroup v2 {d / 'memory.max'}"))
    if "v1" in groups and (CGROUP / "memory").is_dir():
        for d in _walk_up(CGROUP / "memory", groups["v1"]):
            limit = _read_int(d / "memory.limit_in_bytes")
            if limit is None or limit >= _V1_UNLIMITED:
                continue
            usage = _read_int(d / "memory.usage_in_bytes") or 0
            used = usage - _stat_field(d / "memory.stat", "total_inactive_file")
            found.append(CgroupLimit(limit, max(0, used), f"cgroup v1 {d / 'memory.limit_in_bytes'}"))
    return min(found, key=lambda c: c.free) if found else None


@dataclass(frozen=True)
class HostMemory:
    available: int
    source: str  # where the number comes from, for messages


def host_memory() -> HostMemory | None:
    """What this process can still allocate, and why; ``None`` if nothing could be read."""
    cands: list[HostMemory] = []
    avail = meminfo_available()
    if avail is not None:
        cands.append(HostMemory(avail, f"MemAvailable in {PROC / 'meminfo'}"))
    cg = cgroup_limit()
    if cg is not None:
        cands.append(HostMemory(cg.free, f"{cg.where} = {cg.limit} bytes, {cg.used} in use"))
    return min(cands, key=lambda m: m.available) if cands else None


def available_host_bytes() -> int | None:
    m = host_memory()
    return None if m is None else m.available


def memlock_limit() -> int | None:
    """Soft ``RLIMIT_MEMLOCK`` in bytes; ``None`` when unlimited (or unknown)."""
    try:
        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    except (AttributeError, ValueError, OSError):
        return None
    return None if soft == resource.RLIM_INFINITY else soft


def check_host_allocation(
    nbytes: int, key: str, value=None, detail: str = "", memory: HostMemory | None = None
) -> None:
    """Raise ``OffloadConfigError`` if ``nbytes`` of host memory cannot be had.

    ``key`` / ``value``: the setting that asked for it (``value`` None: not set, a default);
    ``detail``: how ``nbytes`` follows from it (e.g. this rank's share); ``memory``: for tests.
    """
    mem = memory if memory is not None else host_memory()
    if mem is None or nbytes <= mem.available:
        return
    setting = f"kv_connector_extra_config[{key!r}]" + (f"={value}" if value is not None else " (not set)")
    raise OffloadConfigError(
        f"{setting}: this rank would allocate {nbytes} bytes ({fmt_bytes(nbytes)}) of host memory"
        + (f" ({detail})" if detail else "")
        + f", but only {mem.available} bytes ({fmt_bytes(mem.available)}) are available ({mem.source}). "
        f"Lower {key!r} so that each rank's share fits, or free host memory."
    )


def pin_failure_hint(nbytes: int) -> str:
    """What to say when page-locking ``nbytes`` failed: the locked-memory limit and how to raise it."""
    limit = memlock_limit()
    head = f"could not page-lock {nbytes} host bytes ({fmt_bytes(nbytes)})"
    if limit is None:
        return (
            f"{head}; the locked-memory limit (RLIMIT_MEMLOCK) is unlimited, so the driver refused for "
            "another reason (too little free memory, or a container without IPC_LOCK)"
        )
    return (
        f"{head}; the locked-memory limit (RLIMIT_MEMLOCK, `ulimit -l`) of process {os.getpid()} is "
        f"{limit} bytes ({fmt_bytes(limit)}). Raise it for the process that runs vLLM: `ulimit -l unlimited` "
        "in its shell (needs a hard limit that allows it, /etc/security/limits.conf 'memlock'), "
        "LimitMEMLOCK=infinity in its systemd unit, or `docker run --ulimit memlock=-1:-1`"
    )


__all__ = [
    "CgroupLimit",
    "HostMemory",
    "available_host_bytes",
    "cgroup_limit",
    "check_host_allocation",
    "fmt_bytes",
    "host_memory",
    "meminfo_available",
    "memlock_limit",
    "pin_failure_hint",
]
