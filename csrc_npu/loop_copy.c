/*
 * Loop path: one aclrtMemcpyAsync per descriptor. Works on every CANN version and
 * chip; each call costs a few microseconds of host time, which the batch path avoids.
 */
#include <stdint.h>

#include "npu_offload_acl.h"

NPU_OFFLOAD_API int npu_offload_acl_copy_loop(const int64_t *src, const int64_t *dst, const int64_t *sizes,
                                              int64_t n, int direction, void *stream,
                                              npu_offload_acl_error *err) {
    const npu_acl_symbols *acl;
    int rc = npu_copy_begin(err, src, dst, sizes, n, direction, &acl);
    if (rc != NPU_OFFLOAD_OK || acl == NULL) return rc;
    if (!acl->memcpy_async) return npu_acl_missing(err, "aclrtMemcpyAsync", "");
    aclrtMemcpyKind kind = direction == NPU_OFFLOAD_H2D ? ACL_MEMCPY_HOST_TO_DEVICE : ACL_MEMCPY_DEVICE_TO_HOST;
    for (int64_t i = 0; i < n; i++) {
        size_t size = (size_t)sizes[i];
        aclError arc = acl->memcpy_async((void *)(uintptr_t)dst[i], size, (const void *)(uintptr_t)src[i], size,
                                         kind, (aclrtStream)stream);
        if (arc != ACL_SUCCESS) return npu_err_acl(err, acl, "aclrtMemcpyAsync", arc, i, -1);
    }
    return NPU_OFFLOAD_OK;
}
