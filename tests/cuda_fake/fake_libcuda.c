/* Test double of libcuda.so.1 for CPU CI: host memcpy semantics for the few driver
 * entry points libnpu_offload_cuda.so resolves. Behaviour via env:
 *   FAKE_CUDA_VERSION  driver version reported (default 13000; 12080 -> 9-arg batch ABI)
 *   FAKE_CUDA_FAIL_AT  descriptor index (counted over the process) whose copy fails
 * Counters are exported for the tests (fake_*). */
#include <cuda.h>
#include <stdlib.h>
#include <string.h>

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

static CUresult f_memcpy(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st) {
    (void)st; fake_memcpy_calls++;
    return one(d, s, n) ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}
static CUresult f_batch_v2(CUdeviceptr *d, CUdeviceptr *s, size_t *z, size_t n, CUmemcpyAttributes *a, size_t *ai,
                           size_t na, CUstream st) {
    (void)ai; (void)na; (void)st;
    fake_batch_calls++; fake_last_order = a[0].srcAccessOrder;
    if ((long long)n > fake_max_batch) fake_max_batch = n;
    for (size_t i = 0; i < n; ++i) if (one(d[i], s[i], z[i])) return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}
static CUresult f_batch_v1(CUdeviceptr *d, CUdeviceptr *s, size_t *z, size_t n, CUmemcpyAttributes *a, size_t *ai,
                           size_t na, size_t *fail, CUstream st) {
    (void)ai; (void)na; (void)st;
    fake_batch_calls++; fake_last_order = a[0].srcAccessOrder;
    if ((long long)n > fake_max_batch) fake_max_batch = n;
    for (size_t i = 0; i < n; ++i) if (one(d[i], s[i], z[i])) { *fail = i; return CUDA_ERROR_INVALID_VALUE; }
    return CUDA_SUCCESS;
}
static CUresult f_err_string(CUresult r, const char **s) { *s = r == 1 ? "invalid argument" : "fake error"; return CUDA_SUCCESS; }
static CUresult f_err_name(CUresult r, const char **s) { *s = r == 1 ? "CUDA_ERROR_INVALID_VALUE" : "CUDA_ERROR_FAKE"; return CUDA_SUCCESS; }
static CUresult f_ctx_get(CUcontext *c) { *c = (CUcontext)0x1; return CUDA_SUCCESS; }
static CUresult f_ctx_set(CUcontext c) { (void)c; return CUDA_SUCCESS; }
static CUresult f_stream_ctx(CUstream s, CUcontext *c) { (void)s; *c = (CUcontext)0x1; return CUDA_SUCCESS; }

static void *lookup(const char *name, int ver) {
    fake_last_version_asked = ver;
    if (!strcmp(name, "cuMemcpyAsync")) return (void *)f_memcpy;
    if (!strcmp(name, "cuGetErrorString")) return (void *)f_err_string;
    if (!strcmp(name, "cuGetErrorName")) return (void *)f_err_name;
    if (!strcmp(name, "cuCtxGetCurrent")) return (void *)f_ctx_get;
    if (!strcmp(name, "cuCtxSetCurrent")) return (void *)f_ctx_set;
    if (!strcmp(name, "cuStreamGetCtx")) return (void *)f_stream_ctx;
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
