"""The core benchmarks' host chunk orders: ``rev`` (vLLM's order for reused chunks) plans into as
few link copies as ``seq``, and an unknown order names the allowed ones."""

import numpy as np
import pytest

from benchmarks.core_bench import HOSTS, CoreRig, KVShape, host_chunks
from vllm_npu_offload import staging
from vllm_npu_offload.copy.base import Direction
from vllm_npu_offload.platform import CpuPlatform


def test_rev_is_a_descending_run():
    rev = host_chunks(np.random.default_rng(0), "rev", 5, 40)
    assert (np.diff(rev) == -1).all() and 0 <= rev.min() and rev.max() < 40
    with pytest.raises(ValueError, match="'back'.*random, seq, rev"):
        host_chunks(np.random.default_rng(0), "back", 5, 40)


def test_rev_plans_as_few_link_copies_as_seq(monkeypatch):
    monkeypatch.setenv("NPU_OFFLOAD_STAGED", "1")
    monkeypatch.setattr(staging, "MIN_SLOT_BYTES", 0)
    rig = CoreRig(CpuPlatform(), KVShape("t", (1024,) * 8, blocks=24), staging_bytes=1 << 20)
    try:
        links = {}
        for host in HOSTS:
            dev, chunks = rig.ids(host, seed=7)
            for d in Direction:
                plan = rig.core.plan(d, dev, [len(dev)], [0], chunks, staged=True).plan
                links[host, d] = (len(plan.link), plan.num_slices)
                rig.core.pool.release(plan.buffers)
        for d in Direction:
            assert links["rev", d] == links["seq", d] and links["seq", d][0] == links["seq", d][1]  # a run per slice
            assert links["random", d][0] > links["seq", d][0]
    finally:
        rig.close()
