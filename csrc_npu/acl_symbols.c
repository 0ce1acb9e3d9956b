/*
 * Run-time resolution of libascendcl entry points (dlopen/dlsym), so this library
 * has no link-time dependency on CANN. NPU_OFFLOAD_ACL_LIBRARY overrides the library
 * (tests point it at the ACL emulation). A failed load is retried on the next call;
 * a successful one is kept for the life of the process.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "npu_offload_acl.h"

/* The header declarations must match the function pointer types we call through. */
#define NPU_SAME_TYPE(fn, type) _Static_assert(__builtin_types_compatible_p(__typeof__(&fn), type), \
                                               #fn " in acl_rt.h differs from the signature this library calls")
NPU_SAME_TYPE(aclrtMemcpyAsync, acl_memcpy_async_fn);
NPU_SAME_TYPE(aclrtGetDevice, acl_get_device_fn);
#ifdef NPU_OFFLOAD_DECLARED_BATCH_V1
NPU_SAME_TYPE(aclrtMemcpyBatchAsync, acl_batch_v1_fn);
#endif
#ifdef NPU_OFFLOAD_DECLARED_BATCH_V2
NPU_SAME_TYPE(aclrtMemcpyBatchAsyncV2, acl_batch_v2_fn);
#endif
NPU_SAME_TYPE(aclrtCreateEvent, acl_create_event_fn);
NPU_SAME_TYPE(aclrtDestroyEvent, acl_destroy_event_fn);
NPU_SAME_TYPE(aclrtRecordEvent, acl_record_event_fn);
NPU_SAME_TYPE(aclrtStreamWaitEvent, acl_stream_wait_event_fn);
#ifdef NPU_OFFLOAD_DECLARED_EVENT_EX
NPU_SAME_TYPE(aclrtCreateEventExWithFlag, acl_create_event_ex_fn);
#endif
#ifdef NPU_OFFLOAD_DECLARED_HOST_REGISTER_V2
NPU_SAME_TYPE(aclrtHostRegisterV2, acl_host_register_fn);
NPU_SAME_TYPE(aclrtHostUnregister, acl_host_unregister_fn);
#endif

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static npu_acl_symbols g_acl;
static int g_loaded;
static char g_library[512];

static const char *library_name(void) {
    const char *env = getenv("NPU_OFFLOAD_ACL_LIBRARY");
    return (env && *env) ? env : "libascendcl.so";
}

static void resolve(void *h, npu_acl_symbols *s) {
    /* dlsym returns void*; POSIX guarantees the conversion to a function pointer. */
    *(void **)&s->memcpy_async = dlsym(h, "aclrtMemcpyAsync");
    *(void **)&s->get_device = dlsym(h, "aclrtGetDevice");
#ifdef NPU_OFFLOAD_DECLARED_BATCH_V1
    *(void **)&s->batch_v1 = dlsym(h, "aclrtMemcpyBatchAsync");
#endif
#ifdef NPU_OFFLOAD_DECLARED_BATCH_V2
    *(void **)&s->batch_v2 = dlsym(h, "aclrtMemcpyBatchAsyncV2");
#endif
#ifdef NPU_OFFLOAD_DECLARED_HOST_REGISTER_V2
    *(void **)&s->host_register = dlsym(h, "aclrtHostRegisterV2");
    *(void **)&s->host_unregister = dlsym(h, "aclrtHostUnregister");
#endif
    *(void **)&s->recent_err = dlsym(h, "aclGetRecentErrMsg");
    *(void **)&s->create_event = dlsym(h, "aclrtCreateEvent");
#ifdef NPU_OFFLOAD_DECLARED_EVENT_EX
    *(void **)&s->create_event_ex = dlsym(h, "aclrtCreateEventExWithFlag");
#endif
    *(void **)&s->destroy_event = dlsym(h, "aclrtDestroyEvent");
    *(void **)&s->record_event = dlsym(h, "aclrtRecordEvent");
    *(void **)&s->stream_wait_event = dlsym(h, "aclrtStreamWaitEvent");
}

const npu_acl_symbols *npu_acl_load(npu_offload_acl_error *err) {
    pthread_mutex_lock(&g_lock);
    if (!g_loaded) {
        const char *name = library_name();
        void *h = dlopen(name, RTLD_NOW | RTLD_LOCAL);
        if (!h) {
            const char *why = dlerror();
            npu_err_set(err, NPU_OFFLOAD_MISSING, "dlopen", 0, -1, -1,
                        "cannot load the Ascend runtime library %s (%s); install CANN and `source "
                        "set_env.sh`, or set NPU_OFFLOAD_ACL_LIBRARY to libascendcl.so",
                        name, why ? why : "unknown error");
            pthread_mutex_unlock(&g_lock);
            return NULL;
        }
        memset(&g_acl, 0, sizeof(g_acl));
        resolve(h, &g_acl);
        strncpy(g_library, name, sizeof(g_library) - 1);
        g_acl.library = g_library;
        g_loaded = 1;
    }
    pthread_mutex_unlock(&g_lock);
    return &g_acl;
}

int npu_acl_missing(npu_offload_acl_error *err, const char *symbol, const char *why) {
    return npu_err_set(err, NPU_OFFLOAD_MISSING, "dlsym", 0, -1, -1, "%s does not export %s%s%s", g_library,
                       symbol, why && *why ? "; " : "", why ? why : "");
}

int npu_copy_begin(npu_offload_acl_error *err, const int64_t *src, const int64_t *dst, const int64_t *sizes,
                   int64_t n, int direction, const npu_acl_symbols **acl) {
    npu_err_clear(err);
    *acl = NULL;
    int rc = npu_check_descriptors(err, src, dst, sizes, n, direction);
    if (rc != NPU_OFFLOAD_OK || n == 0) return rc;
    *acl = npu_acl_load(err);
    return *acl ? NPU_OFFLOAD_OK : NPU_OFFLOAD_MISSING;
}
