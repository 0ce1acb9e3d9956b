/*
 * Exact-size pinning of existing host memory with aclrtHostRegisterV2(ACL_HOST_REG_PINNED),
 * the Ascend analogue of cudaHostRegister: torch's pinned allocator would round a large
 * KV pool up to a power of two. ACL wants 4 KiB-aligned ranges, so the range is widened
 * to whole pages (at most 8 KiB more than asked); unregister uses the same aligned base.
 */
#include <stdint.h>

#include "npu_offload_acl.h"

#define NPU_PAGE 4096u

#ifdef NPU_OFFLOAD_DECLARED_HOST_REGISTER_V2
static uintptr_t page_floor(uintptr_t p) { return p & ~(uintptr_t)(NPU_PAGE - 1); }
#endif

NPU_OFFLOAD_API int npu_offload_acl_host_register(void *ptr, uint64_t size, npu_offload_acl_error *err) {
    npu_err_clear(err);
#ifndef NPU_OFFLOAD_DECLARED_HOST_REGISTER_V2
    (void)ptr, (void)size;
    return npu_err_set(err, NPU_OFFLOAD_NOT_BUILT, "build", 0, -1, -1,
                       "built against ACL headers without aclrtHostRegisterV2 (CANN >= 8.5 needed)");
#else
    if (!ptr || size == 0)
        return npu_err_set(err, NPU_OFFLOAD_BAD_ARGUMENT, "argument", 0, -1, -1,
                           "host_register needs a non-NULL pointer and size > 0 (got %p, %llu)", ptr,
                           (unsigned long long)size);
    const npu_acl_symbols *acl = npu_acl_load(err);
    if (!acl) return NPU_OFFLOAD_MISSING;
    if (!acl->host_register) return npu_acl_missing(err, "aclrtHostRegisterV2", "CANN >= 8.5 is needed");
    uintptr_t start = page_floor((uintptr_t)ptr);
    uintptr_t end = page_floor((uintptr_t)ptr + size + NPU_PAGE - 1);
    aclError rc = acl->host_register((void *)start, (uint64_t)(end - start), ACL_HOST_REG_PINNED);
    if (rc != ACL_SUCCESS) return npu_err_acl(err, acl, "aclrtHostRegisterV2", rc, -1, -1);
    return NPU_OFFLOAD_OK;
#endif
}

NPU_OFFLOAD_API int npu_offload_acl_host_unregister(void *ptr, npu_offload_acl_error *err) {
    npu_err_clear(err);
#ifndef NPU_OFFLOAD_DECLARED_HOST_REGISTER_V2
    (void)ptr;
    return npu_err_set(err, NPU_OFFLOAD_NOT_BUILT, "build", 0, -1, -1,
                       "built against ACL headers without aclrtHostUnregister");
#else
    if (!ptr)
        return npu_err_set(err, NPU_OFFLOAD_BAD_ARGUMENT, "argument", 0, -1, -1, "host_unregister needs a pointer");
    const npu_acl_symbols *acl = npu_acl_load(err);
    if (!acl) return NPU_OFFLOAD_MISSING;
    if (!acl->host_unregister) return npu_acl_missing(err, "aclrtHostUnregister", "");
    aclError rc = acl->host_unregister((void *)page_floor((uintptr_t)ptr));
    if (rc != ACL_SUCCESS) return npu_err_acl(err, acl, "aclrtHostUnregister", rc, -1, -1);
    return NPU_OFFLOAD_OK;
#endif
}
