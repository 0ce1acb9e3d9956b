"""CUDA copy-engine paths: ``dma`` submits a batch with cuMemcpyBatchAsync (chunked in C);
``dma_loop`` issues one cuMemcpyAsync per descriptor (the pre-batching baseline, kept for
benchmarks). Both through the native library (``_native.cuda``)."""

from __future__ import annotations

from typing import Any

from .._native.cuda import NativeCudaLib, load_library
from ..platform import Platform
from .base import CopyPath, Direction, check_descriptors


class CudaDmaCopyPath(CopyPath):
    """Copy-engine path: one cuMemcpyBatchAsync per chunk, or a cuMemcpyAsync loop."""

    def __init__(self, platform: Platform, batch: bool = True, lib: NativeCudaLib | None = None):
        self.platform = platform
        self.batch = batch
        self.name = "dma" if batch else "dma_loop"
        self.lib = lib or load_library()

    def copy(self, src, dst, sizes, direction: Direction, stream: Any, buffers=None) -> None:
        check_descriptors(src, dst, sizes)
        # ANY is only safe when the source is stable pinned host memory: loads over the link (a
        # load's scatter reads staging that its link copy is still filling: stream order)
        self.lib.copy(src, dst, sizes, self.platform.raw_stream_handle(stream), self.batch,
                      src_order_any=Direction(direction).is_load)
