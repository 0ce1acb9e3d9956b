"""Allocate KV parts the way vLLM-Ascend does: 2 MiB-aligned slices of one buffer (storage offset != 0)."""

import numpy as np
import torch

ALIGN = 2 << 20


class Arena:
    def __init__(self, nbytes: int):
        self.buf = torch.randint(0, 256, (nbytes + 2 * ALIGN,), dtype=torch.uint8)
        self.pristine = self.buf.clone()
        self.pos = 4096 + (-(self.buf.data_ptr() + 4096)) % ALIGN  # never at offset 0
        self.used: list[tuple[int, int]] = []

    def tensor(self, shape, dtype=torch.float32) -> torch.Tensor:
        n = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
        t = self.buf[self.pos : self.pos + n].view(dtype).view(shape)
        assert t.data_ptr() % ALIGN == 0 and t.storage_offset() != 0
        self.used.append((self.pos, n))
        self.pos += n + (-(self.buf.data_ptr() + self.pos + n)) % ALIGN
        return t

    def outside_untouched(self) -> bool:
        mask = torch.ones_like(self.buf, dtype=torch.bool)
        for p, n in self.used:
            mask[p : p + n] = False
        return bool(torch.equal(self.buf[mask], self.pristine[mask]))


def build_worker_core(kv_caches, num_blocks: int, blocks_per_chunk: int, num_chunks: int, groups=None, backend=None):
    """An ``OffloadWorkerCore`` for per-layer caches, canonicalised as NPUOffloadingConnector does;
    ``groups`` lists layer names per KV group (default: one group of every layer)."""
    from vllm_npu_offload.device_kv import canonicalize, device_platform
    from vllm_npu_offload.offload_worker import OffloadWorkerCore

    layout = canonicalize(kv_caches, num_blocks)
    group_refs = [layout.group_refs(g) for g in (groups if groups is not None else [None])]
    return OffloadWorkerCore(layout.tensors, group_refs, blocks_per_chunk, num_chunks,
                             device_platform(layout.sources), backend)
