"""The Ascend copy paths (``acl_batch``, ``acl_loop``), the chooser and the staged pair (``PATHS``).

Imported by ``copy.backend`` the first time an NPU platform is used. The choice
is made once: the batch path when it was compiled in and libascendcl exports
``aclrtMemcpyBatchAsync`` (or its V2 form), else the per-copy loop, for both directions
(ACL batches have no access-order option, so loads and stores use the same call).
``local_path`` gives the device->device path of staged copies, chosen the same way.
"""

from __future__ import annotations

import logging

from ..platform import Platform
from .._native import acl
from . import acl_copy
from .base import BackendChoice, CopyPath, PlatformPaths

logger = logging.getLogger(__name__)


def _batch_path(platform: Platform, page_sizes: list[int]) -> acl_copy.AclCopyPath:
    if acl.build_mode() != "batch":
        raise RuntimeError(
            "copy path 'acl_batch' was not built (VLLM_ASCEND_ENABLE_BATCH_MEMCPY=0 or headers without "
            "aclrtMemcpyBatchAsync); use 'acl_loop' or rebuild with VLLM_ASCEND_ENABLE_BATCH_MEMCPY=1"
        )
    return acl_copy.AclCopyPath(platform, batch=True)


def _loop_path(platform: Platform, page_sizes: list[int]) -> acl_copy.AclCopyPath:
    return acl_copy.AclCopyPath(platform, batch=False)


def choose(platform: Platform, page_sizes: list[int], measure: tuple = ()) -> BackendChoice:
    """Batch when built and resolvable at run time, else loop (nothing is measured)."""
    acl.load_library()  # ImportError with build instructions when it is missing
    if acl.build_mode() == "batch":
        form, why = acl.batch_form()
        if form:
            return BackendChoice("acl_batch", "acl_batch")
        logger.warning("acl_batch unavailable at run time (%s); using the aclrtMemcpyAsync loop", why)
    return BackendChoice("acl_loop", "acl_loop")


def local_path(platform: Platform) -> CopyPath:
    """The device->device path for staged copies (page gather / scatter via a device staging
    buffer): ``acl_batch_local`` when ``choose`` would pick ``acl_batch``, else ``acl_loop_local``."""
    batch = choose(platform, []).load == "acl_batch"
    return acl_copy.AclCopyPath(platform, batch=batch, device_local=True)




def staged_npu(platform: Platform, page_sizes: list[int]) -> tuple[CopyPath, CopyPath]:
    """Gather/scatter as ACL device-to-device copies, the few large host copies on the same call."""
    local = local_path(platform)
    return local, acl_copy.AclCopyPath(platform, batch=local.batch)


PATHS = PlatformPaths(paths={"acl_batch": _batch_path, "acl_loop": _loop_path}, choose=choose, staged=staged_npu)
