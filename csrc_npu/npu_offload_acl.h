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
    NPU_OFFLOAD_OUT_OF_RANGE = 5,    /* a block id outside the device tensors or the host buffer (bad input) */
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
typedef aclError (*acl_create_event_fn)(aclrtEvent *);
typedef aclError (*acl_create_event_ex_fn)(aclrtEvent *, uint32_t);
typedef aclError (*acl_destroy_event_fn)(aclrtEvent);
typedef aclError (*acl_record_event_fn)(aclrtEvent, aclrtStream);
typedef aclError (*acl_stream_wait_event_fn)(aclrtStream, aclrtEvent);

typedef struct {
    const char *library;  /* path that was dlopen'ed */
    acl_memcpy_async_fn memcpy_async;
    acl_get_device_fn get_device;
    acl_batch_v1_fn batch_v1;
    acl_batch_v2_fn batch_v2;
    acl_host_register_fn host_register;
    acl_host_unregister_fn host_unregister;
    acl_recent_err_fn recent_err;
    acl_create_event_fn create_event;
    acl_create_event_ex_fn create_event_ex; /* aclrtCreateEventExWithFlag: reusable events (newer CANN) */
    acl_destroy_event_fn destroy_event;
    acl_record_event_fn record_event;
    acl_stream_wait_event_fn stream_wait_event;
} npu_acl_symbols;

/* One staged transfer for npu_offload_acl_staged_run (staged_run.c); mirrored by StagedJob in
 * vllm_npu_offload/_native/acl.py. Slice i copies local descriptors [local_bounds[i], local_bounds[i+1])
 * (device pages <-> staging, device->device) and link descriptors [link_bounds[i], link_bounds[i+1])
 * (staging <-> host). */
typedef struct {
    int32_t store;          /* 1: gather then device->host; 0: host->device then scatter */
    int32_t link;           /* 0: only the gather/scatter of every slice, on `stream` (benchmarks) */
    int32_t batch;          /* 1: aclrtMemcpyBatchAsync(V2) when built and exported, else the loop */
    int32_t reserved;
    int64_t max_per_call;   /* descriptors per batch call, <= 0: all */
    void *stream;           /* the job's stream: link copies */
    void *aux;              /* the direction's aux stream: gather/scatter */
    void *const *events;    /* 1 + 2 * slots, from npu_offload_acl_events_create: entry, filled[], drained[] */
    int64_t slots;
    int64_t n_slices;
    const int64_t *local_src, *local_dst, *local_size, *local_bounds;
    const int64_t *link_src, *link_dst, *link_size, *link_bounds;
} npu_offload_staged_job;

/* One KV group of a staged transfer that the library plans itself (staged_plan.c); mirrored by
 * StagedGroup in vllm_npu_offload/_native/acl.py. */
typedef struct {
    const int64_t *pairs;       /* (5, n_pairs) int64 rows (CopyPlanner.pair_table): src base, src block
                                 * stride, dst base, dst block stride, page bytes; src/dst as the copy goes */
    int64_t n_pairs;
    int64_t span_lo, span_hi;   /* the bytes of a host record that the group's pages occupy */
    const int64_t *device_ids;  /* `blocks` device block ids, each < device_limit */
    const int64_t *host_ids;    /* their host block ids, in any order (planned ascending), each < host_blocks */
    int64_t blocks;
    int64_t device_limit;
} npu_offload_staged_group;

/* A staged transfer to plan (staging.py's Stager.plan in page form) and enqueue; mirrored by
 * StagedRequest. `job` is as for npu_offload_acl_staged_run, less n_slices and the arrays the plan
 * fills. The plan writes its page descriptors and then its link copies into the caller's
 * out_src/out_dst/out_size (room for `capacity`: pages + blocks always suffice), which must outlive
 * the copies; the slice bounds live in per-thread scratch (only read while enqueueing). */
typedef struct {
    npu_offload_staged_job job;
    const npu_offload_staged_group *groups;
    int64_t n_groups;
    int64_t slot_blocks;        /* records per staging slot */
    int64_t record_bytes;
    int64_t pages_end;          /* a group spanning [0, pages_end) owns whole records: its link runs merge */
    int64_t staging_base;       /* this direction's staging area */
    int64_t host_base;
    int64_t host_blocks;        /* records in the host buffer */
    int64_t min_slice_bytes, ramp, growth;  /* slice sizes (staging.py: MIN_SLICE_BYTES, RAMP, GROWTH) */
    int64_t *out_src, *out_dst, *out_size;
    int64_t capacity;
} npu_offload_staged_request;

/* The plan alone (tests, benchmarks): descriptors as for submit, bounds into the caller's arrays. */
typedef struct {
    int64_t *local_bounds, *link_bounds;  /* cap_slices + 1 each */
    int64_t cap_slices;
    int64_t n_slices, n_local, n_links;   /* filled */
} npu_offload_staged_plan_out;

/* staged_run.c (exported; staged_plan.c enqueues its plans with it) */
NPU_OFFLOAD_API int npu_offload_acl_staged_run(const npu_offload_staged_job *job, npu_offload_acl_error *err);

/* acl_symbols.c */
const npu_acl_symbols *npu_acl_load(npu_offload_acl_error *err);
/* Shared start of every copy call: clear err, validate the descriptors, load ACL.
 * Returns NPU_OFFLOAD_OK with *acl set (NULL when n == 0: nothing to do), else a status. */
int npu_copy_begin(npu_offload_acl_error *err, const int64_t *src, const int64_t *dst, const int64_t *sizes,
                   int64_t n, int direction, const npu_acl_symbols **acl);
int npu_acl_missing(npu_offload_acl_error *err, const char *symbol, const char *why);

/* batch_copy.c: the batch form to use (1 failIndex, 2 V2; 0 with err filled when none or not built),
 * and n validated descriptors submitted with it. */
int npu_batch_pick(const npu_acl_symbols *acl, npu_offload_acl_error *err);
int npu_batch_submit(const npu_acl_symbols *acl, int form, const int64_t *src, const int64_t *dst,
                     const int64_t *sizes, int64_t n, int direction, void *stream, int64_t max_per_call,
                     npu_offload_acl_error *err);
/* loop_copy.c: n validated descriptors, one aclrtMemcpyAsync each; the D2D address alignment check. */
int npu_loop_submit(const npu_acl_symbols *acl, const int64_t *src, const int64_t *dst, const int64_t *sizes,
                    int64_t n, int direction, void *stream, npu_offload_acl_error *err);
int npu_check_d2d_alignment(npu_offload_acl_error *err, const int64_t *src, const int64_t *dst, int64_t n);

/* errors.c */
void npu_err_clear(npu_offload_acl_error *err);
int npu_err_set(npu_offload_acl_error *err, int status, const char *call, int32_t acl_code, int64_t index,
                int64_t fail_index, const char *fmt, ...) __attribute__((format(printf, 7, 8)));
int npu_err_acl(npu_offload_acl_error *err, const npu_acl_symbols *acl, const char *call, aclError rc,
                int64_t index, int64_t fail_index);
int npu_check_descriptors(npu_offload_acl_error *err, const int64_t *src, const int64_t *dst,
                          const int64_t *sizes, int64_t n, int direction);

#endif /* NPU_OFFLOAD_ACL_H_ */
