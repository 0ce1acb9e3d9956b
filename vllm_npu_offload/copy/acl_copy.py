"""Ascend copy paths ``acl_batch`` / ``acl_loop`` (and their device-local forms for staged
gather/scatter): one C entry point of ``libnpu_offload_acl.so`` each (``_native.acl``)."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from .._native.acl import D2D, OK, AclError, _raise, load_library
from ..errors import CopyError
from ..platform import Platform
from .base import CopyPath, Direction, check_descriptors

# Descriptors per aclrtMemcpyBatchAsync call; 0: all of a batch in one call, the fewest runtime calls
# on the engine thread (a positive count splits a batch, which only tests need).
MAX_BATCH = 0


def _as_int64(a: np.ndarray, name: str) -> np.ndarray:
    if a.dtype != np.int64 or not a.flags.c_contiguous:
        raise TypeError(f"{name} descriptors must be a C-contiguous int64 array, got {a.dtype} "
                        f"(contiguous={a.flags.c_contiguous})")
    return a


class AclCopyPath(CopyPath):
    """One C entry point (batch or loop) behind the CopyPath contract.

    ``device_local=True`` submits every copy device->device on the current device, whatever
    ``direction`` says: the gather (store) and scatter (load) between KV pages and a device
    staging buffer. The loop path then needs 64-byte aligned addresses (aclrtMemcpyAsync D2D).
    """

    def __init__(self, platform: Platform | None, batch: bool, lib: ctypes.CDLL | None = None,
                 device_local: bool = False, max_batch: int = MAX_BATCH):
        """``max_batch``: descriptors per batch call (0: all; tests split batches with it)."""
        self.platform = platform
        self.batch = batch
        self.device_local = device_local
        self.name = ("acl_batch" if batch else "acl_loop") + ("_local" if device_local else "")
        self.lib = lib or load_library()
        if max_batch < 0:
            raise ValueError(f"max_batch={max_batch}; allowed: 0 (all) or a positive count")
        self.max_batch = max_batch

    def stream_handle(self, stream: Any) -> int:
        """An int is taken as a raw aclrtStream (tests); anything else goes through the platform."""
        if isinstance(stream, int):
            return stream
        if self.platform is None:
            raise CopyError(f"{self.name}: no platform to turn {type(stream).__name__} into an aclrtStream",
                            self.name)
        return self.platform.raw_stream_handle(stream)

    def fused_pipeline(self, link: CopyPath, slots: int):
        """The whole slice pipeline in one native call, when this is the device-local side and
        ``link`` the host side over the same library; else None (Stager.run's Python loop)."""
        from .npu_pipeline import AclStagedPipeline

        if not self.device_local or not isinstance(link, AclCopyPath) or link.device_local or link.lib is not self.lib:
            return None
        return AclStagedPipeline(self, link, slots)

    def copy(self, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, direction: Direction, stream: Any,
             buffers=None) -> None:
        check_descriptors(src, dst, sizes)
        if self.device_local:
            code, label = D2D, "D2D"
        else:
            direction = Direction(direction)
            code, label = int(direction), direction.name
        n = len(sizes)
        if n == 0:
            return
        s, d, z = _as_int64(src, "src"), _as_int64(dst, "dst"), _as_int64(sizes, "sizes")
        handle = ctypes.c_void_p(self.stream_handle(stream))
        err = AclError()
        args = (s.ctypes.data, d.ctypes.data, z.ctypes.data, n, code, handle)
        if self.batch:
            rc = self.lib.npu_offload_acl_copy_batch(*args, self.max_batch, ctypes.byref(err))
        else:
            rc = self.lib.npu_offload_acl_copy_loop(*args, ctypes.byref(err))
        if rc != OK:
            _raise(err, f"{self.name} {label} copy of {n} descriptors failed")
