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


def socket_path(engine_id: str, root: str, rank: int) -> str:
    """The socket of ``rank``'s tier worker (short enough for AF_UNIX's 108 bytes)."""
    tag = hashlib.sha256(f"{engine_id}\0{os.path.realpath(root)}".encode()).hexdigest()[:20]
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return os.path.join(base, f"npu-kv-{tag}-r{rank}.sock")


def listen(path: str) -> Listener:
    """Bind ``path`` owner-only (a stale socket of a killed server is replaced)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
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


__all__ = ["connect", "listen", "serve", "socket_path", "unlisten"]
