"""Split path: one batch on the SMs and the copy engines at once.

Why: on the small scattered pages of KV offload, neither the SM copy (~70-86% of the
link on H100/H200) nor batch DMA alone fills PCIe, but they are independent engines.
The first ``1 - dma_share`` of the bytes go to the SM kernel on the caller's stream,
the rest to batch DMA on a side stream that forks from and joins back into it, so
the job's end event still covers every byte.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..platform import Platform
from .base import CopyPath, Direction, check_descriptors


class SplitCopyPath(CopyPath):
    def __init__(self, platform: Platform, sm: CopyPath, dma: CopyPath, dma_share: float):
        if not 0.0 < dma_share < 1.0:
            raise ValueError(f"dma_share={dma_share}; allowed: strictly between 0 and 1")
        self.platform = platform
        self.sm = sm
        self.dma = dma
        self.dma_share = dma_share
        self.name = f"split{round(dma_share * 100)}"
        self._side = platform.new_stream()
        self._joined = platform.new_event()

    def copy(self, src, dst, sizes, direction: Direction, stream: Any, buffers=None) -> None:
        check_descriptors(src, dst, sizes)
        n = len(sizes)
        cum = np.cumsum(sizes)
        # SM takes the head (its descriptors upload straight from the pooled pinned buffers)
        k = int(np.searchsorted(cum, cum[-1] * (1.0 - self.dma_share))) if n > 1 else n
        k = min(max(k, 1), n)
        if k < n:
            self._side.wait_stream(stream)
            self.dma.copy(src[k:], dst[k:], sizes[k:], direction, self._side)
        self.sm.copy(src[:k], dst[:k], sizes[:k], direction, stream, buffers)
        if k < n:
            self._joined.record(self._side)
            stream.wait_event(self._joined)
