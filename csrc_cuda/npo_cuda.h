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

#define NPO_CUDA_ABI_VERSION 10

/* Built with -fvisibility=hidden: only these entry points are exported. */
#define NPO_EXPORT __attribute__((visibility("default")))

/* Library-level error codes (negative, never clash with CUresult). */
#define NPO_ERR_NO_DRIVER   (-1) /* libcuda.so.1 or a required symbol not found */
#define NPO_ERR_BAD_ARG     (-2) /* null array, null address or zero size */
#define NPO_ERR_UNSUPPORTED (-3) /* batch path asked for but not built / not resolved */
#define NPO_ERR_RANGE       (-4) /* a block id outside the device tensors or the host buffer (bad input) */

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

/* 1 if the gather kernel (gather_kernel.cu, needs nvcc at build time) is compiled in. */
NPO_EXPORT int npo_cuda_gather_built(void);

/* Load the gather kernel into the calling thread's current context now (the worker's start), not at
 * its first launch: loading may wait for the device. 0, or an error naming the call. */
NPO_EXPORT int npo_cuda_gather_load(char *msg, size_t msg_len);

/* Device-local gather/scatter: copy descriptors first + r * stride + c (r < rows,
 * c < width) whose columns src/dst/size are DEVICE arrays (uploaded by the caller), with
 * one kernel of at most `programs` blocks (so at most that many SMs) on `stream`.
 * min_page (the smallest page size) sizes the lane groups. Addresses must be device
 * memory or pinned host memory mapped into the device's address space. */
NPO_EXPORT int npo_cuda_gather(uint64_t src, uint64_t dst, uint64_t size, uint64_t first, uint64_t width,
                               uint64_t rows, uint64_t stride, uint64_t min_page, int programs, void *stream,
                               char *msg, size_t msg_len);

/* One staged transfer, as npo_cuda_staged_submit plans and enqueues it whole (see staging.py for
 * the pipeline). Page addresses come from pair tables on the device ((5, m) int64 rows:
 * src base, src block stride, dst base, dst block stride, bytes; uploaded once per KV
 * group and direction) and this transfer's block ids, uploaded here in one copy. Per
 * slice s: the ranges ranges[range_off[s] .. range_off[s+1]) (4 values each: table
 * pointer, m, first block, blocks; gather/scatter on `aux`) and the link descriptors
 * link_bounds[s] .. link_bounds[s+1] (copy engines on `stream`). */
typedef struct {
    int store;                 /* 1: gather on aux, then link on stream; 0: link, then scatter */
    int programs;              /* gather blocks (SMs): 1..1024 */
    void *stream;              /* the job's stream (CUstream) */
    void *aux;                 /* the direction's aux stream */
    const int64_t *host_ids;   /* pinned: src block ids (n_ids), then dst block ids (n_ids) */
    uint64_t dev_ids;          /* device buffer of 2 * n_ids int64 they are uploaded to */
    uint64_t n_ids;
    uint64_t min_page;         /* smallest page: sizes the kernel's lane groups */
    uint64_t n_slices;
    uint64_t slots;
    const uint64_t *range_off; /* n_slices + 1 */
    const uint64_t *ranges;
    const uint64_t *link_src, *link_dst, *link_size;
    const uint64_t *link_bounds; /* n_slices + 1 */
    void *const *events;         /* 1 + 2 * slots CUevents: entry, filled[slots], drained[slots] */
    int skip_link;               /* benchmarks: the device-local copies alone */
} npo_staged_job;

/* One KV group's part of a staged transfer that the library plans itself (npo_cuda_staged_submit). */
typedef struct {
    uint64_t table;             /* the group's pair table on the device ((5, pairs) int64 rows) */
    uint64_t pairs;
    uint64_t span_lo, span_hi;  /* the bytes of a host record that the group's pages occupy */
    const int64_t *device_ids;  /* `blocks` device block ids, each < device_limit */
    const int64_t *host_ids;    /* their host block ids, in any order (planned ascending), each < host_blocks */
    uint64_t blocks;
    uint64_t device_limit;      /* the group's device blocks (NPO_ERR_RANGE past it) */
} npo_staged_group;
/* A staged transfer to plan (staging.py's Stager.plan, in C) and enqueue. `job` is the transfer's,
 * less what the plan fills in (n_ids, n_slices and every array); its
 * host_ids is pinned room for ids_capacity int64 ids (2 per block), which the plan fills. */
typedef struct {
    npo_staged_job job;
    uint64_t ids_capacity;
    const npo_staged_group *groups;
    uint64_t n_groups;
    uint64_t slot_blocks;       /* records per staging slot */
    uint64_t record_bytes;
    uint64_t pages_end;         /* a group spanning [0, pages_end) owns whole records: its runs merge */
    uint64_t staging_base;      /* this direction's staging area */
    uint64_t host_base;
    uint64_t host_blocks;       /* the host buffer's blocks (NPO_ERR_RANGE past it) */
    uint64_t min_slice_bytes, ramp, growth;  /* slice sizes (staging.py: MIN_SLICE_BYTES, RAMP, GROWTH) */
    /* The engine's stream order, when it hands it over (each NULL: skipped): `compute`'s work so
     * far is marked by `compute_mark` (an event of its own, not one of job.events); a store's
     * job.stream waits for it, a load's scatters do (its link copies into staging need not: a load
     * records the mark after its first link batch, a store before anything). Then
     * job.stream waits for `after` (the direction's previous job's end) and records `start`; after
     * the copies it records `end`, also when a copy fails to enqueue (the engine then sees the job
     * finish and fail). */
    void *compute, *compute_mark, *after, *start, *end;
} npo_staged_request;
/* The plan alone, into the caller's arrays (capacities in entries; tests, benchmarks). */
typedef struct {
    uint64_t *range_off, *ranges, *link_src, *link_dst, *link_size, *link_bounds;
    uint64_t cap_slices, cap_ranges, cap_links;
    uint64_t n_slices, n_ranges, n_links;  /* filled */
} npo_staged_plan_out;
NPO_EXPORT int npo_cuda_staged_plan(const npo_staged_request *req, npo_staged_plan_out *out, char *msg,
                                    size_t msg_len);
/* Plan and enqueue one staged transfer in one call; *links gets its link copy count. */
NPO_EXPORT int npo_cuda_staged_submit(const npo_staged_request *req, uint64_t *links, char *msg, size_t msg_len);
/* Timing-disabled CUevents for the pipeline (created in the current or primary context). */
NPO_EXPORT int npo_cuda_events_create(size_t n, void **out, char *msg, size_t msg_len);
NPO_EXPORT int npo_cuda_events_destroy(size_t n, void **events, char *msg, size_t msg_len);

/* A non-blocking stream of the caller's own, created by the driver with `priority` (0: the
 * default; lower is higher): transfer streams must never be one of torch's pooled streams,
 * which are handed out round-robin and can be the stream the model computes on. */
NPO_EXPORT int npo_cuda_stream_create(int priority, void **out, char *msg, size_t msg_len);
NPO_EXPORT int npo_cuda_stream_destroy(void *stream, char *msg, size_t msg_len);

#ifdef __cplusplus
}
#endif

#endif /* NPO_CUDA_H */
