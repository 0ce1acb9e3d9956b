"""Exact-size host KV memory, pinned where the platform allows.

torch's pinned allocator rounds large requests up to a power of two (a 40 GiB pool
can cost 64 GiB). Instead we take ordinary host memory of exactly the requested size
and page-lock it in place (cudaHostRegister / aclrtHostRegisterV2).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .errors import OffloadConfigError
from .platform import Platform

logger = logging.getLogger(__name__)

REGION_ALIGNMENT = 256  # bytes; keeps every region 16-byte aligned for wide SM loads


def round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


@dataclass(frozen=True)
class HostRegion:
    """A block-strided slice of the host buffer that mirrors one device KV tensor."""

    offset: int
    block_stride: int
    num_blocks: int

    @property
    def nbytes(self) -> int:
        return self.block_stride * self.num_blocks


class HostKVBuffer:
    """One host allocation carved into per-tensor regions of ``num_blocks x page`` bytes."""

    def __init__(self, platform: Platform, page_bytes: list[int], num_blocks: int, pin: bool = True):
        if num_blocks <= 0:
            raise OffloadConfigError(f"host KV buffer needs num_blocks > 0, got {num_blocks}")
        bad = [p for p in page_bytes if p <= 0]
        if bad or not page_bytes:
            raise OffloadConfigError(f"page sizes must be positive bytes, got {page_bytes}")
        self.platform = platform
        self.regions: list[HostRegion] = []
        offset = 0
        for page in page_bytes:
            offset = round_up(offset, REGION_ALIGNMENT)
            self.regions.append(HostRegion(offset, page, num_blocks))
            offset += page * num_blocks
        self.nbytes = offset
        # torch.empty -> posix_memalign of exactly nbytes; zero it so pages are
        # resident and a read of a never-written block is deterministic.
        self.tensor = torch.zeros(self.nbytes, dtype=torch.uint8)
        self.pinned = bool(pin and platform.pin_memory_available and platform.pin(self.tensor))
        if pin and platform.pin_memory_available and not self.pinned:
            logger.warning("could not page-lock %d host bytes; copies to/from them will be slower", self.nbytes)
        self.base = self.tensor.data_ptr()

    def region_view(self, idx: int) -> torch.Tensor:
        """``(num_blocks, block_stride)`` uint8 view of region ``idx``."""
        r = self.regions[idx]
        return self.tensor[r.offset : r.offset + r.nbytes].view(r.num_blocks, r.block_stride)

    def release(self) -> None:
        if self.pinned:
            self.platform.unpin(self.tensor)
            self.pinned = False
