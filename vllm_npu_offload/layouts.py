"""Per-layer KV caches as vLLM / vLLM-Ascend register them -> ``DeviceKVTensor`` + ``GroupRef``.

vLLM-Ascend keeps each layer's KV as a tuple of separate tensors (K and V; MLA's two
parts of different widths, e.g. 512 and 64), each carved out of a 2 MiB-aligned slice of
a bigger allocation. So a tensor's ``storage_offset`` is not zero and its storage size is
not a multiple of ``num_blocks``: everything here is derived from ``data_ptr()``,
``shape`` and ``stride`` of the tensor itself, never from its storage. CUDA's stacked
``(2, num_blocks, ...)`` K/V tensor is split into its two halves. Core module: torch only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence, Union

import torch

from .errors import OffloadConfigError
from .offload_worker import DeviceKVTensor, GroupRef, OffloadWorkerCore, device_platform

LayerKV = Union[torch.Tensor, Sequence[torch.Tensor]]


@dataclass
class CanonicalLayout:
    """Deduplicated device tensors and, per layer, the references that copy its blocks."""

    tensors: list[DeviceKVTensor] = field(default_factory=list)
    sources: list[torch.Tensor] = field(default_factory=list)  # one tensor per entry (device, dtype)
    layer_refs: dict[str, list[GroupRef]] = field(default_factory=dict)

    def group_refs(self, layer_names: Sequence[str] | None = None) -> list[GroupRef]:
        """References of ``layer_names`` (default: all layers), each tensor once, in layer order."""
        names = list(self.layer_refs) if layer_names is None else list(layer_names)
        seen: dict[int, GroupRef] = {}
        for name in names:
            if name not in self.layer_refs:
                raise OffloadConfigError(f"layer {name!r} is not one of the KV layers {sorted(self.layer_refs)}")
            for ref in self.layer_refs[name]:
                prev = seen.get(ref.tensor_idx)
                if prev is None or ref.page_bytes > prev.page_bytes:
                    seen[ref.tensor_idx] = ref
        return list(seen.values())


def split_parts(name: str, kv: LayerKV, num_blocks: int) -> list[torch.Tensor]:
    """The block-major tensors of one layer: tuple/list elements, or the halves of a stacked K/V."""
    if isinstance(kv, torch.Tensor):
        # (2, num_blocks, ...) is vLLM's stacked K/V; (num_blocks, ...) is one part. With
        # num_blocks == 2 both read alike and the block-major reading wins.
        if kv.dim() >= 2 and kv.shape[0] == 2 and kv.shape[1] == num_blocks and num_blocks != 2:
            return [kv[0], kv[1]]
        return [kv]
    if isinstance(kv, (tuple, list)) and kv and all(isinstance(t, torch.Tensor) for t in kv):
        return [p for t in kv for p in split_parts(name, t, num_blocks)]
    raise OffloadConfigError(
        f"KV cache of layer {name!r} is {type(kv).__name__}; allowed: a tensor or a non-empty tuple/list of tensors"
    )


def describe(name: str, t: torch.Tensor, num_blocks: int) -> DeviceKVTensor:
    """Base, block stride and page bytes of one block-major tensor (per-block payload must be contiguous).

    A leading dimension of ``f * num_blocks`` (kernel blocks smaller than vLLM's block)
    is accepted when the kernel blocks are packed back to back.
    """
    if t.dim() < 1 or t.shape[0] == 0 or t.shape[0] % num_blocks:
        raise OffloadConfigError(
            f"KV part of layer {name!r} has shape {tuple(t.shape)}; its leading dimension must be num_blocks="
            f"{num_blocks} (or a multiple of it)"
        )
    es = t.element_size()
    page = t[0].numel() * es
    stride = t.stride(0) * es
    if not t[0].is_contiguous():
        raise OffloadConfigError(
            f"KV part of layer {name!r} (shape {tuple(t.shape)}, stride {tuple(t.stride())}) has a non-contiguous "
            "per-block payload; a block must be one contiguous run of bytes to be copied as one descriptor"
        )
    if stride < page:
        raise OffloadConfigError(
            f"KV part of layer {name!r}: block stride {stride} B is smaller than the block payload {page} B "
            f"(shape {tuple(t.shape)}, stride {tuple(t.stride())}); blocks must not overlap"
        )
    storage = t.untyped_storage()
    end = t.data_ptr() + (t.shape[0] - 1) * stride + page
    if t.data_ptr() < storage.data_ptr() or end > storage.data_ptr() + storage.nbytes():
        raise OffloadConfigError(f"KV part of layer {name!r} reaches outside its storage ({storage.nbytes()} B)")
    factor = t.shape[0] // num_blocks
    if factor > 1:
        if stride != page:
            raise OffloadConfigError(
                f"KV part of layer {name!r} has {factor} kernel blocks per block but they are not packed "
                f"(stride {stride} B != payload {page} B)"
            )
        return DeviceKVTensor(t.data_ptr(), stride * factor, num_blocks, page * factor)
    return DeviceKVTensor(t.data_ptr(), stride, num_blocks, page)


def canonicalize(kv_caches: Mapping[str, LayerKV], num_blocks: int) -> CanonicalLayout:
    """One ``DeviceKVTensor`` per distinct (data_ptr, block stride) and ``GroupRef``s per layer."""
    if num_blocks <= 0:
        raise OffloadConfigError(f"num_blocks must be > 0, got {num_blocks}")
    if not kv_caches:
        raise OffloadConfigError("no KV caches were registered")
    out = CanonicalLayout()
    index: dict[tuple[int, int], int] = {}
    for name, kv in kv_caches.items():
        refs = []
        for part in split_parts(name, kv, num_blocks):
            d = describe(name, part, num_blocks)
            key = (d.base, d.block_stride)
            i = index.get(key)
            if i is None:
                i = index[key] = len(out.tensors)
                out.tensors.append(d)
                out.sources.append(part)
            elif d.page_bytes > out.tensors[i].page_bytes:  # a wider view of the same blocks
                out.tensors[i] = d
            refs.append(GroupRef(i, d.page_bytes))
        out.layer_refs[name] = refs
    return out


def build_worker_core(
    kv_caches: Mapping[str, LayerKV],
    num_blocks: int,
    blocks_per_chunk: int,
    num_chunks: int,
    groups: Sequence[Sequence[str]] | None = None,
    backend=None,
) -> OffloadWorkerCore:
    """An ``OffloadWorkerCore`` for per-layer caches; ``groups`` lists layer names per KV group (default: one)."""
    layout = canonicalize(kv_caches, num_blocks)
    group_refs = [layout.group_refs(g) for g in (groups if groups is not None else [None])]
    return OffloadWorkerCore(
        layout.tensors, group_refs, blocks_per_chunk, num_chunks, device_platform(layout.sources), backend
    )


__all__ = ["CanonicalLayout", "build_worker_core", "canonicalize", "describe", "split_parts"]
