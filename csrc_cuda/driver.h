/* Internal: the driver entry points resolved at run time, and error formatting. */
#ifndef NPO_DRIVER_H
#define NPO_DRIVER_H

#include <cuda.h>
#include <stddef.h>
#include <stdint.h>

#ifndef NPO_BATCH_MEMCPY
#define NPO_BATCH_MEMCPY 0
#endif
#if NPO_BATCH_MEMCPY && (!defined(CUDA_VERSION) || CUDA_VERSION < 12080)
#error "NPO_BATCH_MEMCPY=1 needs cuda.h from CUDA >= 12.8 (CUmemcpyAttributes)"
#endif

typedef CUresult (*npo_cuMemcpyAsync_t)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
typedef CUresult (*npo_cuGetErrorString_t)(CUresult, const char **);
typedef CUresult (*npo_cuGetErrorName_t)(CUresult, const char **);
typedef CUresult (*npo_cuCtxGetCurrent_t)(CUcontext *);
typedef CUresult (*npo_cuCtxSetCurrent_t)(CUcontext);
typedef CUresult (*npo_cuStreamGetCtx_t)(CUstream, CUcontext *);
typedef CUresult (*npo_cuModuleLoadData_t)(CUmodule *, const void *);
typedef CUresult (*npo_cuModuleGetFunction_t)(CUfunction *, CUmodule, const char *);
typedef CUresult (*npo_cuEventCreate_t)(CUevent *, unsigned);
typedef CUresult (*npo_cuEventDestroy_t)(CUevent);
typedef CUresult (*npo_cuEventRecord_t)(CUevent, CUstream);
typedef CUresult (*npo_cuStreamWaitEvent_t)(CUstream, CUevent, unsigned);
typedef CUresult (*npo_cuStreamCreateWithPriority_t)(CUstream *, unsigned, int);
typedef CUresult (*npo_cuStreamDestroy_t)(CUstream);
typedef CUresult (*npo_cuLaunchKernel_t)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                         unsigned, CUstream, void **, void **);
#if NPO_BATCH_MEMCPY
/* CUDA 12.8/12.9 ABI: failIdx before the stream. */
typedef CUresult (*npo_cuMemcpyBatchAsync_v1_t)(CUdeviceptr *, CUdeviceptr *, size_t *, size_t, CUmemcpyAttributes *,
                                                size_t *, size_t, size_t *, CUstream);
/* CUDA 13 ABI (cuMemcpyBatchAsync_v2): no failIdx. */
typedef CUresult (*npo_cuMemcpyBatchAsync_v2_t)(CUdeviceptr *, CUdeviceptr *, size_t *, size_t, CUmemcpyAttributes *,
                                                size_t *, size_t, CUstream);
#endif

typedef struct {
    int status;         /* 0 resolved, NPO_ERR_NO_DRIVER otherwise */
    int driver_version; /* cuDriverGetVersion */
    int mode;           /* NPO_MODE_* */
    char error[256];    /* why status != 0 */
    npo_cuMemcpyAsync_t memcpy_async;
    npo_cuGetErrorString_t get_error_string;
    npo_cuGetErrorName_t get_error_name;
    npo_cuCtxGetCurrent_t ctx_get_current;
    npo_cuCtxSetCurrent_t ctx_set_current;
    npo_cuStreamGetCtx_t stream_get_ctx;
    /* Optional (the gather kernel only): NULL when the driver lacks them. */
    npo_cuModuleLoadData_t module_load_data;
    npo_cuModuleGetFunction_t module_get_function;
    npo_cuLaunchKernel_t launch_kernel;
    /* Optional (the fused staged pipeline only). */
    npo_cuEventCreate_t event_create;
    npo_cuEventDestroy_t event_destroy;
    npo_cuEventRecord_t event_record;
    npo_cuStreamWaitEvent_t stream_wait_event;
    /* Optional (dedicated transfer streams). */
    npo_cuStreamCreateWithPriority_t stream_create;
    npo_cuStreamDestroy_t stream_destroy;
#if NPO_BATCH_MEMCPY
    npo_cuMemcpyBatchAsync_v1_t batch_v1;
    npo_cuMemcpyBatchAsync_v2_t batch_v2;
#endif
} npo_driver;

/* The resolved driver (resolution runs once, thread-safe). Never NULL. */
const npo_driver *npo_driver_get(void);

/* Write "<call> failed at descriptor <index>: <NAME>: <text>" into msg; returns rc. */
int npo_fail(const npo_driver *drv, int rc, const char *call, long long index, char *msg, size_t msg_len);

/* Like snprintf into msg for library errors; returns rc. */
int npo_failf(int rc, char *msg, size_t msg_len, const char *fmt, ...);

/* Common entry checks: driver resolved, arrays present, a context current on this
 * thread (taken from the stream when the caller's thread has none). */
int npo_prepare(const npo_driver **drv, const uint64_t *src, const uint64_t *dst, const uint64_t *sizes, size_t n,
                void *stream, const char *call, char *msg, size_t msg_len);

/* Make a context current on this thread when it has none: the one `stream` belongs to. */
int npo_bind_context(const npo_driver *drv, void *stream, char *msg, size_t msg_len);

/* cuMemcpyBatchAsync in chunks (the loop where the batch call is unavailable); no checks. */
int npo_batch_range(const npo_driver *drv, const uint64_t *src, const uint64_t *dst, const uint64_t *sizes, size_t n,
                    int src_order_any, CUstream stream, char *msg, size_t msg_len);

/* The gather kernel (gather_launch.cc): resolve it for the current context (binding the
 * stream's when none is current), then launch it over device-resident columns. */
typedef struct {
    void *pages; /* npo_gather_pages: per-page descriptor columns */
    void *table; /* npo_gather_table: pair table + block ids */
    void *table_inline; /* npo_gather_table_inline: the same, block ids in the launch parameters */
} npo_gather_fns;
int npo_gather_ready(const npo_driver *drv, void *stream, npo_gather_fns *fns, char *msg, size_t msg_len);
int npo_gather_launch(const npo_driver *drv, void *fn, const uint64_t cols[3], uint64_t first, uint64_t width,
                      uint64_t rows, uint64_t stride, uint64_t min_page, int programs, void *stream, char *msg,
                      size_t msg_len);

int npo_table_launch(const npo_driver *drv, void *fn, uint64_t table, uint64_t m, uint64_t src_ids, uint64_t dst_ids,
                     uint64_t b0, uint64_t nb, uint64_t min_page, int programs, void *stream, char *msg,
                     size_t msg_len);
/* The same with the range's nb <= NPO_INLINE_IDS block ids copied into the launch parameters
 * from host memory (src_ids[0..nb), dst_ids[0..nb)). */
int npo_table_inline_launch(const npo_driver *drv, void *fn, uint64_t table, uint64_t m, const int64_t *src_ids,
                            const int64_t *dst_ids, uint64_t nb, uint64_t min_page, int programs, void *stream,
                            char *msg, size_t msg_len);

/* The per-descriptor loop (used by loop_copy and as the batch fallback). */
int npo_loop_range(const npo_driver *drv, const uint64_t *src, const uint64_t *dst, const uint64_t *sizes, size_t begin,
                   size_t end, CUstream stream, char *msg, size_t msg_len);

#endif /* NPO_DRIVER_H */
