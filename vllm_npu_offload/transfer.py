"""The transfer contract: one planned transfer, which knows its bytes, its pooled descriptor
buffers, and how to enqueue itself on a stream.

The worker core plans (``OffloadWorkerCore.plan``), the engine runs (``TransferEngine.submit``
enqueues it between its timing events and releases its buffers when the copy has finished).
Two kinds: *direct* (one descriptor per page, device <-> host, on the backend's path for that
direction) and *staged* (gather/scatter on the device through the staging buffer, a few large
link copies; ``staging.Stager``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np

from .copy.backend import NPUDmaCopyBackend
from .copy.base import Direction
from .plan import DescriptorBuffers, Descriptors
from .staging import StagedPlan, Stager


class Transfer(ABC):
    direction: Direction
    # True: ``enqueue`` names every stream it uses (raw handles), so the engine need not make
    # ``stream`` the current one around it
    names_streams: bool = False
    # True: ``enqueue_ordered`` takes the engine's stream order and events itself (one native call)
    orders_itself: bool = False

    @property
    @abstractmethod
    def total_bytes(self) -> int:
        """KV bytes the transfer moves (each page once)."""

    @property
    @abstractmethod
    def buffers(self) -> list[DescriptorBuffers]:
        """Pooled descriptor buffers to return once the copies have finished."""

    @abstractmethod
    def __len__(self) -> int:
        """Descriptors (device pages and link runs) the transfer copies."""

    @abstractmethod
    def enqueue(self, stream: Any) -> None:
        """Enqueue every copy; ``stream`` (which the engine ordered after the model's stream) passes
        its end only after the last one. Raises ``CopyError`` when a copy cannot be submitted."""


@dataclass
class DirectTransfer(Transfer):
    """One descriptor per page and tensor, device <-> host."""

    direction: Direction
    descriptors: Descriptors
    backend: NPUDmaCopyBackend

    @property
    def total_bytes(self) -> int:
        return self.descriptors.total_bytes

    @property
    def buffers(self) -> list[DescriptorBuffers]:
        return [self.descriptors.buffers] if self.descriptors.buffers is not None else []

    def __len__(self) -> int:
        return len(self.descriptors)

    def enqueue(self, stream: Any) -> None:
        d = self.descriptors
        self.backend.copy(d.src, d.dst, d.sizes, self.direction, stream, d.buffers)


@dataclass
class StagedTransfer(Transfer):
    """Device gather/scatter through the staging slots plus a few large link copies, in slices."""

    direction: Direction
    plan: StagedPlan
    stager: Stager

    @property
    def total_bytes(self) -> int:
        return self.plan.total_bytes

    @property
    def buffers(self) -> list[DescriptorBuffers]:
        return self.plan.buffers

    def __len__(self) -> int:
        return len(self.plan)

    def enqueue(self, stream: Any, link: bool = True) -> None:
        """``link=False`` enqueues only the device-local gather/scatter (benchmarks)."""
        self.stager.run(self.plan, self.direction, stream, link=link)


@dataclass
class NativeStagedTransfer(Transfer):
    """A staged transfer that the native pipeline plans in the call that enqueues it (CUDA, Ascend):
    the same copies as ``StagedTransfer``'s plan, without the Python planner's 30-100 us per
    transfer. Holds each KV group's (planner, record span, device ids, host ids) and the pinned
    room the plan writes into, kept until the copies have finished: the block ids of both sides
    (CUDA's table form) or the page and link descriptors (Ascend's page form)."""

    direction: Direction
    groups: list[tuple[Any, tuple[int, int], np.ndarray, np.ndarray]]
    room: DescriptorBuffers
    stager: Stager
    nbytes: int
    pages: int
    links: int = 0  # link copies, known once enqueued
    # the stager's ``orders_natively``, as a field: the engine reads it on every transfer's critical path
    orders_itself: bool = False
    names_streams = True

    @property
    def total_bytes(self) -> int:
        return self.nbytes

    @property
    def buffers(self) -> list[DescriptorBuffers]:
        return [self.room]

    def __len__(self) -> int:
        return self.pages + self.links

    def enqueue(self, stream: Any, link: bool = True) -> None:
        """``link=False`` enqueues only the device-local gather/scatter (benchmarks)."""
        self.links = self.stager.run_native(self, stream, link=link)

    def enqueue_ordered(self, stream: Any, platform: Any, start: Any, end: Any, after: Any = None) -> None:
        """``enqueue`` with the engine's stream order in the same native call: a store's ``stream``
        waits for the compute stream's work so far, a load's scatters do (its link copies need not);
        ``stream`` waits for ``after`` (the previous job's end), then records ``start``; ``end`` is
        recorded after the copies, also when one fails to enqueue."""
        self.links = self.stager.submit_ordered(self, stream, platform.raw_order(start, end, after))


__all__ = ["DirectTransfer", "NativeStagedTransfer", "StagedTransfer", "Transfer"]
