"""A ``mooncake_master`` on loopback with its HTTP metadata server, on ports of its own: started, killed and
started again by the tests and by the GPU yardstick's pair part."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

# What a full pool does (docs/mooncake_tier.md): evict 20% once 80% is used. A 64 MiB pool written three
# times over as fast as the tier writes took every store at 80% / 20%; at 90% / 5% its 24th store was
# refused with -200 (tests/tiers/test_mooncake_tier.py, 2026-11-29).
EVICTION_FLAGS = ("--eviction_high_watermark_ratio=0.8", "--eviction_ratio=0.2")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MasterExited(RuntimeError):
    """The master process ended while starting."""


class Master:
    """One ``mooncake_master`` process (``binary``); ``start`` again after ``kill`` reuses the ports."""

    def __init__(self, binary: str, log: Path, *flags: str, env: dict[str, str] | None = None):
        self.binary, self.log, self.flags, self.env = binary, log, flags, env
        self._pick_ports()
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 20.0, tries: int = 3) -> None:
        """Start and wait until it listens. The first start picks other ports and tries again when the
        master exits at once (another process took a port between ``free_port`` and its bind); a
        restart keeps its ports, which its clients know."""
        attempts = tries if self.proc is None else 1
        for attempt in range(attempts):
            try:
                return self._start(timeout_s)
            except MasterExited:
                if attempt + 1 >= attempts:
                    raise
                self._pick_ports()

    def _pick_ports(self) -> None:
        self.rpc, self.http, self.metrics = free_port(), free_port(), free_port()

    def _start(self, timeout_s: float) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [self.binary, f"--rpc_port={self.rpc}", "--rpc_address=127.0.0.1",
                 "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
                 f"--http_metadata_server_port={self.http}", f"--metrics_port={self.metrics}", *self.flags],
                stdout=log, stderr=subprocess.STDOUT, env=self.env)
        end = time.monotonic() + timeout_s
        for port in (self.rpc, self.http):
            while True:
                if self.proc.poll() is not None:
                    raise MasterExited(f"mooncake_master exited: {self.log.read_text(errors='replace')[-2000:]}")
                if time.monotonic() > end:
                    raise RuntimeError(f"mooncake_master did not listen within {timeout_s:.0f} s")
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                    break
                except OSError:
                    time.sleep(0.05)

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def extra(self, **kw) -> dict:
        """The tier's settings for this master (``MooncakeConfig`` fields; ``segment_bytes`` required)."""
        return dict(master=f"127.0.0.1:{self.rpc}", metadata_server=f"http://127.0.0.1:{self.http}/metadata", **kw)
