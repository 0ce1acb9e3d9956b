/* Plain C ABI of libnpu_offload_cuda.so (loaded with ctypes; no torch, no -lcuda).
 *
 * Every entry point returns 0 on success or a nonzero code: a CUresult from the
 * driver, or one of the NPO_ERR_* codes below. On failure `msg` (if not NULL) gets
 * a NUL-terminated text naming the call, the descriptor index and the driver's
 * error string. Addresses and sizes are arrays of n 64-bit integers.
 */
#ifndef NPO_CUDA_H
#define NPO_CUDA_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define NPO_CUDA_ABI_VERSION 1

/* Built with -fvisibility=hidden: only these entry points are exported. */
#define NPO_EXPORT __attribute__((visibility("default")))

/* Library-level error codes (negative, never clash with CUresult). */
#define NPO_ERR_NO_DRIVER   (-1) /* libcuda.so.1 or a required symbol not found */
#define NPO_ERR_BAD_ARG     (-2) /* null array, null address or zero size */
#define NPO_ERR_UNSUPPORTED (-3) /* batch path asked for but not built / not resolved */

/* Modes reported by npo_cuda_built_mode / npo_cuda_runtime_mode. */
#define NPO_MODE_LOOP     0 /* cuMemcpyAsync per descriptor */
#define NPO_MODE_BATCH_V1 1 /* cuMemcpyBatchAsync, CUDA 12.8/12.9 ABI (size_t *failIdx) */
#define NPO_MODE_BATCH_V2 2 /* cuMemcpyBatchAsync_v2, CUDA 13 ABI (no failIdx) */

/* Largest number of descriptors handed to one driver call. */
#define NPO_BATCH_CHUNK 16384

NPO_EXPORT int npo_cuda_abi_version(void);

/* 1 if compiled with the cuMemcpyBatchAsync path, 0 if loop only. */
NPO_EXPORT int npo_cuda_built_mode(void);

/* Resolve the driver (once) and return the NPO_MODE_* in use, or a negative error
 * code with msg filled. *driver_version (if not NULL) gets cuDriverGetVersion's value. */
NPO_EXPORT int npo_cuda_runtime_mode(int *driver_version, char *msg, size_t msg_len);

/* Copy n descriptors on `stream` (a CUstream / cudaStream_t) with cuMemcpyBatchAsync,
 * in chunks of NPO_BATCH_CHUNK. src_order_any=1 lets the driver read the source out
 * of stream order (only for stable pinned host sources, i.e. loads). Falls back to
 * the loop when the batch symbol is unavailable or stream is the legacy NULL stream. */
NPO_EXPORT int npo_cuda_batch_copy(const uint64_t *src, const uint64_t *dst, const uint64_t *sizes, size_t n,
                        int src_order_any, void *stream, char *msg, size_t msg_len);

/* Copy n descriptors on `stream` with one cuMemcpyAsync each. */
NPO_EXPORT int npo_cuda_loop_copy(const uint64_t *src, const uint64_t *dst, const uint64_t *sizes, size_t n,
                       void *stream, char *msg, size_t msg_len);

#ifdef __cplusplus
}
#endif

#endif /* NPO_CUDA_H */
