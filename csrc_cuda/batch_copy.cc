// cuMemcpyBatchAsync in chunks of NPO_BATCH_CHUNK descriptors (very large single
// batches crashed drivers at ~52k). Stores must read the device source in stream
// order (srcAccessOrder=STREAM); loads from stable pinned host memory may use ANY.
#include <string.h>

#include "driver.h"
#include "npo_cuda.h"

int npo_batch_range(const npo_driver *drv, const uint64_t *src, const uint64_t *dst, const uint64_t *sizes, size_t n,
                    int src_order_any, CUstream stream, char *msg, size_t msg_len) {
#if NPO_BATCH_MEMCPY
    // The batch API rejects the legacy NULL stream; so do drivers < 12.8: loop there.
    if (drv->mode != NPO_MODE_LOOP && stream != nullptr) {
        CUmemcpyAttributes attr;
        memset(&attr, 0, sizeof(attr));
        attr.srcAccessOrder = src_order_any ? CU_MEMCPY_SRC_ACCESS_ORDER_ANY : CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
        attr.flags = CU_MEMCPY_FLAG_DEFAULT;
        size_t attr_idx = 0;  // attribute 0 applies from descriptor 0 on
        // The driver takes non-const arrays but only reads them during the call.
        CUdeviceptr *s = reinterpret_cast<CUdeviceptr *>(const_cast<uint64_t *>(src));
        CUdeviceptr *d = reinterpret_cast<CUdeviceptr *>(const_cast<uint64_t *>(dst));
        size_t *z = reinterpret_cast<size_t *>(const_cast<uint64_t *>(sizes));
        static_assert(sizeof(CUdeviceptr) == sizeof(uint64_t) && sizeof(size_t) == sizeof(uint64_t),
                      "descriptor arrays are 64-bit");
        for (size_t off = 0; off < n; off += NPO_BATCH_CHUNK) {
            size_t cnt = n - off < NPO_BATCH_CHUNK ? n - off : NPO_BATCH_CHUNK;
            CUresult r;
            long long where = (long long)off;
            if (drv->mode == NPO_MODE_BATCH_V2) {
                r = drv->batch_v2(d + off, s + off, z + off, cnt, &attr, &attr_idx, 1, stream);
            } else {
                size_t fail_idx = (size_t)-1;
                r = drv->batch_v1(d + off, s + off, z + off, cnt, &attr, &attr_idx, 1, &fail_idx, stream);
                if (fail_idx != (size_t)-1 && fail_idx < cnt) where = (long long)(off + fail_idx);
            }
            if (r != CUDA_SUCCESS) {
                // _v2 does not say which descriptor failed: name the first of the chunk.
                return npo_fail(drv, r,
                                drv->mode == NPO_MODE_BATCH_V2 ? "cuMemcpyBatchAsync_v2 (index is the first of the failing chunk)"
                                                               : "cuMemcpyBatchAsync",
                                where, msg, msg_len);
            }
        }
        return 0;
    }
#else
    (void)src_order_any;
#endif
    return npo_loop_range(drv, src, dst, sizes, 0, n, stream, msg, msg_len);
}

extern "C" int npo_cuda_batch_copy(const uint64_t *src, const uint64_t *dst, const uint64_t *sizes, size_t n,
                                   int src_order_any, void *stream, char *msg, size_t msg_len) {
    const npo_driver *drv;
    int rc = npo_prepare(&drv, src, dst, sizes, n, stream, "cuMemcpyBatchAsync", msg, msg_len);
    if (rc != 0 || n == 0) return rc;
    return npo_batch_range(drv, src, dst, sizes, n, src_order_any, (CUstream)stream, msg, msg_len);
}
