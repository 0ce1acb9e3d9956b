"""Exact-size host KV memory, NUMA-local and pinned where the platform allows.

torch's pinned allocator rounds large requests up to a power of two (a 40 GiB pool
can cost 64 GiB). Instead we take ordinary host memory of exactly the requested size,
bind it to the device's NUMA node before first touch, and page-lock it in place
(cudaHostRegister / aclrtHostRegisterV2).
"""

from __future__ import annotations

import logging
import weakref

import torch

from . import numa
from .errors import OffloadConfigError
from .host_limits import pin_failure_hint
from .platform import Platform

logger = logging.getLogger(__name__)

PAGE_BYTES = 4096



def round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


class HostKVBuffer:
    """One flat host allocation of exactly ``nbytes`` (``HostLayout`` says what lives where)."""

    def __init__(self, platform: Platform, nbytes: int, pin: bool = True):
        if nbytes <= 0:
            raise OffloadConfigError(f"host KV buffer needs a positive size, got {nbytes} bytes")
        self.platform = platform
        self.nbytes = nbytes
        # torch.empty -> posix_memalign of exactly nbytes, not touched yet: bind it to the
        # device's node first, then zero it so pages are resident (and on that node) and a
        # read of a never-written block is deterministic.
        # Page-aligned start: a host chunk (a multiple of 4 KiB) can then go to and from a lower tier's
        # files with O_DIRECT, straight from this memory (4 KiB more, at most, than asked for).
        self._raw = torch.empty(nbytes + PAGE_BYTES, dtype=torch.uint8)
        skip = -self._raw.data_ptr() % PAGE_BYTES
        self.tensor = self._raw[skip:skip + nbytes]
        self.numa = numa.place(self.tensor.data_ptr(), nbytes, platform.kind)
        self.tensor.zero_()
        self.pinned = bool(pin and platform.pin_memory_available and platform.pin(self.tensor))
        if pin and platform.pin_memory_available and not self.pinned:
            logger.warning("%s; copies to/from them will be slower", pin_failure_hint(nbytes))
        # A buffer dropped without ``release`` (its worker never shut down, e.g. after an exception)
        # is unregistered before its memory goes back: freed while still registered, the range stayed
        # registered, and a later allocation there failed to register ("already mapped") and its
        # pageable copies failed (GPU tests, 2026-11-27). Not at interpreter exit (the driver may be
        # torn down by then; the process's end frees both).
        self._unpin = weakref.finalize(self, platform.unpin, self.tensor) if self.pinned else None
        if self._unpin is not None:
            self._unpin.atexit = False
        self.base = self.tensor.data_ptr()

    def strided_view(self, offset: int, rows: int, row_bytes: int, row_stride: int) -> torch.Tensor:
        """``(rows, row_bytes)`` uint8 view starting ``offset`` bytes in, rows ``row_stride`` apart."""
        return self.tensor[offset:].as_strided((rows, row_bytes), (row_stride, 1))

    def release(self) -> None:
        if self.pinned:
            self._unpin()  # once: the finalizer is then dead
            self.pinned = False
