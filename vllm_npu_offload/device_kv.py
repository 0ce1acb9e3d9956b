"""Device KV as both connectors hand it to the worker core: distinct block regions
(``DeviceKVTensor``) and, per KV group, references to them (``GroupRef``).

Three shapes reach us, all described here, with one dedupe rule:
- vLLM's tensors (``(num_blocks, ...)`` or its stacked ``(2, num_blocks, ...)`` K/V; kernel blocks
  smaller than vLLM's, ``f * num_blocks``, packed back to back);
- vLLM-Ascend's per-layer tuples (K and V; MLA's two parts of different widths, e.g. 512 and 64),
  each carved out of a 2 MiB-aligned slice of a bigger allocation, so everything is derived from
  ``data_ptr()``, ``shape`` and ``stride`` of the tensor itself, never from its storage's start;
- vLLM >= 0.26's placements (``offset + layer * layer_stride + block * block_stride`` inside one
  allocation; layer-outer per layer, or block-outer: one region whose block holds every layer).
Layers that alias the same blocks (hybrid groups, several names for one tensor) share one region.
Core module: torch only.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Mapping, Sequence, Union

import torch

from .errors import OffloadConfigError
from .platform import Platform, platform_for_tensor

LayerKV = Union[torch.Tensor, Sequence[torch.Tensor]]


@dataclass(frozen=True)
class DeviceKVTensor:
    """One device KV region seen as blocks: block ``i`` at ``base + i * block_stride``. Made from a
    tensor, it holds that tensor (``owner``): copies target ``base`` by address, so the memory must
    live as long as the descriptor does, whoever else lets go of the tensor."""

    base: int
    block_stride: int
    num_blocks: int
    page_bytes: int  # padded page; the host mirrors this many bytes per block
    owner: object = field(default=None, compare=False, repr=False)

    @classmethod
    def from_block_view(cls, t: torch.Tensor, page_bytes: int | None = None) -> "DeviceKVTensor":
        """From a ``(num_blocks, ...)`` tensor whose per-block payload is contiguous (vLLM's
        ``CanonicalKVCacheTensor``: an int8 ``(num_blocks, page)`` view)."""
        if t.dim() < 1 or t.shape[0] == 0:
            raise OffloadConfigError(f"KV tensor must have a leading num_blocks dimension, got shape {tuple(t.shape)}")
        stride = t.stride(0) * t.element_size()
        page = page_bytes if page_bytes is not None else t[0].numel() * t.element_size()
        if page > stride:
            raise OffloadConfigError(f"KV page of {page} bytes exceeds the block stride {stride} of {tuple(t.shape)}")
        return cls(t.data_ptr(), stride, t.shape[0], page, owner=t)

    @property
    def end(self) -> int:
        return self.base + (self.num_blocks - 1) * self.block_stride + self.page_bytes


@dataclass(frozen=True)
class GroupRef:
    tensor_idx: int
    page_bytes: int  # un-padded bytes actually copied per block


def device_platform(tensors: Sequence[torch.Tensor]) -> Platform:
    """The one platform all KV tensors live on."""
    kinds = {t.device.type for t in tensors}
    if len(kinds) != 1:
        raise OffloadConfigError(f"KV tensors are on several device kinds {sorted(kinds)}")
    return platform_for_tensor(tensors[0])


# -- one tensor -------------------------------------------------------------------------------


def block_major_parts(t: torch.Tensor, num_blocks: int) -> list[torch.Tensor]:
    """Views of ``t`` whose leading dimension counts blocks: ``t`` itself when its leading
    dimension is ``num_blocks`` (or a multiple: kernel blocks), else one view per index of the
    dimensions before its first dimension of ``num_blocks`` (or a multiple): vLLM's stacked
    ``(2, num_blocks, ...)`` K/V gives its two halves. Without such a dimension, ``[t]``."""
    if t.dim() and t.shape[0] and t.shape[0] % num_blocks == 0:
        return [t]
    dims = [d for d, n in enumerate(t.shape) if n == num_blocks]
    dims = dims or [d for d, n in enumerate(t.shape) if n and n % num_blocks == 0]
    if not dims:
        return [t]  # ``describe`` names the layer and the shape it wants
    outer = t.shape[: dims[0]]
    return [t[idx] for idx in itertools.product(*(range(n) for n in outer))]


def dense(t: torch.Tensor) -> bool:
    """The elements fill one gap-free run of memory starting at ``data_ptr()``, in any dimension
    order: vLLM 0.23's TRITON_ATTN on Hopper keeps a block's K as (heads, tokens, dim) in memory and
    hands it as a (tokens, heads, dim) view; its bytes are still one run a copy moves whole."""
    expect = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1):
        if stride != expect:
            return False
        expect *= size
    return True


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
    if not dense(t[0]):
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
        return DeviceKVTensor(t.data_ptr(), stride * factor, num_blocks, page * factor, owner=t)
    return DeviceKVTensor(t.data_ptr(), stride, num_blocks, page, owner=t)


def split_parts(name: str, kv: LayerKV, num_blocks: int) -> list[torch.Tensor]:
    """The block-major tensors of one layer: tuple/list elements, or the parts of a tensor."""
    if isinstance(kv, torch.Tensor):
        return block_major_parts(kv, num_blocks)
    if isinstance(kv, (tuple, list)) and kv and all(isinstance(t, torch.Tensor) for t in kv):
        return [p for t in kv for p in split_parts(name, t, num_blocks)]
    raise OffloadConfigError(
        f"KV cache of layer {name!r} is {type(kv).__name__}; allowed: a tensor or a non-empty tuple/list of tensors"
    )


def tensor_segments(t: torch.Tensor, num_blocks: int, name: str = "") -> list[DeviceKVTensor]:
    """Regions of one tensor (its block-major parts)."""
    return [describe(name, p, num_blocks) for p in block_major_parts(t, num_blocks)]


def placement_segments(base: int, nbytes: int, offset: int, layer_stride: int, block_stride: int, num_layers: int,
                       num_blocks: int) -> list[DeviceKVTensor]:
    """Regions of one allocation placed as ``offset + l*layer_stride + b*block_stride``.

    Layer-outermost placements give one region per ``num_blocks * block_stride`` span (a layer,
    or a K/V part of it); block-outermost placements are one region whose block holds every
    layer's page.
    """
    if block_stride <= 0 or num_blocks <= 0 or num_layers <= 0:
        raise OffloadConfigError(
            f"KV placement needs positive block_stride/num_blocks/num_layers, got "
            f"{block_stride}/{num_blocks}/{num_layers}"
        )
    span_blocks = num_blocks * block_stride
    if layer_stride >= span_blocks:
        start, span = offset, num_layers * layer_stride
        n_seg, rem = divmod(span, span_blocks)
        if rem:
            raise OffloadConfigError(
                f"KV placement: {num_layers} layers x layer_stride {layer_stride} is not a multiple of "
                f"{num_blocks} blocks x block_stride {block_stride}"
            )
    else:
        start, span, n_seg = 0, span_blocks, 1
    if start + span > nbytes:
        raise OffloadConfigError(f"KV placement needs {start + span} bytes but the allocation has {nbytes}")
    return [DeviceKVTensor(base + start + i * span_blocks, block_stride, num_blocks, block_stride) for i in range(n_seg)]


# -- many tensors: the one dedupe rule ----------------------------------------------------------


def dedupe(regions: Sequence[DeviceKVTensor]) -> tuple[list[DeviceKVTensor], list[int]]:
    """Distinct regions in first-seen order and, per input, the index of its region.

    Views with the same base and block stride are the same blocks (layers aliasing one tensor):
    one region, the widest page wins. Regions overlapping with different block strides would make
    a load of block ``b`` overwrite bytes of another block: an error."""
    index: dict[tuple[int, int], int] = {}
    out: list[DeviceKVTensor] = []
    where: list[int] = []
    for r in regions:
        key = (r.base, r.block_stride)
        i = index.get(key)
        if i is None:
            i = index[key] = len(out)
            out.append(r)
        elif r.page_bytes > out[i].page_bytes:
            out[i] = r
        where.append(i)
    by_base = sorted(out, key=lambda r: r.base)
    for a, b in zip(by_base, by_base[1:]):
        if b.base < a.end and a.block_stride != b.block_stride:
            raise OffloadConfigError(
                f"KV segments at {a.base:#x} (block stride {a.block_stride}) and {b.base:#x} "
                f"(block stride {b.block_stride}) overlap with different block strides; not supported"
            )
    return out, where


def dedupe_segments(segments: Sequence[DeviceKVTensor]) -> list[DeviceKVTensor]:
    """Distinct regions, by address (the Simple connector's host record order)."""
    return sorted(dedupe(segments)[0], key=lambda r: r.base)


@dataclass
class CanonicalLayout:
    """Distinct device regions and, per layer, the references that copy its blocks."""

    tensors: list[DeviceKVTensor] = field(default_factory=list)
    sources: list[torch.Tensor] = field(default_factory=list)  # one tensor per region (device, dtype)
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


def canonicalize(kv_caches: Mapping[str, LayerKV], num_blocks: int) -> CanonicalLayout:
    """One region per distinct (data_ptr, block stride) and ``GroupRef``s per layer."""
    if num_blocks <= 0:
        raise OffloadConfigError(f"num_blocks must be > 0, got {num_blocks}")
    if not kv_caches:
        raise OffloadConfigError("no KV caches were registered")
    parts = [(name, p, describe(name, p, num_blocks))
             for name, kv in kv_caches.items() for p in split_parts(name, kv, num_blocks)]
    tensors, where = dedupe([d for _, _, d in parts])
    out = CanonicalLayout(tensors, [None] * len(tensors), {name: [] for name in kv_caches})
    for (name, part, d), i in zip(parts, where):
        if out.sources[i] is None:
            out.sources[i] = part
        out.layer_refs[name].append(GroupRef(i, d.page_bytes))
    return out


__all__ = [
    "CanonicalLayout", "DeviceKVTensor", "GroupRef", "LayerKV", "block_major_parts", "canonicalize", "dedupe",
    "dedupe_segments", "describe", "device_platform", "placement_segments", "split_parts", "tensor_segments",
]
