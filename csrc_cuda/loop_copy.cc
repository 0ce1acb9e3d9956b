// One cuMemcpyAsync per descriptor: the path for drivers without cuMemcpyBatchAsync,
// builds with the batch path off, and the per-copy baseline in benchmarks.
#include "driver.h"
#include "npo_cuda.h"

int npo_loop_range(const npo_driver *drv, const uint64_t *src, const uint64_t *dst, const uint64_t *sizes, size_t begin,
                   size_t end, CUstream stream, char *msg, size_t msg_len) {
    for (size_t i = begin; i < end; ++i) {
        CUresult rc = drv->memcpy_async((CUdeviceptr)dst[i], (CUdeviceptr)src[i], (size_t)sizes[i], stream);
        if (rc != CUDA_SUCCESS) return npo_fail(drv, rc, "cuMemcpyAsync", (long long)i, msg, msg_len);
    }
    return 0;
}

extern "C" int npo_cuda_loop_copy(const uint64_t *src, const uint64_t *dst, const uint64_t *sizes, size_t n,
                                  void *stream, char *msg, size_t msg_len) {
    const npo_driver *drv;
    int rc = npo_prepare(&drv, src, dst, sizes, n, stream, "cuMemcpyAsync", msg, msg_len);
    if (rc != 0 || n == 0) return rc;
    return npo_loop_range(drv, src, dst, sizes, 0, n, (CUstream)stream, msg, msg_len);
}
