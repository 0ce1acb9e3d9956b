/*
 * Batch path: all descriptors in one aclrtMemcpyBatchAsync call (CANN >= 8.5, A2/A3),
 * or aclrtMemcpyBatchAsyncV2 (CANN 9.x, no failIndex) when that is what the runtime
 * exports. Compiled only when NPU_OFFLOAD_BATCH_MEMCPY is defined (build toggle
 * VLLM_ASCEND_ENABLE_BATCH_MEMCPY); otherwise the entry point reports that it was
 * built out, so the Python side falls back to the loop path. Directions: host->device,
 * device->host, and device->device within the current device (staging gather/scatter).
 */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "npu_offload_acl.h"

_Static_assert(sizeof(int64_t) == sizeof(void *) && sizeof(int64_t) == sizeof(size_t),
               "descriptor arrays are int64 reinterpreted as void* / size_t");

enum { FORM_AUTO = 0, FORM_V1 = 1, FORM_V2 = 2 };
static volatile int g_form_request = FORM_AUTO;

/* Tests and diagnostics: force the failIndex form (1), the V2 form (2) or auto (0). */
NPU_OFFLOAD_API int npu_offload_acl_set_batch_form(int form) {
    if (form < FORM_AUTO || form > FORM_V2) return NPU_OFFLOAD_BAD_ARGUMENT;
    g_form_request = form;
    return NPU_OFFLOAD_OK;
}

#ifdef NPU_OFFLOAD_BATCH_MEMCPY

/* The form to call: the one with failIndex when exported (better errors), else V2. */
int npu_batch_pick(const npu_acl_symbols *acl, npu_offload_acl_error *err) {
    int want = g_form_request;
    if ((want == FORM_AUTO || want == FORM_V1) && acl->batch_v1) return FORM_V1;
    if ((want == FORM_AUTO || want == FORM_V2) && acl->batch_v2) return FORM_V2;
    if (want == FORM_V1) return npu_acl_missing(err, "aclrtMemcpyBatchAsync", "batch form 1 was forced"), 0;
    if (want == FORM_V2) return npu_acl_missing(err, "aclrtMemcpyBatchAsyncV2", "batch form 2 was forced"), 0;
    npu_acl_missing(err, "aclrtMemcpyBatchAsync or aclrtMemcpyBatchAsyncV2",
                    "the batch path needs CANN >= 8.5 on Atlas A2/A3; use the acl_loop path");
    return 0;
}

/* Which form a copy would use now: 1 or 2, or 0 with err filled. */
NPU_OFFLOAD_API int npu_offload_acl_batch_form(npu_offload_acl_error *err) {
    npu_err_clear(err);
    const npu_acl_symbols *acl = npu_acl_load(err);
    return acl ? npu_batch_pick(acl, err) : 0;
}

/* One attribute for the whole batch (attrsIndexes = {0}); rsv must stay zero. The device side is the
 * current device; D2D (the staging gather/scatter) has both ends there. */
static aclrtMemcpyBatchAttr batch_attr(int direction, uint32_t device) {
    aclrtMemcpyBatchAttr attr = {0};
    aclrtMemLocation host = {.id = 0, .type = ACL_MEM_LOCATION_TYPE_HOST};
    aclrtMemLocation dev = {.id = device, .type = ACL_MEM_LOCATION_TYPE_DEVICE};
    attr.srcLoc = direction == NPU_OFFLOAD_H2D ? host : dev;
    attr.dstLoc = direction == NPU_OFFLOAD_D2H ? host : dev;
    return attr;
}

static int submit(const npu_acl_symbols *acl, int form, void **dsts, size_t *sizes, void **srcs, size_t n,
                  aclrtMemcpyBatchAttr *attr, size_t offset, aclrtStream stream, npu_offload_acl_error *err) {
    size_t attr_index = 0;
    if (form == FORM_V1) {
        size_t fail = SIZE_MAX;
        aclError rc = acl->batch_v1(dsts, sizes, srcs, sizes, n, attr, &attr_index, 1, &fail, stream);
        if (rc != ACL_SUCCESS) {
            int64_t at = fail == SIZE_MAX ? -1 : (int64_t)(offset + fail);
            return npu_err_acl(err, acl, "aclrtMemcpyBatchAsync", rc, at, at);
        }
        return NPU_OFFLOAD_OK;
    }
    aclError rc = acl->batch_v2(dsts, sizes, srcs, sizes, n, attr, &attr_index, 1, stream);
    /* V2 reports no failIndex: the error is for the whole chunk starting at `offset`. */
    if (rc != ACL_SUCCESS) {
        npu_err_acl(err, acl, "aclrtMemcpyBatchAsyncV2", rc, -1, -1);
        size_t used = strlen(err->message);
        snprintf(err->message + used, sizeof(err->message) - used,
                 " (in descriptors %zu..%zu; the V2 form reports no failIndex)", offset, offset + n - 1);
        return NPU_OFFLOAD_ACL_FAILED;
    }
    return NPU_OFFLOAD_OK;
}

/* Submit n validated descriptors with the batch `form` (npu_batch_pick), max_per_call at a time. */
int npu_batch_submit(const npu_acl_symbols *acl, int form, const int64_t *src, const int64_t *dst,
                     const int64_t *sizes, int64_t n, int direction, void *stream, int64_t max_per_call,
                     npu_offload_acl_error *err) {
    if (!acl->get_device) return npu_acl_missing(err, "aclrtGetDevice", "");
    int32_t device = 0;
    aclError arc = acl->get_device(&device);
    if (arc != ACL_SUCCESS) return npu_err_acl(err, acl, "aclrtGetDevice", arc, -1, -1);

    aclrtMemcpyBatchAttr attr = batch_attr(direction, (uint32_t)device);

    /* ACL takes non-const arrays but does not write them; destMaxs = sizes (exact pages). */
    void **srcs = (void **)(uintptr_t)src;
    void **dsts = (void **)(uintptr_t)dst;
    size_t *szs = (size_t *)(uintptr_t)sizes;
    int64_t chunk = max_per_call > 0 ? max_per_call : n;
    for (int64_t off = 0; off < n; off += chunk) {
        int64_t cnt = n - off < chunk ? n - off : chunk;
        int rc = submit(acl, form, dsts + off, szs + off, srcs + off, (size_t)cnt, &attr, (size_t)off,
                        (aclrtStream)stream, err);
        if (rc != NPU_OFFLOAD_OK) return rc;
    }
    return NPU_OFFLOAD_OK;
}

NPU_OFFLOAD_API int npu_offload_acl_copy_batch(const int64_t *src, const int64_t *dst, const int64_t *sizes,
                                               int64_t n, int direction, void *stream, int64_t max_per_call,
                                               npu_offload_acl_error *err) {
    const npu_acl_symbols *acl;
    int rc = npu_copy_begin(err, src, dst, sizes, n, direction, &acl);
    if (rc != NPU_OFFLOAD_OK || acl == NULL) return rc;
    int form = npu_batch_pick(acl, err);
    if (!form) return NPU_OFFLOAD_MISSING;
    return npu_batch_submit(acl, form, src, dst, sizes, n, direction, stream, max_per_call, err);
}

#else /* loop-only build */

NPU_OFFLOAD_API int npu_offload_acl_batch_form(npu_offload_acl_error *err) {
    npu_err_clear(err);
    npu_err_set(err, NPU_OFFLOAD_NOT_BUILT, "build", 0, -1, -1,
                "the batch path was not built (VLLM_ASCEND_ENABLE_BATCH_MEMCPY=0 or headers without "
                "aclrtMemcpyBatchAsync); rebuild with VLLM_ASCEND_ENABLE_BATCH_MEMCPY=1");
    return 0;
}

int npu_batch_pick(const npu_acl_symbols *acl, npu_offload_acl_error *err) {
    (void)acl;
    npu_offload_acl_batch_form(err);
    return 0;
}

int npu_batch_submit(const npu_acl_symbols *acl, int form, const int64_t *src, const int64_t *dst,
                     const int64_t *sizes, int64_t n, int direction, void *stream, int64_t max_per_call,
                     npu_offload_acl_error *err) {
    (void)acl, (void)form, (void)src, (void)dst, (void)sizes, (void)n, (void)direction, (void)stream;
    (void)max_per_call;
    npu_offload_acl_batch_form(err);
    return NPU_OFFLOAD_NOT_BUILT;
}

NPU_OFFLOAD_API int npu_offload_acl_copy_batch(const int64_t *src, const int64_t *dst, const int64_t *sizes,
                                               int64_t n, int direction, void *stream, int64_t max_per_call,
                                               npu_offload_acl_error *err) {
    (void)src, (void)dst, (void)sizes, (void)n, (void)direction, (void)stream, (void)max_per_call;
    npu_offload_acl_batch_form(err);
    return NPU_OFFLOAD_NOT_BUILT;
}

#endif
