"""A real ``mooncake_master`` on loopback for tests (started and killed by them): ``benchmarks/mooncake_master.py``
with the binary installed next to this Python, else the test is skipped."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.mooncake_master import Master as _Master  # noqa: E402
from benchmarks.mooncake_master import free_port  # noqa: E402, F401
from vllm_npu_offload.tiers.mooncake_store import MooncakeConfig  # noqa: E402

SEGMENT = 64 << 20


def master_binary() -> str:
    found = shutil.which("mooncake_master", path=os.pathsep.join([str(Path(sys.executable).parent),
                                                                   os.environ.get("PATH", "")]))
    if found is None:
        pytest.skip("mooncake_master is not installed next to this Python")
    return found


class Master(_Master):
    """The master with the binary found here; tier settings with the tests' small segment by default."""

    def __init__(self, log: Path, *flags: str):
        super().__init__(master_binary(), log, *flags)

    def config(self, **kw) -> MooncakeConfig:
        return MooncakeConfig(**self.extra(**kw))

    def extra(self, **kw) -> dict:
        return super().extra(segment_bytes=kw.pop("segment_bytes", SEGMENT), buffer_bytes=0, **kw)
