/*
 * libnpu_offload_acl: plain C-ABI copy backend over Ascend ACL (internal header).
 *
 * Every libascendcl entry point is resolved at run time (dlopen/dlsym), so the
 * library loads on any machine and fails with a message naming what is missing
 * only when a copy is requested. Callers (ctypes) pass descriptors as int64 arrays.
 */
#ifndef NPU_OFFLOAD_ACL_H_
#define NPU_OFFLOAD_ACL_H_

#include <stddef.h>
#include <stdint.h>

#include <acl/acl_rt.h>

#define NPU_OFFLOAD_API __attribute__((visibility("default")))

/* Status codes returned by every exported function (0 = success). */
enum {
    NPU_OFFLOAD_OK = 0,
    NPU_OFFLOAD_ACL_FAILED = 1,      /* an ACL call returned != ACL_SUCCESS */
    NPU_OFFLOAD_MISSING = 2,         /* libascendcl or a needed symbol is absent */
    NPU_OFFLOAD_BAD_ARGUMENT = 3,    /* caller error (direction, null pointer, alignment) */
    NPU_OFFLOAD_NOT_BUILT = 4,       /* this path was compiled out (loop-only build) */
};

/* Directions: 0 and 1 number as vLLM-Ascend's swap_blocks_batch does; 2 is ours: copies within the
 * current device (the gather/scatter of staged transfers, device pages <-> a device staging buffer). */
enum { NPU_OFFLOAD_H2D = 0, NPU_OFFLOAD_D2H = 1, NPU_OFFLOAD_D2D = 2 };

/* Filled on failure; mirrored by a ctypes.Structure in vllm_npu_offload/copy/npu_native.py. */
typedef struct {
    int32_t acl_code;    /* ACL return code, 0 when the failure is not from ACL */
    int32_t status;      /* one of the NPU_OFFLOAD_* codes */
    int64_t index;       /* descriptor index, -1 when not descriptor-specific */
    int64_t fail_index;  /* failIndex reported by aclrtMemcpyBatchAsync, -1 if none */
    char call[64];       /* the call that failed (ACL entry point, dlopen, dlsym, argument) */
    char message[512];
} npu_offload_acl_error;

/* Resolved ACL entry points (NULL when absent). */
typedef aclError (*acl_memcpy_async_fn)(void *, size_t, const void *, size_t, aclrtMemcpyKind, aclrtStream);
typedef aclError (*acl_get_device_fn)(int32_t *);
typedef aclError (*acl_batch_v1_fn)(void **, size_t *, void **, size_t *, size_t, aclrtMemcpyBatchAttr *,
                                    size_t *, size_t, size_t *, aclrtStream);
typedef aclError (*acl_batch_v2_fn)(void **, size_t *, void **, size_t *, size_t, aclrtMemcpyBatchAttr *,
                                    size_t *, size_t, aclrtStream);
typedef aclError (*acl_host_register_fn)(void *, uint64_t, uint32_t);
typedef aclError (*acl_host_unregister_fn)(void *);
typedef const char *(*acl_recent_err_fn)(void);

typedef struct {
    const char *library;  /* path that was dlopen'ed */
    acl_memcpy_async_fn memcpy_async;
    acl_get_device_fn get_device;
    acl_batch_v1_fn batch_v1;
    acl_batch_v2_fn batch_v2;
    acl_host_register_fn host_register;
    acl_host_unregister_fn host_unregister;
    acl_recent_err_fn recent_err;
} npu_acl_symbols;

/* acl_symbols.c */
const npu_acl_symbols *npu_acl_load(npu_offload_acl_error *err);
/* Shared start of every copy call: clear err, validate the descriptors, load ACL.
 * Returns NPU_OFFLOAD_OK with *acl set (NULL when n == 0: nothing to do), else a status. */
int npu_copy_begin(npu_offload_acl_error *err, const int64_t *src, const int64_t *dst, const int64_t *sizes,
                   int64_t n, int direction, const npu_acl_symbols **acl);
int npu_acl_missing(npu_offload_acl_error *err, const char *symbol, const char *why);

/* errors.c */
void npu_err_clear(npu_offload_acl_error *err);
int npu_err_set(npu_offload_acl_error *err, int status, const char *call, int32_t acl_code, int64_t index,
                int64_t fail_index, const char *fmt, ...) __attribute__((format(printf, 7, 8)));
int npu_err_acl(npu_offload_acl_error *err, const npu_acl_symbols *acl, const char *call, aclError rc,
                int64_t index, int64_t fail_index);
int npu_check_descriptors(npu_offload_acl_error *err, const int64_t *src, const int64_t *dst,
                          const int64_t *sizes, int64_t n, int direction);

#endif /* NPU_OFFLOAD_ACL_H_ */
