"""benchmarks/gpu_e2e/ranks.py: per-rank worker reports, in-process and through a fake collective RPC,
over a real worker core on the CPU platform."""

import numpy as np
import pytest
import torch

from benchmarks.gpu_e2e import ranks
from vllm_npu_offload.copy.base import Direction
from vllm_npu_offload.device_kv import DeviceKVTensor, GroupRef
from vllm_npu_offload.offload_worker import OffloadWorkerCore
from vllm_npu_offload.platform import CpuPlatform
from vllm_npu_offload.stats import TOTALS


class _Worker:
    def __init__(self, rank):
        self.rank = rank


class _FakeLLM:
    """``collective_rpc`` as vLLM's: the callable gets each rank's worker first, then the kwargs."""

    def __init__(self, n):
        self.workers = [_Worker(r) for r in range(n)]

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        return [method(w, *args, **(kwargs or {})) for w in self.workers]


@pytest.fixture
def core():
    tensors = [torch.randint(0, 256, (16, 64), dtype=torch.uint8) for _ in range(2)]
    c = OffloadWorkerCore([DeviceKVTensor.from_block_view(t) for t in tensors], [[GroupRef(0, 64), GroupRef(1, 64)]],
                          1, 8, CpuPlatform())
    yield c
    c.shutdown()


def _store(core, job=1):
    core.submit(job, Direction.D2H, np.array([3, 4]), [2], [0], np.array([5, 6]))
    core.wait([job])
    assert all(r.success for r in core.poll())


def test_on_ranks_in_process_and_through_rpc():
    seen = []
    fn = lambda worker, x: seen.append((ranks.rank_of(worker), x)) or x * 2  # noqa: E731
    assert ranks.on_ranks(object(), 1, fn, x=3) == [6] and seen == [(0, 3)]
    seen.clear()
    assert ranks.on_ranks(_FakeLLM(2), 2, fn, x=5) == [10, 10] and seen == [(0, 5), (1, 5)]


def test_sum_totals_adds_counts_and_averages_times():
    a = {"load": {"bytes": 10, "jobs": 1, "seconds": 0.4}, "store": {"bytes": 4, "jobs": 2, "wall_seconds": 1.0}}
    b = {"load": {"bytes": 5, "jobs": 1, "seconds": 0.2}, "store": {"bytes": 0, "jobs": 0, "wall_seconds": 0.0}}
    got = ranks.sum_totals([a, b])
    assert got["load"]["bytes"] == 15 and got["load"]["jobs"] == 2 and got["load"]["seconds"] == pytest.approx(0.3)
    assert got["store"] == {"bytes": 4, "jobs": 2, "wall_seconds": 0.5}
    assert ranks.sum_totals([a]) == a  # one rank: unchanged


def test_worker_info_and_totals_of_a_live_core(core):
    before = ranks.totals()["store"]["bytes"]
    _store(core)
    assert ranks.totals()["store"]["bytes"] - before == 2 * 128 == TOTALS.snapshot()[1].bytes - before
    mine = [c for c in ranks.worker_info(_Worker(1))["cores"] if c["host_bytes"] == core.host.nbytes]
    assert mine and mine[0]["rank"] == 1 and mine[0]["groups"] == [2] and mine[0]["page_bytes"] == [64]
    nodes = mine[0]["host_page_nodes"]  # the host buffer is zeroed at start: every sampled page resident
    assert sum(nodes.values()) >= 1 and -1 not in nodes
    assert "NUMA" in mine[0]["numa"] and mine[0]["numa_info"]


def test_corrupt_page_changes_every_stored_block_of_region_0(core, monkeypatch):
    monkeypatch.setattr("vllm_npu_offload.offload_worker.live_workers", lambda: [core])
    assert ranks.corrupt_page(None)["why"] == "host region 0 is all zeros"
    _store(core)
    view = core.host_view(0)
    before = view.clone()
    r = ranks.corrupt_page(_Worker(1), seed=3)
    assert r["ok"] and r["rank"] == 1 and r["blocks"] == 2
    assert not torch.equal(view[5], before[5]) and not torch.equal(view[6], before[6])
    assert torch.equal(view[0], before[0])  # never stored: untouched
    per = ranks.on_ranks(_FakeLLM(2), 2, ranks.corrupt_page, seed=0)
    assert [p["rank"] for p in per] == [0, 1] and all(p["ok"] for p in per)
