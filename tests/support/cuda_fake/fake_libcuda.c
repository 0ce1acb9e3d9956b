/* Test double of libcuda.so.1 for CPU CI: host memcpy semantics for the few driver
 * entry points libnpu_offload_cuda.so resolves. Behaviour via env:
 *   FAKE_CUDA_VERSION  driver version reported (default 13000; 12080 -> 9-arg batch ABI)
 *   FAKE_CUDA_FAIL_AT  descriptor index (counted over the process) whose copy fails
 *   FAKE_CUDA_NO_BINARY  cuModuleLoadData fails with CUDA_ERROR_NO_BINARY_FOR_GPU
 * cuLaunchKernel runs the gather kernel's body (csrc_cuda/gather_body.h) on the CPU,
 * thread by thread, so the launcher's arguments and the kernel's indexing are checked
 * byte for byte. Counters are exported for the tests (fake_*). */
#include <cuda.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>

#include "gather_body.h"

long long fake_batch_calls = 0, fake_memcpy_calls = 0, fake_copied = 0, fake_max_batch = 0;
int fake_last_order = -1, fake_last_version_asked = 0;

static int version(void) { const char *v = getenv("FAKE_CUDA_VERSION"); return v ? atoi(v) : 13000; }
static long long fail_at(void) { const char *v = getenv("FAKE_CUDA_FAIL_AT"); return v ? atoll(v) : -1; }

static int one(CUdeviceptr d, CUdeviceptr s, size_t n) {
    if (fake_copied == fail_at()) { fake_copied++; return 1; }
    memcpy((void *)d, (const void *)s, n);
    fake_copied++;
    return 0;
}

CUresult cuDriverGetVersion(int *v) { *v = version(); return CUDA_SUCCESS; }

static void log_op(unsigned long long kind, CUevent e, CUstream s);
static CUresult f_memcpy(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st) {
    fake_memcpy_calls++;
    log_op(3, (CUevent)(uintptr_t)d, st);
    return one(d, s, n) ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}
static CUresult f_batch_v2(CUdeviceptr *d, CUdeviceptr *s, size_t *z, size_t n, CUmemcpyAttributes *a, size_t *ai,
                           size_t na, CUstream st) {
    (void)ai; (void)na;
    fake_batch_calls++; fake_last_order = a[0].srcAccessOrder;
    if ((long long)n > fake_max_batch) fake_max_batch = n;
    for (size_t i = 0; i < n; ++i) log_op(3, (CUevent)(uintptr_t)d[i], st);
    for (size_t i = 0; i < n; ++i) if (one(d[i], s[i], z[i])) return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}
static CUresult f_batch_v1(CUdeviceptr *d, CUdeviceptr *s, size_t *z, size_t n, CUmemcpyAttributes *a, size_t *ai,
                           size_t na, size_t *fail, CUstream st) {
    (void)ai; (void)na;
    fake_batch_calls++; fake_last_order = a[0].srcAccessOrder;
    if ((long long)n > fake_max_batch) fake_max_batch = n;
    for (size_t i = 0; i < n; ++i) log_op(3, (CUevent)(uintptr_t)d[i], st);
    for (size_t i = 0; i < n; ++i) if (one(d[i], s[i], z[i])) { *fail = i; return CUDA_ERROR_INVALID_VALUE; }
    return CUDA_SUCCESS;
}
static CUresult f_err_string(CUresult r, const char **s) {
    *s = r == 1 ? "invalid argument" : r == 209 ? "no kernel image is available for execution on the device" : "fake error";
    return CUDA_SUCCESS;
}
static CUresult f_err_name(CUresult r, const char **s) {
    *s = r == 1 ? "CUDA_ERROR_INVALID_VALUE" : r == 209 ? "CUDA_ERROR_NO_BINARY_FOR_GPU" : "CUDA_ERROR_FAKE";
    return CUDA_SUCCESS;
}
static CUresult f_ctx_get(CUcontext *c) { *c = (CUcontext)0x1; return CUDA_SUCCESS; }
static CUresult f_ctx_set(CUcontext c) { (void)c; return CUDA_SUCCESS; }
static CUresult f_stream_ctx(CUstream s, CUcontext *c) { (void)s; *c = (CUcontext)0x1; return CUDA_SUCCESS; }

long long fake_launches = 0, fake_table_launches = 0, fake_inline_launches = 0, fake_modules = 0;
unsigned fake_last_grid = 0, fake_last_block = 0, fake_last_group = 0;

static CUresult f_module_load(CUmodule *m, const void *image) {
    if (getenv("FAKE_CUDA_NO_BINARY")) return CUDA_ERROR_NO_BINARY_FOR_GPU;
    if (!image) return CUDA_ERROR_INVALID_VALUE;
    fake_modules++;
    *m = (CUmodule)0x2;
    return CUDA_SUCCESS;
}
static CUresult f_get_function(CUfunction *f, CUmodule m, const char *name) {
    (void)m;
    if (!strcmp(name, "npo_gather_pages")) *f = (CUfunction)0x3;
    else if (!strcmp(name, "npo_gather_table")) *f = (CUfunction)0x4;
    else if (!strcmp(name, "npo_gather_table_inline")) *f = (CUfunction)0x5;
    else return CUDA_ERROR_NOT_FOUND;
    return CUDA_SUCCESS;
}
static CUresult f_launch(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                         unsigned shmem, CUstream st, void **p, void **extra) {
    (void)shmem; (void)st; (void)extra;
    if (gy != 1 || gz != 1 || by != 1 || bz != 1 || !gx || !bx) return CUDA_ERROR_INVALID_VALUE;
    if (f == (CUfunction)0x4) {
        npo_table_args t = {*(const int64_t **)p[0], *(const int64_t **)p[2], *(const int64_t **)p[3],
                            *(uint64_t *)p[1], *(uint64_t *)p[4], *(uint64_t *)p[5], *(uint32_t *)p[6]};
        fake_launches++; fake_table_launches++; fake_last_grid = gx; fake_last_block = bx; fake_last_group = t.group;
        for (unsigned b = 0; b < gx; ++b)
            for (unsigned th = 0; th < bx; ++th) npo_table_thread(&t, b, gx, th, bx);
        return CUDA_SUCCESS;
    }
    if (f == (CUfunction)0x5) { /* one parameter: the struct itself, ids inside it */
        const npo_table_inline_args *t = (const npo_table_inline_args *)p[0];
        if (t->nb > NPO_INLINE_IDS) return CUDA_ERROR_INVALID_VALUE;
        fake_launches++; fake_inline_launches++; fake_last_grid = gx; fake_last_block = bx; fake_last_group = t->group;
        for (unsigned b = 0; b < gx; ++b)
            for (unsigned th = 0; th < bx; ++th) npo_table_inline_thread(t, b, gx, th, bx);
        return CUDA_SUCCESS;
    }
    if (f != (CUfunction)0x3) return CUDA_ERROR_INVALID_HANDLE;
    npo_gather_args a = {*(const uint64_t **)p[0], *(const uint64_t **)p[1], *(const uint64_t **)p[2],
                         *(uint64_t *)p[3], *(uint64_t *)p[4], *(uint64_t *)p[5], *(uint64_t *)p[6],
                         *(uint32_t *)p[7]};
    fake_launches++; fake_last_grid = gx; fake_last_block = bx; fake_last_group = a.group;
    for (unsigned b = 0; b < gx; ++b)
        for (unsigned t = 0; t < bx; ++t) npo_gather_thread(&a, b, gx, t, bx);
    return CUDA_SUCCESS;
}

long long fake_events = 0, fake_records = 0, fake_waits = 0;
static CUresult f_event_create(CUevent *e, unsigned flags) {
    (void)flags;
    *e = (CUevent)(uintptr_t)(0x1000 + ++fake_events);
    return CUDA_SUCCESS;
}
static CUresult f_event_destroy(CUevent e) { (void)e; fake_events--; return CUDA_SUCCESS; }
/* The last FAKE_LOG stream operations, for order checks: (1 record / 2 wait, event, stream) or
   (3 copy, destination address, stream): one row per copy, batched or not. */
#define FAKE_LOG 4096
unsigned long long fake_log[FAKE_LOG][3];
long long fake_log_n = 0;
static void log_op(unsigned long long kind, CUevent e, CUstream s) {
    unsigned long long *row = fake_log[fake_log_n++ % FAKE_LOG];
    row[0] = kind, row[1] = (unsigned long long)(uintptr_t)e, row[2] = (unsigned long long)(uintptr_t)s;
}
static CUresult f_event_record(CUevent e, CUstream s) {
    if (!e) return CUDA_ERROR_INVALID_HANDLE;
    fake_records++;
    log_op(1, e, s);
    return CUDA_SUCCESS;
}
static CUresult f_wait_event(CUstream s, CUevent e, unsigned f) {
    (void)f;
    if (!e) return CUDA_ERROR_INVALID_HANDLE;
    fake_waits++;
    log_op(2, e, s);
    return CUDA_SUCCESS;
}

long long fake_streams = 0;
int fake_last_stream_flags = -1, fake_last_stream_priority = 99;
static CUresult f_stream_create(CUstream *s, unsigned flags, int prio) {
    fake_last_stream_flags = (int)flags; fake_last_stream_priority = prio;
    *s = (CUstream)(uintptr_t)(0x2000 + ++fake_streams);
    return CUDA_SUCCESS;
}
static CUresult f_stream_destroy(CUstream s) { if (!s) return CUDA_ERROR_INVALID_HANDLE; fake_streams--; return CUDA_SUCCESS; }

static void *lookup(const char *name, int ver) {
    fake_last_version_asked = ver;
    if (!strcmp(name, "cuMemcpyAsync")) return (void *)f_memcpy;
    if (!strcmp(name, "cuGetErrorString")) return (void *)f_err_string;
    if (!strcmp(name, "cuGetErrorName")) return (void *)f_err_name;
    if (!strcmp(name, "cuCtxGetCurrent")) return (void *)f_ctx_get;
    if (!strcmp(name, "cuCtxSetCurrent")) return (void *)f_ctx_set;
    if (!strcmp(name, "cuStreamGetCtx")) return (void *)f_stream_ctx;
    if (!strcmp(name, "cuModuleLoadData")) return (void *)f_module_load;
    if (!strcmp(name, "cuModuleGetFunction")) return (void *)f_get_function;
    if (!strcmp(name, "cuLaunchKernel")) return (void *)f_launch;
    if (!strcmp(name, "cuEventCreate")) return (void *)f_event_create;
    if (!strcmp(name, "cuEventDestroy")) return (void *)f_event_destroy;
    if (!strcmp(name, "cuEventRecord")) return (void *)f_event_record;
    if (!strcmp(name, "cuStreamWaitEvent")) return (void *)f_wait_event;
    if (!strcmp(name, "cuStreamCreateWithPriority")) return (void *)f_stream_create;
    if (!strcmp(name, "cuStreamDestroy")) return (void *)f_stream_destroy;
    if (!strcmp(name, "cuMemcpyBatchAsync") && version() >= 12080 && ver >= 12080)
        return ver >= 13000 ? (void *)f_batch_v2 : (void *)f_batch_v1;
    return NULL;
}

CUresult cuGetProcAddress_v2(const char *name, void **fn, int ver, cuuint64_t flags, CUdriverProcAddressQueryResult *q) {
    (void)flags;
    *fn = lookup(name, ver);
    *q = *fn ? CU_GET_PROC_ADDRESS_SUCCESS : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    return *fn ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}
