"""The line between the scheduler's tier manager and each rank's tier worker.

Host KV lives in each rank's worker process (a private, pinned, exact-size buffer), while the
decisions about a lower tier are the scheduler's. They talk over a Unix socket per rank, named after
the engine's id and the tier's path, so it needs no help from vLLM (whose tier contract changes
with every release) and works whether the worker runs in the scheduler's process or in its own.
Messages are the small dataclasses of ``contract.py``, pickled by ``multiprocessing.connection``.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from multiprocessing.connection import Client, Connection, Listener


SOCKET_PREFIX, SOCKET_SUFFIX = "npu-kv-", ".sock"


def socket_dir() -> str:
    """Where the tier workers' sockets are: XDG_RUNTIME_DIR, else the temporary folder."""
    return os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()


def socket_path(engine_id: str, root: str, rank: int) -> str:
    """The socket of ``rank``'s tier worker (short enough for AF_UNIX's 108 bytes)."""
    tag = hashlib.sha256(f"{engine_id}\0{os.path.realpath(root)}".encode()).hexdigest()[:20]
    return os.path.join(socket_dir(), f"{SOCKET_PREFIX}{tag}-r{rank}{SOCKET_SUFFIX}")


def tier_sockets(directory: str | None = None) -> set[str]:
    """The socket files of tier workers in ``directory`` (default ``socket_dir()``), live or left behind."""
    directory = socket_dir() if directory is None else directory
    try:
        names = os.listdir(directory)
    except OSError:
        return set()
    return {os.path.join(directory, n) for n in names if n.startswith(SOCKET_PREFIX) and n.endswith(SOCKET_SUFFIX)}


def bound_sockets() -> set[str] | None:
    """Paths of the Unix sockets some process has bound (Linux's /proc/net/unix); None elsewhere."""
    try:
        with open("/proc/net/unix") as f:
            next(f, None)
            return {parts[7] for line in f if len(parts := line.split()) >= 8}
    except OSError:
        return None


def remove_stale_sockets(directory: str) -> list[str]:
    """Remove this package's socket files in ``directory`` that no process has bound any more: what
    a server killed with SIGKILL leaves (its name has an engine id no later server uses again)."""
    bound = bound_sockets()
    if bound is None:
        return []
    gone = []
    for path in sorted(tier_sockets(directory) - bound):
        try:
            st = os.lstat(path)
            if st.st_uid == os.getuid():  # never another user's
                os.unlink(path)
                gone.append(path)
        except OSError:
            continue
    return gone


def listen(path: str) -> Listener:
    """Bind ``path`` owner-only (a stale socket of a killed server is replaced, and any other of ours
    in the same folder that no process holds any more is removed)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    remove_stale_sockets(os.path.dirname(path))
    old = os.umask(0o077)
    try:
        return Listener(path, family="AF_UNIX")
    finally:
        os.umask(old)


def serve(listener: Listener, hello, take, closed) -> None:
    """A rank server's accept loop: one scheduler at a time; each gets ``hello()`` first, then every
    order it sends goes to ``take(conn, order)``; a scheduler that goes away leaves the server waiting
    for the next one. Ends when the listener is closed or ``closed()`` says so."""
    while not closed():
        try:
            conn = listener.accept()
        except OSError:
            return
        try:
            conn.send(hello())
            while not closed():
                take(conn, conn.recv())
        except (EOFError, OSError):
            pass
        finally:
            conn.close()


def unlisten(listener: Listener, path: str) -> None:
    """Stop accepting and remove the socket file (a rank server's shutdown)."""
    try:
        listener.close()
    except OSError:
        pass
    try:
        os.unlink(path)
    except OSError:
        pass


def connect(path: str) -> Connection:
    """Connect to a rank's worker; raises OSError while it is not listening yet."""
    return Client(path, family="AF_UNIX")


__all__ = ["connect", "listen", "remove_stale_sockets", "serve", "socket_dir", "socket_path", "tier_sockets",
           "unlisten"]
