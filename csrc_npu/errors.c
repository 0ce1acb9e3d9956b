/* Error reporting shared by every entry point: one struct, filled once, never thrown. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "npu_offload_acl.h"

void npu_err_clear(npu_offload_acl_error *err) {
    if (!err) return;
    memset(err, 0, sizeof(*err));
    err->index = -1;
    err->fail_index = -1;
}

int npu_err_set(npu_offload_acl_error *err, int status, const char *call, int32_t acl_code, int64_t index,
                int64_t fail_index, const char *fmt, ...) {
    if (!err) return status;
    err->status = status;
    err->acl_code = acl_code;
    err->index = index;
    err->fail_index = fail_index;
    snprintf(err->call, sizeof(err->call), "%s", call);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->message, sizeof(err->message), fmt, ap);
    va_end(ap);
    return status;
}

/* An ACL call failed: keep its code, the descriptor index and ACL's own last message. */
int npu_err_acl(npu_offload_acl_error *err, const npu_acl_symbols *acl, const char *call, aclError rc,
                int64_t index, int64_t fail_index) {
    const char *detail = (acl && acl->recent_err) ? acl->recent_err() : NULL;
    return npu_err_set(err, NPU_OFFLOAD_ACL_FAILED, call, (int32_t)rc, index, fail_index,
                       "%s returned ACL error %d%s%s", call, (int)rc, detail && *detail ? ": " : "",
                       detail ? detail : "");
}

/* Arguments the ACL calls would reject less clearly: checked before anything is submitted. */
int npu_check_descriptors(npu_offload_acl_error *err, const int64_t *src, const int64_t *dst,
                          const int64_t *sizes, int64_t n, int direction) {
    if (direction != NPU_OFFLOAD_H2D && direction != NPU_OFFLOAD_D2H && direction != NPU_OFFLOAD_D2D)
        return npu_err_set(err, NPU_OFFLOAD_BAD_ARGUMENT, "argument", 0, -1, -1,
                           "direction %d is not allowed; use 0 (host->device), 1 (device->host) or "
                           "2 (device->device)", direction);
    if (n < 0)
        return npu_err_set(err, NPU_OFFLOAD_BAD_ARGUMENT, "argument", 0, -1, -1,
                           "descriptor count %lld is negative", (long long)n);
    if (n > 0 && (!src || !dst || !sizes))
        return npu_err_set(err, NPU_OFFLOAD_BAD_ARGUMENT, "argument", 0, -1, -1,
                           "descriptor arrays must not be NULL (src=%p dst=%p sizes=%p)", (const void *)src,
                           (const void *)dst, (const void *)sizes);
    for (int64_t i = 0; i < n; i++) {
        if (sizes[i] <= 0 || !src[i] || !dst[i])
            return npu_err_set(err, NPU_OFFLOAD_BAD_ARGUMENT, "argument", 0, i, -1,
                               "descriptor %lld is invalid (src=%#llx dst=%#llx size=%lld); addresses must be "
                               "non-zero and sizes > 0",
                               (long long)i, (unsigned long long)src[i], (unsigned long long)dst[i],
                               (long long)sizes[i]);
    }
    return NPU_OFFLOAD_OK;
}
