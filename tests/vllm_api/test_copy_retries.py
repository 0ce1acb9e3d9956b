"""A failed copy is submitted again before vLLM hears of it (vLLM's OffloadingConnector asserts that
every job succeeded); only a copy that fails every time is reported failed."""

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm_npu_offload.copy.base import Direction  # noqa: E402
from vllm_npu_offload.integration.workers import RETRIES, Retries  # noqa: E402


class Core:
    num_groups = 1

    def __init__(self):
        self.submits = []

    def submit(self, job_id, direction, dev, sizes, idx, host):
        self.submits.append((job_id, direction, list(dev), list(host)))


def result(job_id, ok):
    return SimpleNamespace(job_id=job_id, direction=Direction.H2D, success=ok, num_bytes=64 if ok else 0,
                           seconds=0.001, error=None if ok else "copy failed")


def spec(ids):
    return SimpleNamespace(block_ids=ids, group_sizes=[len(ids)], block_indices=[0])


def test_a_failed_copy_is_retried_then_reported():
    core = Core()
    r = Retries(core)
    r.submit(7, Direction.H2D, spec([3, 4]), spec([1]))
    assert r.results([result(7, False)]) == []  # submitted again instead
    assert core.submits[-1] == (7, Direction.H2D, [3, 4], [1]) and len(core.submits) == 2
    (ok,) = r.results([result(7, True)])
    assert ok.success and r.retried == 1 and 7 not in r.jobs
    r.submit(8, Direction.H2D, spec([5]), spec([2]))
    for _ in range(RETRIES):
        assert r.results([result(8, False)]) == []
    (bad,) = r.results([result(8, False)])
    assert not bad.success and len(core.submits) == 2 + 1 + RETRIES and 8 not in r.jobs
