"""Thin vLLM-facing wrappers around one shared ``OffloadWorkerCore``.

vLLM >= 0.25 asks the spec for one ``OffloadingWorker`` (``submit_store`` / ``submit_load``);
0.21-0.24 ask for one ``OffloadingHandler`` per direction, routed by medium pair. Both only
translate vLLM's load/store specs into ``OffloadWorkerCore.submit`` and its results back into
vLLM's ``TransferResult``; the copying itself is the same code on every version. Results come
through a ``ResultRouter``, which keeps the layer-wise loads' own jobs away from vLLM.

A failed copy is submitted again (``RETRIES`` times) before vLLM hears of it: vLLM's
``OffloadingConnector`` (0.21-0.33) asserts that every job succeeded, so a transient failure
reported as such would stop its engine. Retrying is safe: vLLM keeps a job's device blocks and host
chunks reserved until the job is reported, so the same copy can run again.
"""

from __future__ import annotations

import logging

from ..copy.base import Direction
from ..offload_worker import OffloadWorkerCore
from . import compat
from .job_router import ResultRouter

logger = logging.getLogger(__name__)

DIRECTION_NAMES = {Direction.D2H: ("GPU", "CPU"), Direction.H2D: ("CPU", "GPU")}
RETRIES = 2


class Retries:
    """vLLM's jobs in flight (what it takes to submit each again) and the failed ones retried."""

    def __init__(self, core: OffloadWorkerCore):
        self.core = core
        self.jobs: dict[int, list] = {}  # job id -> [direction, gpu spec, cpu spec, retries left]
        self.retried = 0

    def submit(self, job_id: int, direction: Direction, gpu_spec, cpu_spec) -> bool:
        self.jobs[job_id] = [direction, gpu_spec, cpu_spec, RETRIES]
        return submit(self.core, job_id, direction, gpu_spec, cpu_spec)

    def results(self, results) -> list:
        """vLLM's results of ``results``: a failed job with retries left is submitted again instead."""
        out = []
        for r in results:
            job = self.jobs.get(r.job_id)
            if not r.success and job is not None and job[3] > 0:
                job[3] -= 1
                self.retried += 1
                logger.warning("KV offload job %d (%s) failed (%s); submitting it again (%d more tries after this)",
                               r.job_id, r.direction.name, r.error, job[3])
                try:
                    submit(self.core, r.job_id, job[0], job[1], job[2])
                    continue
                except Exception as e:  # noqa: BLE001 - the failure below is reported instead
                    logger.error("KV offload job %d could not be submitted again: %s", r.job_id, e)
            self.jobs.pop(r.job_id, None)
            out.append(r)
        return to_vllm_results(out)


def submit(core: OffloadWorkerCore, job_id: int, direction: Direction, gpu_spec, cpu_spec) -> bool:
    # vLLM names its own KV groups; the core's layer groups (layer-wise mode) come after them, empty here
    pad = [0] * (core.num_groups - len(gpu_spec.group_sizes))
    core.submit(
        job_id,
        direction,
        gpu_spec.block_ids,
        list(gpu_spec.group_sizes) + pad,
        list(gpu_spec.block_indices) + pad,
        cpu_spec.block_ids,
    )
    return True


def to_vllm_results(results) -> list:
    out = []
    for r in results:
        if not r.success:
            logger.error("KV offload job %d (%s) failed: %s", r.job_id, r.direction.name, r.error)
        name = DIRECTION_NAMES[r.direction]
        out.append(compat.make_transfer_result(r.job_id, r.success, r.num_bytes, r.seconds, name))
    return out


class NPUOffloadingWorker(compat.OffloadingWorker or object):
    """vLLM >= 0.25: both directions through one worker object."""

    def __init__(self, router: ResultRouter):
        self.router = router
        self.core = router.core
        self.retries = Retries(self.core)

    def submit_store(self, job_id, src_spec, dst_spec) -> bool:
        return self.retries.submit(job_id, Direction.D2H, src_spec, dst_spec)

    def submit_load(self, job_id, src_spec, dst_spec, *args, **kwargs) -> bool:
        return self.retries.submit(job_id, Direction.H2D, dst_spec, src_spec)

    def get_finished(self) -> list:
        return self.retries.results(self.router.poll())

    def wait(self, job_ids) -> None:
        self.core.wait(job_ids)

    def shutdown(self) -> None:
        self.core.shutdown()


class NPUTransferHandler(compat.OffloadingHandler or object):
    """vLLM 0.21-0.24: one direction of a core shared with the other direction's handler;
    ``get_finished`` returns only this direction's jobs (the core keeps the other's)."""

    def __init__(self, router: ResultRouter, direction: Direction):
        self.router = router
        self.core = router.core
        self.direction = direction
        self.retries = Retries(self.core)

    def transfer_async(self, job_id: int, spec) -> bool:
        src, dst = spec
        gpu, cpu = (src, dst) if self.direction is Direction.D2H else (dst, src)
        return self.retries.submit(job_id, self.direction, gpu, cpu)

    def get_finished(self) -> list:
        return self.retries.results(self.router.poll(self.direction))

    def wait(self, job_ids) -> None:
        self.core.wait(job_ids)

    def shutdown(self) -> None:
        self.core.shutdown()


def handler_pair(router: ResultRouter) -> tuple[NPUTransferHandler, NPUTransferHandler]:
    """(store handler, load handler) over one core."""
    return NPUTransferHandler(router, Direction.D2H), NPUTransferHandler(router, Direction.H2D)


__all__ = ["NPUOffloadingWorker", "NPUTransferHandler", "RETRIES", "Retries", "handler_pair"]
