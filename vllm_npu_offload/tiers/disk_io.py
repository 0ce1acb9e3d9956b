"""Records as files: one file per key and rank, one vectored syscall per read or write.

``<root>/<fingerprint>/<first two hex digits of the key>/<key hex>.r<rank>`` holds the 4 KiB header
and the chunk's bytes. A write goes to a private temporary name and is renamed into place, so a
reader (this server, another one sharing the path, or this one after a restart) sees a whole
record or none; a writer killed half-way leaves only a temporary file, which start-up removes.
Reads and writes use O_DIRECT where the filesystem takes it and the buffers are aligned (the page
cache would only hold a second copy of host KV), else ordinary I/O. Every call here blocks: they
run on the tier's I/O threads, with the GIL released inside each syscall.
"""

from __future__ import annotations

import errno
import mmap
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .contract import Failure
from .record import HEADER_BYTES, RecordError, check_header, checksum, pack_header

DIRECT_ALIGN = 4096
TMP_MARK = ".tmp."
# A temporary record is a live write while its writer runs: ``<record>.tmp.<host>.<pid>.<ns>``. At
# start-up only those of dead writers on this host go, and any older than this (another host's
# writer, or a pid taken again), never a write another server sharing the path has under way.
STALE_TMP_S = 600.0
_HOST = socket.gethostname().replace("/", "_") or "host"
_O_DIRECT = getattr(os, "O_DIRECT", 0)


class TierIOError(Exception):
    def __init__(self, failure: Failure, detail: str):
        super().__init__(detail)
        self.failure = failure


def failure_of(err: OSError) -> Failure:
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return Failure.NO_SPACE
    if err.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return Failure.READ_ONLY
    if err.errno == errno.ENOENT:
        return Failure.MISSING
    return Failure.IO_ERROR


def aligned(view: memoryview) -> bool:
    """Whether ``view`` (contiguous bytes) can take part in an O_DIRECT transfer."""
    addr = np.frombuffer(view, dtype=np.uint8).ctypes.data if view.nbytes else 0
    return addr % DIRECT_ALIGN == 0 and view.nbytes % DIRECT_ALIGN == 0


def key_hex(key: bytes) -> str:
    return key.hex()


@dataclass
class RecordFiles:
    """The files of one record identity under ``root``."""

    root: Path
    fingerprint: str
    direct: bool = True  # try O_DIRECT (switched off for good after the filesystem refuses it)

    @property
    def dir(self) -> Path:
        return self.root / self.fingerprint

    def path(self, key: bytes, rank: int) -> Path:
        h = key_hex(key)
        return self.dir / h[:2] / f"{h}.r{rank}"

    def _open(self, path: Path, flags: int, use_direct: bool) -> tuple[int, bool]:
        if use_direct and self.direct and _O_DIRECT:
            try:
                return os.open(path, flags | _O_DIRECT, 0o600), True
            except OSError as e:
                if e.errno != errno.EINVAL:  # EINVAL: this filesystem has no O_DIRECT (tmpfs)
                    raise
                self.direct = False
        return os.open(path, flags, 0o600), False

    def read_into(self, key: bytes, rank: int, world: int, dest: memoryview, header_buf: memoryview) -> int:
        """Read the record into ``dest`` (exactly its payload) and check it; returns bytes read."""
        path = self.path(key, rank)
        want = HEADER_BYTES + dest.nbytes
        try:
            fd, direct = self._open(path, os.O_RDONLY, aligned(dest))
        except OSError as e:
            raise TierIOError(failure_of(e), f"open {path}: {e.strerror}") from None
        try:
            size = os.fstat(fd).st_size
            if size != want:
                raise RecordError(Failure.CORRUPT, f"{path}: {size} bytes, a record of this identity has {want}")
            got = _preadv_all(fd, [header_buf, dest], direct)
        except OSError as e:
            raise TierIOError(failure_of(e), f"read {path}: {e.strerror}") from None
        finally:
            os.close(fd)
        if got != want:
            raise RecordError(Failure.CORRUPT, f"{path}: read {got} of {want} bytes")
        crc = check_header(header_buf, self.fingerprint, key, rank, world, dest.nbytes)
        if checksum(dest) != crc:
            raise RecordError(Failure.CORRUPT, f"{path}: payload checksum mismatch")
        return got

    def write_from(self, key: bytes, rank: int, world: int, src: memoryview, header_buf: memoryview) -> int:
        """Write the record from ``src``; returns the bytes written (0: a whole record was already there)."""
        path = self.path(key, rank)
        if path.exists():  # content-addressed: the same key and identity are the same bytes
            return 0
        crc = checksum(src)
        header_buf[:] = pack_header(self.fingerprint, key, rank, world, src.nbytes, crc)
        tmp = path.with_name(f"{path.name}{TMP_MARK}{_HOST}.{os.getpid()}.{time.monotonic_ns()}")
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd, direct = self._open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, aligned(src))
        except OSError as e:
            raise TierIOError(failure_of(e), f"create {tmp}: {e.strerror}") from None
        try:
            n = _pwritev_all(fd, [header_buf, src], direct)
            os.close(fd)
            fd = -1
            os.rename(tmp, path)
        except OSError as e:
            if fd >= 0:
                os.close(fd)
            _unlink_quiet(tmp)
            raise TierIOError(failure_of(e), f"write {path}: {e.strerror}") from None
        return n

    def remove(self, key: bytes, rank: int) -> bool:
        """Delete one record (one system call: the janitor deletes thousands); whether it was there."""
        try:
            os.unlink(self.path(key, rank))
            return True
        except OSError:
            return False


def _preadv_all(fd: int, bufs: list[memoryview], direct: bool) -> int:
    total, want, off = 0, sum(b.nbytes for b in bufs), 0
    while total < want:
        views = _rest(bufs, total)
        n = os.preadv(fd, views, off)
        if n <= 0:
            break
        total += n
        off += n
        if direct and n % DIRECT_ALIGN:
            break  # a short direct read ends only at EOF
    return total


def _pwritev_all(fd: int, bufs: list[memoryview], direct: bool) -> int:
    total, want = 0, sum(b.nbytes for b in bufs)
    while total < want:
        n = os.pwritev(fd, _rest(bufs, total), total)
        if n <= 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        total += n
    return total


def _rest(bufs: list[memoryview], skip: int) -> list[memoryview]:
    out = []
    for b in bufs:
        if skip >= b.nbytes:
            skip -= b.nbytes
            continue
        out.append(b[skip:])
        skip = 0
    return out


def _unlink_quiet(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def page_buffer(nbytes: int = HEADER_BYTES) -> memoryview:
    """An anonymous, page-aligned buffer (O_DIRECT needs aligned memory for the header too)."""
    return memoryview(mmap.mmap(-1, nbytes))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, another user's
        return True
    return True


def stale_temporary(name: str, age_s: float, host: str = _HOST) -> bool:
    """Whether a temporary record's writer is gone: a dead pid on this host, or older than STALE_TMP_S."""
    if age_s > STALE_TMP_S:
        return True
    parts = name.split(TMP_MARK, 1)[1].rsplit(".", 2)
    writer_host, pid = (parts[0], parts[1]) if len(parts) == 3 else (host, parts[0])
    if writer_host != host or not pid.isdigit():
        return False  # another host's writer: only its age says it is gone
    return not _pid_alive(int(pid))


def remove_stale_temporaries(directory: Path) -> int:
    """Delete the temporary files that killed writers left under ``directory`` (``stale_temporary``);
    returns how many. Another server's write under way on a shared path is left alone."""
    n = 0
    if not directory.is_dir():
        return 0
    now = time.time()
    for sub in directory.iterdir():
        if not sub.is_dir():
            continue
        for f in sub.iterdir():
            if TMP_MARK not in f.name:
                continue
            try:
                age = now - f.stat().st_mtime
            except OSError:
                continue
            if stale_temporary(f.name, age):
                _unlink_quiet(f)
                n += 1
    return n


def probe_rates(files: RecordFiles, nbytes: int = 64 << 20) -> tuple[float, float]:
    """(read, write) bytes/s of this path with the I/O the tier uses (O_DIRECT where taken), from
    one file of ``nbytes`` written, then read back past the page cache."""
    buf = page_buffer(nbytes)
    buf[:] = os.urandom(1024) * (nbytes // 1024)
    hdr = page_buffer()
    key = b"\0rate-probe\0" + os.urandom(8)
    t0 = time.perf_counter()
    files.write_from(key, 0, 1, buf, hdr)
    t1 = time.perf_counter()
    path = files.path(key, 0)
    if not files.direct:  # make the read come from the device, not the page cache
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    t2 = time.perf_counter()
    files.read_into(key, 0, 1, buf, hdr)
    t3 = time.perf_counter()
    files.remove(key, 0)
    return nbytes / max(t3 - t2, 1e-9), nbytes / max(t1 - t0, 1e-9)


__all__ = ["RecordFiles", "TierIOError", "failure_of", "page_buffer", "probe_rates", "remove_stale_temporaries"]
