"""The benchmark's NullCopySpec on the installed vLLM (0.32 here: the OffloadingWorker API)."""

import pytest

pytestmark = pytest.mark.vllm


def test_null_worker_finishes_stores_and_refuses_loads():
    from benchmarks.gpu_e2e.null_spec import NullCopyError, NullCopySpec, NullWorker
    from vllm_npu_offload.integration import compat

    assert issubclass(NullCopySpec, compat.CPUOffloadingSpec)
    w = NullWorker()
    if compat.OffloadingWorker is not None:
        assert isinstance(w, compat.OffloadingWorker)
    assert w.submit_store(3, None, None) and w.submit_store(4, None, None)
    done = w.get_finished()
    assert [(r.job_id, r.success) for r in done] == [(3, True), (4, True)]
    assert w.get_finished() == []  # each result is reported once
    with pytest.raises(NullCopyError, match="load job 5"):
        w.submit_load(5, None, None)
