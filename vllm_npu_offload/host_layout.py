"""Block-first host layout: one host block is one contiguous record of every KV page.

A host *record* holds one device block of every KV tensor (all layers, K and V or the
MLA parts), each page at a fixed, aligned offset; a host *chunk* is ``blocks_per_chunk``
consecutive records. So any run of consecutive host blocks — a whole chunk, or adjacent
chunks — is one contiguous span of host memory, and the link can be given a few large
copies instead of one per page (the scattering happens on the device, see staging.py).

Host block ``h`` (sub-block ``h % bpc`` of chunk ``h // bpc``) of tensor ``t`` lives at
``base + h * record_bytes + page_offsets[t]``. Several KV-cache groups share the record
(each group writes only its own tensors); ``group_span`` says which bytes a group uses. The
worker core orders the pages group by group (``order``), so that a group's span holds only
its own pages: a store copies a group's span whole, and must not write another group's pages.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

from .errors import OffloadConfigError
from .memory import round_up
from .plan import BlockLayout

PAGE_ALIGNMENT = 64  # every page 64-byte aligned: wide SM loads, and ACL device-to-device copies need it


@dataclass(frozen=True)
class HostLayout:
    page_bytes: tuple[int, ...]  # host slot of each tensor (its padded device page)
    page_offsets: tuple[int, ...]  # offset of each tensor's slot inside a record
    record_bytes: int
    blocks_per_chunk: int
    num_chunks: int

    @classmethod
    def build(cls, page_bytes: Sequence[int], blocks_per_chunk: int, num_chunks: int,
              order: Sequence[int] | None = None) -> "HostLayout":
        """``order``: the tensors in the order their pages follow each other in a record (default:
        by index); it must name every tensor once."""
        if not page_bytes or any(p <= 0 for p in page_bytes):
            raise OffloadConfigError(f"page sizes must be positive bytes, got {list(page_bytes)}")
        if blocks_per_chunk <= 0:
            raise OffloadConfigError(f"blocks_per_chunk must be > 0, got {blocks_per_chunk}")
        if num_chunks <= 0:
            raise OffloadConfigError(
                f"num_chunks must be > 0 (host memory too small for one block?), got {num_chunks}"
            )
        order = list(range(len(page_bytes))) if order is None else [int(t) for t in order]
        if sorted(order) != list(range(len(page_bytes))):
            raise OffloadConfigError(f"record order {order} must name each of the {len(page_bytes)} tensors once")
        offsets, pos = [0] * len(page_bytes), 0
        for t in order:
            pos = round_up(pos, PAGE_ALIGNMENT)
            offsets[t] = pos
            pos += page_bytes[t]
        return cls(tuple(page_bytes), tuple(offsets), round_up(pos, PAGE_ALIGNMENT), blocks_per_chunk, num_chunks)

    @functools.cached_property
    def pages_end(self) -> int:
        """Where the last page of a record ends (the rest is alignment padding nobody owns)."""
        return max(o + p for o, p in zip(self.page_offsets, self.page_bytes))

    @property
    def num_blocks(self) -> int:
        return self.num_chunks * self.blocks_per_chunk

    @property
    def chunk_bytes(self) -> int:
        return self.record_bytes * self.blocks_per_chunk

    @property
    def nbytes(self) -> int:
        return self.chunk_bytes * self.num_chunks

    def tensor_layout(self, base: int, tensor_idx: int, num_blocks: int | None = None) -> BlockLayout:
        """Where tensor ``tensor_idx``'s pages live in a buffer of records starting at ``base``."""
        return BlockLayout(base + self.page_offsets[tensor_idx], self.record_bytes,
                           self.num_blocks if num_blocks is None else num_blocks)

    def group_span(self, tensor_ids: Sequence[int]) -> tuple[int, int]:
        """``[lo, hi)`` bytes of a record that the given tensors occupy (a group's part of it)."""
        lo = min(self.page_offsets[t] for t in tensor_ids)
        hi = max(self.page_offsets[t] + self.page_bytes[t] for t in tensor_ids)
        return lo, hi
