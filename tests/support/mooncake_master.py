"""A real ``mooncake_master`` on loopback for tests (started and killed by them)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vllm_npu_offload.tiers.mooncake_store import MooncakeConfig

SEGMENT = 64 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def master_binary() -> str:
    found = shutil.which("mooncake_master", path=os.pathsep.join([str(Path(sys.executable).parent),
                                                                   os.environ.get("PATH", "")]))
    if found is None:
        pytest.skip("mooncake_master is not installed next to this Python")
    return found


class Master:
    """A ``mooncake_master`` with its HTTP metadata server, on loopback, on ports of its own."""

    def __init__(self, log: Path, *flags: str):
        self.rpc, self.http, self.metrics = free_port(), free_port(), free_port()
        self.log = log
        self.flags = flags
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [master_binary(), f"--rpc_port={self.rpc}", "--rpc_address=127.0.0.1",
             "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
             f"--http_metadata_server_port={self.http}", f"--metrics_port={self.metrics}", *self.flags],
            stdout=open(self.log, "ab"), stderr=subprocess.STDOUT)
        end = time.monotonic() + 20
        for port in (self.rpc, self.http):
            while True:
                assert self.proc.poll() is None, f"mooncake_master exited: {self.log.read_text()[-2000:]}"
                assert time.monotonic() < end, "mooncake_master did not listen within 20 s"
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

    def config(self, **kw) -> MooncakeConfig:
        return MooncakeConfig(**self.extra(**kw))

    def extra(self, **kw) -> dict:
        """The tier's settings for this master (as ``MooncakeConfig`` fields)."""
        return dict(master=f"127.0.0.1:{self.rpc}", metadata_server=f"http://127.0.0.1:{self.http}/metadata",
                    segment_bytes=kw.pop("segment_bytes", SEGMENT), buffer_bytes=0, **kw)
