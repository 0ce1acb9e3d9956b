"""The processes behind a local server: its listening pid, its process tree, their I/O counters."""

from __future__ import annotations

import os


def tree_pids(root: int) -> list[int]:
    """``root`` and every descendant (from /proc's parent links)."""
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                kids.setdefault(ppid, []).append(int(d))
            except (OSError, ValueError, IndexError):
                continue
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += kids.get(p, [])
    return out


def listening_pid(url: str) -> int:
    """The pid of the process listening on ``url``'s port (the API server; the engine is its child)."""
    port = int(url.rsplit(":", 1)[1])
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            for line in open(table).read().splitlines()[1:]:
                f = line.split()
                if int(f[1].rsplit(":", 1)[1], 16) == port and f[3] == "0A":
                    inodes.add(f[9])
        except OSError:
            continue
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            for fd in os.listdir(f"/proc/{d}/fd"):
                link = os.readlink(f"/proc/{d}/fd/{fd}")
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    return int(d)
        except OSError:
            continue
    raise RuntimeError(f"no process listens on port {port}")


def io_bytes(pids: list[int]) -> dict[str, int]:
    """Bytes the processes read from and wrote to storage (/proc/PID/io read_bytes / write_bytes)."""
    out = {"read_bytes": 0, "write_bytes": 0}
    for p in pids:
        try:
            with open(f"/proc/{p}/io") as f:
                for line in f:
                    k, _, v = line.partition(":")
                    if k in out:
                        out[k] += int(v)
        except OSError:
            continue
    return out


__all__ = ["io_bytes", "listening_pid", "tree_pids"]
