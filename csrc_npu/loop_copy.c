/*
 * Loop path: one aclrtMemcpyAsync per descriptor. Works on every CANN version and
 * chip; each call costs a few microseconds of host time, which the batch path avoids.
 */
#include <stdint.h>

#include "npu_offload_acl.h"

/* acl_rt.h: "For on-chip Device-to-Device memory copy, both the source and destination
 * addresses must be 64-byte aligned" (sizes may be anything). */
#define NPU_D2D_ALIGN 64

static aclrtMemcpyKind memcpy_kind(int direction) {
    if (direction == NPU_OFFLOAD_H2D) return ACL_MEMCPY_HOST_TO_DEVICE;
    if (direction == NPU_OFFLOAD_D2H) return ACL_MEMCPY_DEVICE_TO_HOST;
    return ACL_MEMCPY_DEVICE_TO_DEVICE;
}

/* Checked before anything is submitted, so a misaligned staging layout fails whole, not half-copied. */
int npu_check_d2d_alignment(npu_offload_acl_error *err, const int64_t *src, const int64_t *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        if ((src[i] | dst[i]) % NPU_D2D_ALIGN)
            return npu_err_set(err, NPU_OFFLOAD_BAD_ARGUMENT, "argument", 0, i, -1,
                               "descriptor %lld: device->device aclrtMemcpyAsync needs %d-byte aligned addresses "
                               "(src=%#llx dst=%#llx)",
                               (long long)i, NPU_D2D_ALIGN, (unsigned long long)src[i], (unsigned long long)dst[i]);
    }
    return NPU_OFFLOAD_OK;
}

/* Submit n validated descriptors, one aclrtMemcpyAsync each (D2D: alignment checked first). */
int npu_loop_submit(const npu_acl_symbols *acl, const int64_t *src, const int64_t *dst, const int64_t *sizes,
                    int64_t n, int direction, void *stream, npu_offload_acl_error *err) {
    int rc;
    if (direction == NPU_OFFLOAD_D2D && (rc = npu_check_d2d_alignment(err, src, dst, n)) != NPU_OFFLOAD_OK) return rc;
    if (!acl->memcpy_async) return npu_acl_missing(err, "aclrtMemcpyAsync", "");
    aclrtMemcpyKind kind = memcpy_kind(direction);
    for (int64_t i = 0; i < n; i++) {
        size_t size = (size_t)sizes[i];
        aclError arc = acl->memcpy_async((void *)(uintptr_t)dst[i], size, (const void *)(uintptr_t)src[i], size,
                                         kind, (aclrtStream)stream);
        if (arc != ACL_SUCCESS) return npu_err_acl(err, acl, "aclrtMemcpyAsync", arc, i, -1);
    }
    return NPU_OFFLOAD_OK;
}

NPU_OFFLOAD_API int npu_offload_acl_copy_loop(const int64_t *src, const int64_t *dst, const int64_t *sizes,
                                              int64_t n, int direction, void *stream,
                                              npu_offload_acl_error *err) {
    const npu_acl_symbols *acl;
    int rc = npu_copy_begin(err, src, dst, sizes, n, direction, &acl);
    if (rc != NPU_OFFLOAD_OK || acl == NULL) return rc;
    return npu_loop_submit(acl, src, dst, sizes, n, direction, stream, err);
}
