/* Build-time facts, readable without touching ACL: `python -m vllm_npu_offload info` prints them. */
#include <stdio.h>

#include "npu_offload_acl.h"

#ifndef ACL_MAJOR_VERSION /* headers older than the version macros */
#define ACL_MAJOR_VERSION -1
#define ACL_MINOR_VERSION 0
#define ACL_PATCH_VERSION 0
#endif

#ifndef NPU_OFFLOAD_HEADERS_ORIGIN
#define NPU_OFFLOAD_HEADERS_ORIGIN "unknown"
#endif

/* "batch" when aclrtMemcpyBatchAsync support was compiled in, else "loop". */
NPU_OFFLOAD_API const char *npu_offload_acl_build_mode(void) {
#ifdef NPU_OFFLOAD_BATCH_MEMCPY
    return "batch";
#else
    return "loop";
#endif
}

/* One line: ACL header version and which batch forms the headers declared. */
NPU_OFFLOAD_API const char *npu_offload_acl_build_info(void) {
    static char buf[256];
    snprintf(buf, sizeof(buf), "acl headers %d.%d.%d from %s; declared:%s%s%s", ACL_MAJOR_VERSION,
             ACL_MINOR_VERSION, ACL_PATCH_VERSION, NPU_OFFLOAD_HEADERS_ORIGIN,
#ifdef NPU_OFFLOAD_DECLARED_BATCH_V1
             " aclrtMemcpyBatchAsync",
#else
             "",
#endif
#ifdef NPU_OFFLOAD_DECLARED_BATCH_V2
             " aclrtMemcpyBatchAsyncV2",
#else
             "",
#endif
#ifdef NPU_OFFLOAD_DECLARED_HOST_REGISTER_V2
             " aclrtHostRegisterV2"
#else
             ""
#endif
    );
    return buf;
}

/* Load libascendcl now; 0 when it (and aclrtMemcpyAsync) resolved, else a status with err filled. */
NPU_OFFLOAD_API int npu_offload_acl_probe(npu_offload_acl_error *err) {
    npu_err_clear(err);
    const npu_acl_symbols *acl = npu_acl_load(err);
    if (!acl) return NPU_OFFLOAD_MISSING;
    if (!acl->memcpy_async) return npu_acl_missing(err, "aclrtMemcpyAsync", "");
    return NPU_OFFLOAD_OK;
}
