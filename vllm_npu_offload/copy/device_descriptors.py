"""Descriptor columns on the device, for paths whose kernels read them there.

One asynchronous copy of the (3, capacity) pinned rows that ``DescriptorBuffers``
keeps (src, dst, size), on the current stream; plain arrays get a pinned staging
copy first. Shared by the Triton SM path and the native gather kernel.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import CopyError
from ..platform import Platform


def refuse_null(src: np.ndarray, dst: np.ndarray, call: str) -> None:
    """A kernel would fault and poison the context on a null address: refuse up front."""
    bad = np.flatnonzero((src == 0) | (dst == 0))
    if len(bad):
        i = int(bad[0])
        raise CopyError(f"{call}: descriptor {i} has a null address (src={int(src[i]):#x}, "
                        f"dst={int(dst[i]):#x}); addresses must be nonzero", call, i)


def upload(platform: Platform, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, buffers) -> torch.Tensor:
    """A (3, >= n) int64 device tensor whose rows are src, dst, sizes (row-major: one base pointer)."""
    n = len(sizes)
    packed = getattr(buffers, "packed", None)
    if packed is None or src.ctypes.data != packed[0].data_ptr() or dst.ctypes.data != packed[1].data_ptr() \
            or sizes.ctypes.data != packed[2].data_ptr():
        packed = platform.empty_pinned((3, max(1, n)), torch.int64)
        for i, a in enumerate((src, dst, sizes)):
            packed.numpy()[i, :n] = a
    return packed.to(platform.device, non_blocking=True)
