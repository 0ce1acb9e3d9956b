"""Device-local gather/scatter with the native kernel (``csrc_cuda/gather_kernel.cu``).

The staged path's local half: device pages <-> device staging, at most 16 SMs. The
kernel keeps 64 KiB in flight per SM (lane groups sized to the page, 8 vectors per
lane, next descriptor prefetched), where the Triton kernel waited on each descriptor
before its data and moved 35-140 GB/s on 1-4 KiB pages. It is launched by one ctypes
call into the plain-C library (cuLaunchKernel), not through Triton's Python launcher.
"""

from __future__ import annotations

from typing import Any

from ..plan import Descriptors
from ..platform import Platform
from .base import CopyPath, DescriptorRange, Direction, check_descriptors
from .._native.cuda import NativeCudaLib, load_library
from .device_descriptors import refuse_null, upload

MAX_PROGRAMS = 16


class NativeGatherPath(CopyPath):
    """Copies descriptors whose addresses the device can reach, with the library's kernel."""

    name = "gather_native"

    def __init__(self, platform: Platform, page_sizes: list[int] | None = None, programs: int = MAX_PROGRAMS,
                 lib: NativeCudaLib | None = None):
        if not 1 <= programs <= MAX_PROGRAMS:
            raise ValueError(f"programs={programs}; allowed: 1..{MAX_PROGRAMS} (SMs the gather may occupy)")
        self.lib = lib or load_library()
        if not self.lib.built_gather:
            raise ImportError(f"{self.lib.path} was built without the gather kernel (needs nvcc at build time)")
        self.platform = platform
        self.programs = dict.fromkeys(Direction, programs)  # per direction, as the staged pipeline takes them
        self.min_page = min(page_sizes) if page_sizes else 16

    def prepare(self, descriptors):
        """Check and upload a whole transfer's descriptors in one copy, on the current stream."""
        src, dst, sizes = descriptors.src, descriptors.dst, descriptors.sizes
        check_descriptors(src, dst, sizes)
        refuse_null(src, dst, "gather")
        dev = upload(self.platform, src, dst, sizes, descriptors.buffers)
        cap = dev.shape[1] * dev.element_size()
        return dev, (dev.data_ptr(), dev.data_ptr() + cap, dev.data_ptr() + 2 * cap)

    def copy_range(self, prepared, rng: DescriptorRange, direction: Direction, stream: Any) -> None:
        if rng.count <= 0:
            return
        self.lib.gather(prepared[1], rng.first, rng.width, rng.rows, rng.stride, self.min_page,
                        self.programs[Direction(direction)],
                        self.platform.raw_stream_handle(stream))

    def fused_pipeline(self, link: CopyPath, slots: int):
        from .cuda_dma import CudaDmaCopyPath
        from .cuda_pipeline import CudaStagedPipeline

        if not isinstance(link, CudaDmaCopyPath) or link.lib is not self.lib:
            return None
        return CudaStagedPipeline(self.lib, self.platform, slots, self.programs, self.min_page)

    def copy(self, src, dst, sizes, direction: Direction, stream: Any, buffers=None) -> None:
        if len(sizes) == 0:
            return
        with self.platform.stream_context(stream):  # the upload is ordered before the kernel
            prepared = self.prepare(Descriptors(src, dst, sizes, 0, buffers))
        self.copy_range(prepared, DescriptorRange(0, len(sizes)), direction, stream)
