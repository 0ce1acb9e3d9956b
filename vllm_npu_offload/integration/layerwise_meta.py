"""What layer-wise loads add to the offloading connector's metadata, both ways.

Scheduler -> workers: which of the step's load jobs load layer by layer (``layerwise_jobs``).
Workers -> scheduler: which of those each worker finished (``layerwise_done``, summed over workers
like upstream's ``completed_jobs``). Kept apart from upstream's fields: upstream's scheduler would
complete such a job through ``completed_jobs`` (it is no longer in its books) and its worker would
put the request in ``finished_recving`` (an AssertionError for a running request).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
)


def _fields(meta) -> dict:
    return {f.name: getattr(meta, f.name) for f in dataclasses.fields(meta)}


@dataclass
class LayerwiseConnectorMetadata(OffloadingConnectorMetadata):
    layerwise_jobs: frozenset[int] = frozenset()

    @classmethod
    def extend(cls, meta: OffloadingConnectorMetadata, jobs) -> "LayerwiseConnectorMetadata":
        return cls(**_fields(meta), layerwise_jobs=frozenset(jobs))


@dataclass
class LayerwiseWorkerMetadata(OffloadingWorkerMetadata):
    layerwise_done: dict[int, int] = field(default_factory=dict)

    @classmethod
    def extend(cls, meta: OffloadingWorkerMetadata | None, done) -> "LayerwiseWorkerMetadata":
        """``meta`` (upstream's, or None) plus ``done`` (job -> workers that finished it)."""
        base = _fields(meta) if meta is not None else {}
        base.pop("layerwise_done", None)
        return cls(**base, layerwise_done=dict(done))

    def aggregate(self, other) -> "LayerwiseWorkerMetadata":
        done = dict(self.layerwise_done)
        for job, count in getattr(other, "layerwise_done", {}).items():
            done[job] = done.get(job, 0) + count
        return self.extend(super().aggregate(other), done)


__all__ = ["LayerwiseConnectorMetadata", "LayerwiseWorkerMetadata"]
