"""Resources of a server's process tree, sampled while it serves, and the rules that judge them.

Shared by the CPU soak (benchmarks/soak.py), the CPU kill -9 test and the GPU reliability part
(benchmarks/gpu_e2e/reliability.py): the same sample, the same flatness rule, the same notion of a
process that is gone.
"""

from __future__ import annotations

import os
from pathlib import Path

from vllm_npu_offload.tiers.disk_io import TMP_MARK  # in a record's name until its rename


def sample(pids: list[int], disk: Path | None) -> dict[str, float]:
    """RSS, locked (pinned) memory, threads and open files summed over ``pids``; /dev/shm entries; the
    disk tier's whole records and their MiB under ``disk`` (temporaries apart: ``disk_tmp``)."""
    s = {"rss_mib": 0.0, "locked_mib": 0.0, "threads": 0, "open_files": 0}
    for p in pids:
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    k, _, v = line.partition(":")
                    if k == "VmRSS":
                        s["rss_mib"] += int(v.split()[0]) / 1024
                    elif k == "VmLck":
                        s["locked_mib"] += int(v.split()[0]) / 1024
                    elif k == "Threads":
                        s["threads"] += int(v)
            s["open_files"] += len(os.listdir(f"/proc/{p}/fd"))
        except OSError:
            continue
    s["shm_entries"] = len(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else 0
    if disk is not None:
        n, tmp, size = 0, 0, 0
        for p, st in record_files(disk):
            if TMP_MARK in p.name:
                tmp += 1
            else:
                n += 1
                size += st.st_size
        s["disk_records"] = n
        s["disk_tmp"] = tmp
        s["disk_mib"] = size / 2**20
    return s


def record_files(disk: Path):
    """(path, stat) of the disk tier's record files under ``disk`` (none if it is not a folder),
    temporaries included; a file the janitor deletes meanwhile is left out."""
    for p in disk.rglob("*.r*") if disk.is_dir() else ():
        try:
            yield p, p.stat()
        except OSError:
            continue


def flat(series: list[float], warm: int, slack: float) -> bool:
    """After ``warm`` samples, the last third's maximum within ``slack`` (+1) of the first third's."""
    rest = series[warm:]
    if len(rest) < 3:
        return True
    third = max(1, len(rest) // 3)
    first, last = max(rest[:third]), max(rest[-third:])
    return last <= first * (1 + slack) + 1


def disk_within_budget(samples: list[dict], budget_bytes: int) -> bool:
    """Every sample's records within the disk tier's budget (headers add 4 KiB per record)."""
    return all(s["disk_mib"] * 2**20 <= budget_bytes + 4096 * s["disk_records"] for s in samples)


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its parent to reap it counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def records_since(disk: Path, since: float) -> dict[str, int]:
    """The disk tier's whole records under ``disk`` last written at or after ``since`` (wall clock, as a
    file's mtime): path relative to ``disk`` -> bytes."""
    return {str(p.relative_to(disk)): st.st_size for p, st in record_files(disk)
            if TMP_MARK not in p.name and st.st_mtime >= since}


def written_since(disk: Path, since: float) -> int:
    """Bytes of records written at or after ``since``: what a pass has written so far, also where
    evictions keep the folder's size flat at its budget."""
    return sum(records_since(disk, since).values())


def temporaries(disk: Path) -> list[str]:
    """Names of the disk tier's temporaries (records being written) under ``disk``."""
    return sorted(p.name for p in disk.rglob("*") if TMP_MARK in p.name) if disk.is_dir() else []


__all__ = ["alive", "disk_within_budget", "flat", "records_since", "sample", "temporaries", "written_since"]
