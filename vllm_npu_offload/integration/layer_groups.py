"""A KV-cache group's layers cut into consecutive layer groups, for layer-wise loads.

The worker core gets each layer group as one more group over the same device blocks and host
chunks (``OffloadWorkerCore`` groups after vLLM's own): a layer-wise load submits one transfer per
layer group, and the compute stream waits, before a layer's attention, for the transfer of the group
holding that layer. vLLM's stores and asynchronous loads keep naming vLLM's own group, so they copy
what they copied before. Pure Python (no vLLM), so it is tested directly.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping, Sequence

from ..device_kv import GroupRef
from ..errors import OffloadConfigError

_INDEX = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


@dataclass(frozen=True)
class LayerGroups:
    """``of_layer``: layer name -> layer group; ``refs``: per layer group, its layers' KV pages."""

    of_layer: Mapping[str, int]
    refs: tuple[tuple[GroupRef, ...], ...]

    @property
    def count(self) -> int:
        return len(self.refs)


def _execution_order(layer_names: Sequence[str]) -> list[int]:
    """Positions of ``layer_names`` in the order the model runs them: by the layer index in the name
    (``model.layers.12.self_attn.attn``) where every name has one, else as listed."""
    found = [_INDEX.search(n) for n in layer_names]
    if not all(found):
        return list(range(len(layer_names)))
    return sorted(range(len(layer_names)), key=lambda i: (int(found[i].group(1)), i))


def split_layer_groups(layer_names: Sequence[str], refs: Sequence[GroupRef], groups: int) -> LayerGroups:
    """Cut one KV group's layers into ``groups`` consecutive layer groups of (nearly) equal size.

    ``refs`` are the KV group's pages as the worker core gets them: each layer's pages in turn, in
    ``layer_names`` order (one per layer for vLLM's tensors, K and V for Ascend's tuples). A page
    that holds several layers (a cross-layer block) cannot be split, so that is an error.
    """
    n = len(layer_names)
    if n == 0:
        raise OffloadConfigError("layer-wise load: the KV-cache group has no layers")
    if groups <= 0:
        raise OffloadConfigError(f"kv_connector_extra_config['layerwise_groups']={groups} must be a positive integer")
    if len(refs) < n or len(refs) % n:
        raise OffloadConfigError(
            f"kv_connector_extra_config['layerwise_load']: the KV-cache group has {len(refs)} KV pages per block "
            f"for {n} layers, so a layer's pages cannot be told apart (a page holding several layers, e.g. a "
            f"cross-layer KV layout, cannot be loaded layer by layer); set 'layerwise_load' to false for this model"
        )
    per = len(refs) // n
    order = _execution_order(layer_names)
    g = min(groups, n)
    of_layer: dict[str, int] = {}
    out: list[tuple[GroupRef, ...]] = []
    for j in range(g):
        seen: dict[int, GroupRef] = {}
        for pos in order[j * n // g:(j + 1) * n // g]:
            of_layer[layer_names[pos]] = j
            for ref in refs[pos * per:(pos + 1) * per]:
                seen.setdefault(ref.tensor_idx, ref)  # layers sharing a tensor load it once
        out.append(tuple(seen.values()))
    return LayerGroups(of_layer, tuple(out))


__all__ = ["LayerGroups", "split_layer_groups"]
