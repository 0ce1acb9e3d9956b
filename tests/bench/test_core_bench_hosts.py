"""The core benchmarks' host chunk orders: ``rev`` (vLLM's order for reused chunks) plans into as
few link copies as ``seq``, and an unknown order names the allowed ones."""

import numpy as np
import pytest
import torch

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


def test_core_bench_runs_on_cpu_and_splits_the_fixed_cost(tmp_path):
    """One small shape through ``core_bench.run`` on the CPU platform: every host order gets a row,
    and each mode's fixed cost is split into outside / inside the device span, which add up to the
    whole transfer's time beyond the link time."""
    from benchmarks import core_bench

    lines: list[str] = []
    report = core_bench.run("cpu", ["tiny-1k"], reps=2, json_path=str(tmp_path / "core.json"), printer=lines.append)
    rows = report["shapes"][0]["rows"]
    assert sorted({r["host"] for r in rows}) == sorted(HOSTS) and {r["dir"] for r in rows} == {"H2D", "D2H"}
    for r in rows:
        whole_s = r["bytes"] / (r["direct_gbps"] * 1e9)
        link_s = r["bytes"] / (r["contiguous_gbps"] * 1e9)
        split = (r["direct_outside_us"] + r["direct_inside_us"]) * 1e-6
        assert split == pytest.approx(whole_s - link_s, rel=1e-6, abs=1e-9)
    assert "outside" in "\n".join(lines) and (tmp_path / "core.json").exists()


def test_issue_22_shapes_reach_16_mib_and_pad_where_asked(monkeypatch):
    """The shapes issue #22 names beyond 2 / 4 KiB pages: at the documented block counts each transfer is
    16 MiB or more; the 3.5 KiB shape's device blocks sit 4 KiB apart, and a core round-trips it byte-exact."""
    from benchmarks.core_bench import shape_named

    for name in ("mla-deepseek-fp8@30", "hd80-2.5k@103", "hd112-3.5k-stride4k@74", "mixed-16k-2k@29"):
        s = shape_named(name)
        assert s.blocks * s.record_bytes >= 16 << 20, name
    s = shape_named("hd112-3.5k-stride4k@4")
    kv = s.device_kv(8, "cpu")
    assert all(t.shape == (8, 3584) and t.stride(0) == 4096 for t in kv) and len(kv) == 64
    monkeypatch.setenv("NPU_OFFLOAD_STAGED", "1")  # the CPU platform stages only when asked
    rig = CoreRig(CpuPlatform(), s)
    dev, chunks = rig.ids("seq", seed=0)
    for t in rig.kv:
        t.random_(0, 256)
    before = [t[dev].clone() for t in rig.kv]
    rig.transfer(Direction.D2H, dev, chunks, staged=True)
    rig.finish()
    for t in rig.kv:
        t.zero_()
    rig.transfer(Direction.H2D, dev, chunks, staged=True)
    rig.finish()
    assert all(torch.equal(t[dev], b) for t, b in zip(rig.kv, before))
    rig.close()
