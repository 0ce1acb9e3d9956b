"""The one place that knows which vLLM offloading API generation is installed.

- ``"config"`` (vLLM >= 0.26): ``OffloadingSpec(config: OffloadingConfig)``, ``get_worker()``
  returning an ``OffloadingWorker`` with ``submit_store`` / ``submit_load``.
- ``"worker"`` (vLLM 0.25): ``OffloadingSpec(vllm_config, kv_cache_config)`` with ``get_worker()``.
- ``"handlers"`` (vLLM 0.21-0.24): ``OffloadingSpec(vllm_config, kv_cache_config)`` with
  ``get_handlers()`` yielding per-direction ``OffloadingHandler`` objects.
"""

from __future__ import annotations

import importlib.util
import inspect

import vllm
from vllm.v1.kv_offload import base as _base

VLLM_VERSION = getattr(vllm, "__version__", "unknown")

if importlib.util.find_spec("vllm.v1.kv_offload.config") is not None:
    API = "config"
elif hasattr(_base, "OffloadingWorker") and inspect.isabstract(getattr(_base, "OffloadingWorker")):
    API = "worker"
else:
    API = "handlers"

OffloadingSpec = _base.OffloadingSpec
GPULoadStoreSpec = _base.GPULoadStoreSpec
CanonicalKVCaches = _base.CanonicalKVCaches

if API == "handlers":
    from vllm.v1.kv_offload.worker.worker import OffloadingHandler, TransferResult  # noqa: F401

    OffloadingWorker = None
else:
    from vllm.v1.kv_offload.base import OffloadingWorker, TransferResult  # noqa: F401

    OffloadingHandler = None

from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec  # noqa: E402
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec  # noqa: E402


def registered_cache_policies() -> tuple[str, ...]:
    try:
        from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory

        return tuple(CachePolicyFactory._registry)
    except Exception:  # older layouts: the two built-ins
        return ("lru", "arc")


def make_transfer_result(job_id: int, success: bool, num_bytes: int, seconds: float, direction_name: tuple | None):
    if API == "handlers":
        return TransferResult(job_id, success, num_bytes, seconds, direction_name)
    return TransferResult(job_id=job_id, success=success, transfer_size=num_bytes, transfer_time=seconds)
