"""``NullCopySpec``: vLLM's own CPU offloading spec with copies that cost nothing (benchmark only).

Why: the no-reuse target asks how much slower a batch runs with offload on than off. Part of
that is vLLM's ``OffloadingConnector`` itself (its scheduler side, ``CPUOffloadingManager``,
the worker hooks in every step), which any spec pays. This spec keeps all of that, the
manager and its sizing exactly as vLLM's native ``CPUOffloadingSpec``, and replaces the
copies with nothing: a store is reported done at the next poll, having moved no byte. So
"null vs off" is the framework's price, and "ours vs null" is what our copies add.

Loads would hand the model bytes that were never stored, so they are refused with an error
(vLLM 0.23 asserts on a failed job, so the engine stops: never a wrong token). Use it only
where nothing is reused, as in the e2e miss part.
"""

from __future__ import annotations

from vllm_npu_offload.integration import compat

NULL_MODULE = __name__


class NullCopyError(RuntimeError):
    pass


class _NullCopies:
    """Finishes every store at the next poll; refuses every load."""

    def __init__(self):
        self.done: list = []
        self.stores = 0

    def store(self, job_id: int, direction_name: tuple) -> bool:
        self.stores += 1
        self.done.append(compat.make_transfer_result(job_id, True, 0, 0.0, direction_name))
        return True

    @staticmethod
    def load(job_id: int) -> bool:
        raise NullCopyError(f"NullCopySpec was asked to load job {job_id}; it stores no bytes, so it is "
                            "only for runs where nothing is reused (the e2e miss part)")

    def take(self) -> list:
        out, self.done = self.done, []
        return out


class NullStoreHandler(compat.OffloadingHandler or object):
    """vLLM 0.21-0.24, GPU -> CPU."""

    def __init__(self, copies: _NullCopies):
        self.copies = copies

    def transfer_async(self, job_id: int, spec) -> bool:
        return self.copies.store(job_id, ("GPU", "CPU"))

    def get_finished(self) -> list:
        return self.copies.take()

    def wait(self, job_ids) -> None:
        return None


class NullLoadHandler(compat.OffloadingHandler or object):
    """vLLM 0.21-0.24, CPU -> GPU: refused."""

    def __init__(self, copies: _NullCopies):
        self.copies = copies

    def transfer_async(self, job_id: int, spec) -> bool:
        return self.copies.load(job_id)

    def get_finished(self) -> list:
        return []

    def wait(self, job_ids) -> None:
        return None


class NullWorker(compat.OffloadingWorker or object):
    """vLLM >= 0.25, both directions."""

    def __init__(self, copies: _NullCopies | None = None):
        self.copies = copies or _NullCopies()

    def submit_store(self, job_id, src_spec, dst_spec) -> bool:
        return self.copies.store(job_id, ("GPU", "CPU"))

    def submit_load(self, job_id, src_spec, dst_spec, *args, **kwargs) -> bool:
        return self.copies.load(job_id)

    def get_finished(self) -> list:
        return self.copies.take()

    def wait(self, job_ids) -> None:
        return None


class NullCopySpec(compat.CPUOffloadingSpec):
    """vLLM's ``CPUOffloadingSpec`` (same config keys, same manager) without host memory or copies."""

    _null: _NullCopies | None = None

    def _copies(self) -> _NullCopies:
        if self._null is None:
            self._null = _NullCopies()
        return self._null

    def get_handlers(self, kv_caches):
        copies = self._copies()
        yield compat.GPULoadStoreSpec, compat.CPULoadStoreSpec, NullStoreHandler(copies)
        yield compat.CPULoadStoreSpec, compat.GPULoadStoreSpec, NullLoadHandler(copies)

    def get_worker(self, kv_caches):
        return NullWorker(self._copies())


__all__ = ["NULL_MODULE", "NullCopyError", "NullCopySpec", "NullLoadHandler", "NullStoreHandler", "NullWorker"]
