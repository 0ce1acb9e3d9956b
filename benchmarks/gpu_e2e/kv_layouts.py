"""The KV layouts the GPU yardstick runs: what vLLM 0.23 hands a connector, per model and connector.

Read from vLLM 0.23.0's source (docs/gpu_e2e.md, "What vLLM 0.23 hands the connector"):

- ``uniform``: an 8B Llama on TRITON_ATTN with ``OffloadingConnector`` (``prefer_cross_layer_blocks``
  True, one KV-cache group, a stride order with a layers dimension) gets **cross-layer blocks**: one
  page of all 32 layers per 16-token engine block (2 MiB per 64-token offloaded block).
- ``perlayer``: the same model through ``PerLayerOffloadingConnector`` (perlayer.py): one tensor per
  layer, K and V registered apart, as on Ascend: 2 x 32 pages of 32 KiB per engine block.
- ``multigroup``: a Gemma-2-9B shape (sliding window and global layers). ``OffloadingConnector`` is
  ``SupportsHMA`` on 0.23, so the hybrid allocator stays on: two KV-cache groups, no cross-layer
  layout (that needs one group), one page of K+V per layer: 42 pages of 128 KiB per engine block,
  and a sliding-window group loads only the blocks inside its window.
- ``mla``: a DeepSeek-V2-Lite shape with dense MLPs. MLA backends keep ``num_layers`` first in their
  stride order (no cross-layer layout): 27 pages of 18 KiB per engine block. Decode runs on
  TRITON_MLA (FlashMLA is stripped); prefill on SM90 needs FlashAttention (FA3), which the staged
  wheel keeps for this (stage.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from .models import SHAPES, Shape

PERLAYER_MODULE = "benchmarks.gpu_e2e.perlayer"  # perlayer.MODULE (a string: importing it imports vLLM)


@dataclass(frozen=True)
class Layout:
    name: str
    shape: str  # models.SHAPES key
    connector: tuple[str, str] | None  # replaces OffloadingConnector for native/ours/null
    attention_backend: str | None  # None: the run's --attention-backend
    fp32: bool  # the correctness part can run float32 (MLA's kernels are bf16/fp16 only)
    blocks: str  # what a block is to the connector
    kv_groups: int = 1  # KV-cache groups vLLM makes (layer-wise loads need one)

    @property
    def layerwise(self) -> bool:
        """The ``layerwise`` kind runs on this layout (NPUOffloadingConnector refuses several groups)."""
        return self.kv_groups == 1

    @property
    def model(self) -> Shape:
        return SHAPES[self.shape]

    def backend(self, default: str) -> str:
        return self.attention_backend or default


LAYOUTS: dict[str, Layout] = {
    "uniform": Layout("uniform", "llama8b", None, None, True,
                      "vLLM's own placement (OffloadingConnector prefers cross-layer blocks; the engines' "
                      "'cross-layer blocks' line says whether vLLM allocated them: on 0.23 + TRITON_ATTN it did "
                      "not, so 32 pages of 64 KiB (a layer's K and V, HND) per engine block)"),
    "perlayer": Layout("perlayer", "llama8b", ("PerLayerOffloadingConnector", PERLAYER_MODULE), None, True,
                       "per layer, K and V apart (Ascend's layout): 64 pages of 32 KiB per engine block"),
    "multigroup": Layout("multigroup", "gemma2_9b", None, None, True,
                         "2 KV-cache groups (sliding window + global), per layer: 42 pages of 128 KiB per engine block",
                         kv_groups=2),
    "mla": Layout("mla", "dsv2_lite", None, "TRITON_MLA", False,
                  "MLA, per layer (no cross-layer layout for MLA): 27 pages of 18 KiB per engine block"),
}


def parse_layouts(text: str) -> list[str]:
    """"uniform,perlayer" -> names in LAYOUTS order; unknown names raise ValueError."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if names == ["all"]:
        return list(LAYOUTS)
    bad = [n for n in names if n not in LAYOUTS]
    if bad or not names:
        raise ValueError(f"unknown layout(s) {bad or text!r}: choose from {list(LAYOUTS)} or 'all'")
    return [n for n in LAYOUTS if n in names]


__all__ = ["LAYOUTS", "Layout", "parse_layouts"]
