"""The one copy contract: copy N (src, dst, size) descriptors on a stream.

Every path (native batch DMA, SM/Triton, host memmove) implements ``CopyPath``;
``NPUDmaCopyBackend`` picks one per direction.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

if TYPE_CHECKING:
    from ..platform import Platform


class Direction(enum.IntEnum):
    """Same numbering as vLLM-Ascend's ``swap_blocks_batch`` op."""

    H2D = 0  # load: host -> device
    D2H = 1  # store: device -> host

    @property
    def is_load(self) -> bool:
        return self is Direction.H2D


class CopyPath(ABC):
    """A way to execute a batch of copy descriptors asynchronously on a stream."""

    name: str = ""

    @abstractmethod
    def copy(
        self,
        src: np.ndarray,
        dst: np.ndarray,
        sizes: np.ndarray,
        direction: Direction,
        stream: Any,
        buffers: Any = None,
    ) -> None:
        """Enqueue the copies on ``stream``; raise ``CopyError`` if submission fails.

        ``src``/``dst``/``sizes`` are int64 arrays of equal length. ``buffers`` is the
        pinned ``DescriptorBuffers`` they live in, for paths that upload descriptors
        to the device (they must not be reused until the stream passes this copy).
        """

    def supports(self, direction: Direction) -> bool:
        return True

    # A transfer copied in several ranges (staged slices) prepares once, then copies each
    # range; paths with per-call set-up (descriptor upload) override both.
    def prepare(self, descriptors: Any) -> Any:
        """Per-transfer set-up for ``copy_range``; ``descriptors`` has src/dst/sizes/buffers."""
        return descriptors

    def copy_range(self, prepared: Any, rng: "DescriptorRange", direction: Direction, stream: Any) -> None:
        """Copy the descriptors ``rng`` selects from a prepared transfer, on ``stream``."""
        d, idx = prepared, rng.indices()
        self.copy(d.src[idx], d.dst[idx], d.sizes[idx], direction, stream)

    def fused_pipeline(self, link: "CopyPath", slots: int) -> Any:
        """As a staged transfer's local path: an object whose ``run(plan, direction, stream, aux)``
        enqueues the whole slice pipeline with ``link`` itself, or None (the Stager's loop runs it)."""
        return None


def as_direction(d: "Direction | int") -> Direction:
    """``d`` as a Direction; one is returned as it is (the enum call costs ~0.4 us on a slow host,
    and the engine thread would pay it several times per transfer)."""
    return d if d.__class__ is Direction else Direction(d)


@dataclass(frozen=True)
class BackendChoice:
    """The copy path of each direction, by name."""

    load: str
    store: str


PathFactory = Callable[["Platform", "list[int]"], CopyPath]  # (platform, page sizes) -> path


@dataclass(frozen=True)
class PlatformPaths:
    """What one device kind's copy module offers (``cuda_paths.PATHS``, ``npu_paths.PATHS``):
    its named paths, how to choose one per direction (it may measure, only the directions it is
    given: the others get its unmeasured default), and the (local, link) pair for staged
    transfers (raises ImportError / RuntimeError when staging is unavailable)."""

    paths: dict[str, PathFactory]
    choose: Callable[["Platform", "list[int]", "tuple[Direction, ...]"], BackendChoice]
    staged: Callable[["Platform", "list[int]"], "tuple[CopyPath, CopyPath]"]


@dataclass(frozen=True)
class DescriptorRange:
    """Descriptors ``first + r * stride + c`` for ``r < rows``, ``c < width``.

    ``rows=1`` is a plain contiguous range; otherwise the same column range of every row of
    a tensor-major table (row = KV tensor, column = block), which is what one staged slice
    needs without re-sorting the descriptors slice by slice.
    """

    first: int
    width: int
    rows: int = 1
    stride: int = 0

    @property
    def count(self) -> int:
        return self.rows * self.width

    def indices(self) -> np.ndarray:
        r = np.arange(self.rows, dtype=np.int64)[:, None] * self.stride
        return (self.first + r + np.arange(self.width, dtype=np.int64)[None, :]).ravel()


class SliceRanges(Sequence[list[DescriptorRange]]):
    """Per slice, one contiguous range ``[bounds[i], bounds[i + 1])`` of descriptors (a plan whose
    descriptors lie slice after slice); the ranges are made only when read (the Python loop)."""

    def __init__(self, bounds: np.ndarray):
        self.bounds = bounds

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def __getitem__(self, i: int) -> list[DescriptorRange]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"slice {i} of {len(self)}")
        lo, hi = int(self.bounds[i % len(self)]), int(self.bounds[i % len(self) + 1])
        return [DescriptorRange(lo, hi - lo)]


def check_descriptors(src: np.ndarray, dst: np.ndarray, sizes: np.ndarray) -> None:
    if not (len(src) == len(dst) == len(sizes)):
        raise ValueError(f"descriptor arrays differ in length: src={len(src)} dst={len(dst)} sizes={len(sizes)}")
    if len(sizes) and sizes.min() <= 0:
        i = int(np.argmin(sizes))
        raise ValueError(f"descriptor {i} has size {int(sizes[i])}; sizes must be > 0")
