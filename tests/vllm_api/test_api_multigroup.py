"""Two KV-cache groups (full attention and a sliding window on alternating layers, as Gemma-2)
through the installed vLLM's real scheduler and NPUOffloadingSpec (CPU tensors, no model): each
group's blocks are stored under that group's offload keys, the host records are group-major (a
group's pages are one span), and after the device KV and prefix cache are wiped every loaded block
equals what was stored, byte for byte, group by group."""

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from harness import BLOCK, HEAD, HEADS, NB, PAGE, PROMPT, Engine, placed_layers, vllm_config  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    SlidingWindowSpec,
)

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
GROUPS = [LAYERS[0::2], LAYERS[1::2]]  # full attention on even layers, sliding window on odd ones

pytestmark = pytest.mark.skipif(placed_layers, reason="per-layer KVCacheTensors (vLLM 0.21-0.28) only, for now")


def two_group_config() -> KVCacheConfig:
    spec = dict(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32)
    return KVCacheConfig(
        num_blocks=NB,
        kv_cache_tensors=[KVCacheTensor(size=NB * PAGE, shared_by=[n]) for n in LAYERS],
        kv_cache_groups=[KVCacheGroupSpec(GROUPS[0], FullAttentionSpec(**spec)),
                         KVCacheGroupSpec(GROUPS[1], SlidingWindowSpec(**spec, sliding_window=4096))],
    )


@pytest.mark.parametrize("staged", ["0", "1"])
def test_two_groups_store_and_load_byte_exact(tiny_model, monkeypatch, staged):
    """``staged``: NPU_OFFLOAD_STAGED (1: every transfer through the staging pipeline, as on a device)."""
    monkeypatch.setenv("NPU_OFFLOAD_STAGED", staged)
    vc = vllm_config(tiny_model, {"cpu_bytes_to_use": 64 * PAGE * len(LAYERS)})
    g = torch.Generator().manual_seed(3)
    caches = {n: torch.randn(NB, 2, BLOCK, HEADS, HEAD, generator=g) for n in LAYERS}
    eng = Engine.build(vc, two_group_config(), caches, OffloadingConnector)
    core = eng.core
    assert core.num_groups == 2 and (core.stager is not None) == (staged == "1")
    spans = [core.layout.group_span([r.tensor_idx for r in refs]) for refs in core.group_refs]
    assert spans[0][1] <= spans[1][0]  # group-major records: the full-attention pages first, apart
    sizes = []  # group sizes of every job, recorded beside the harness's job log
    submit = core.submit
    core.submit = lambda job, d, dev, gs, bi, ch, *a: (sizes.append(list(gs)), submit(job, d, dev, gs, bi, ch, *a))[1]
    eng.run(PROMPT)
    stores = [(j, s) for j, s in zip(eng.jobs, sizes) if j.direction.name == "D2H"]
    assert stores and all(s[0] and s[1] for _, s in stores)  # both groups stored

    def by_group(job, gs):
        """(group, device block) of each block of a job, in its order."""
        return [(gi, b) for gi, n, blocks in zip(range(2), gs, (job.device_blocks[:gs[0]], job.device_blocks[gs[0]:]))
                for b in blocks[:n]]

    stored = {}  # (group, key order) -> bytes of that group's layers
    for job, gs in stores:
        for k, (gi, b) in enumerate(by_group(job, gs)):
            stored.setdefault(gi, []).append(torch.stack([caches[n][b].clone() for n in GROUPS[gi]]))
    n_store = len(eng.jobs)
    for t in caches.values():
        t.zero_()
    eng.reset_device_prefix_cache()
    eng.run(PROMPT)
    loads = [(j, s) for j, s in zip(eng.jobs[n_store:], sizes[n_store:]) if j.direction.name == "H2D"]
    assert loads, "nothing was loaded from host"
    got = {}
    for job, gs in loads:
        for gi, b in by_group(job, gs):
            got.setdefault(gi, []).append(torch.stack([caches[n][b] for n in GROUPS[gi]]))
    for gi in (0, 1):
        assert len(got.get(gi, [])) == len(stored[gi]), gi
        for k, (a, w) in enumerate(zip(got[gi], stored[gi])):
            assert torch.equal(a, w), (gi, k)
