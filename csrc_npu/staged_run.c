/*
 * npu_offload_acl_staged_run: enqueue a whole staged transfer in one call, in exactly the order of
 * Stager.run's Python loop (vllm_npu_offload/staging.py): per slice the device->device
 * gather/scatter on the aux stream, the link copies on the job's stream, and the slot events
 * between them. Copies go through the batch path (one aclrtMemcpyBatchAsync(V2) call per slice
 * and side) when it is built and exported, else the per-copy aclrtMemcpyAsync loop. Done in C
 * because every slice costs several runtime calls, each tens of microseconds from Python.
 * Every return code is checked; a failure names the call and the slice.
 */
#include <stdio.h>
#include <string.h>

#include "npu_offload_acl.h"

typedef struct {
    const npu_acl_symbols *acl;
    const npu_offload_staged_job *job;
    npu_offload_acl_error *err;
    int form;       /* batch form (1, 2), 0: the aclrtMemcpyAsync loop */
    int64_t slice;  /* the slice being enqueued, for messages */
} run_ctx;

/* Append which slice (and which of its parts) failed; make descriptor indices transfer-wide. */
static int in_slice(const run_ctx *c, int rc, const char *part, int64_t first) {
    npu_offload_acl_error *err = c->err;
    if (err->index >= 0) err->index += first;
    if (err->fail_index >= 0) err->fail_index += first;
    size_t used = strlen(err->message);
    snprintf(err->message + used, sizeof(err->message) - used, " (staged slice %lld of %lld, %s)",
             (long long)c->slice, (long long)c->job->n_slices, part);
    return rc;
}

static int event_call(const run_ctx *c, aclError rc, const char *call) {
    if (rc == ACL_SUCCESS) return NPU_OFFLOAD_OK;
    return in_slice(c, npu_err_acl(c->err, c->acl, call, rc, -1, -1), "slot event", 0);
}

static int record(const run_ctx *c, void *event, void *stream) {
    return event_call(c, c->acl->record_event(event, stream), "aclrtRecordEvent");
}

static int wait_event(const run_ctx *c, void *stream, void *event) {
    return event_call(c, c->acl->stream_wait_event(stream, event), "aclrtStreamWaitEvent");
}

/* The current slice's descriptors of one side, on `stream`. */
static int copies(const run_ctx *c, int link, void *stream) {
    const npu_offload_staged_job *j = c->job;
    const int64_t *b = link ? j->link_bounds : j->local_bounds;
    const int64_t k0 = b[c->slice], n = b[c->slice + 1] - k0;
    if (n == 0) return NPU_OFFLOAD_OK;
    const int64_t *src = (link ? j->link_src : j->local_src) + k0, *dst = (link ? j->link_dst : j->local_dst) + k0;
    const int64_t *sizes = (link ? j->link_size : j->local_size) + k0;
    int direction = !link ? NPU_OFFLOAD_D2D : j->store ? NPU_OFFLOAD_D2H : NPU_OFFLOAD_H2D;
    int rc = c->form ? npu_batch_submit(c->acl, c->form, src, dst, sizes, n, direction, stream, j->max_per_call, c->err)
                     : npu_loop_submit(c->acl, src, dst, sizes, n, direction, stream, c->err);
    if (rc == NPU_OFFLOAD_OK) return rc;
    return in_slice(c, rc, link ? (j->store ? "link copy device->host" : "link copy host->device")
                                : (j->store ? "gather" : "scatter"), k0);
}

static int bad(npu_offload_acl_error *err, const char *what) {
    return npu_err_set(err, NPU_OFFLOAD_BAD_ARGUMENT, "argument", 0, -1, -1, "npu_offload_acl_staged_run: %s", what);
}

/* Slice bounds must start at 0 and never decrease: each slice is a contiguous descriptor range. */
static int check_bounds(npu_offload_acl_error *err, const int64_t *b, int64_t n_slices, const char *side) {
    if (!b) return npu_err_set(err, NPU_OFFLOAD_BAD_ARGUMENT, "argument", 0, -1, -1,
                               "npu_offload_acl_staged_run: null %s bounds", side);
    for (int64_t i = 0; i < n_slices; i++)
        if (b[0] != 0 || b[i + 1] < b[i])
            return npu_err_set(err, NPU_OFFLOAD_BAD_ARGUMENT, "argument", 0, -1, -1,
                               "npu_offload_acl_staged_run: %s bounds of slice %lld are [%lld, %lld) (first %lld)",
                               side, (long long)i, (long long)b[i], (long long)b[i + 1], (long long)b[0]);
    return NPU_OFFLOAD_OK;
}

/* Everything that can be checked is checked before the first call: a bad job fails whole. */
static int check_job(const npu_offload_staged_job *j, npu_offload_acl_error *err) {
    int rc;
    if (!j) return bad(err, "null job");
    if (j->n_slices < 0 || !j->stream) return bad(err, "negative slice count or null stream");
    if (j->link && (!j->aux || !j->events || j->slots < 1)) return bad(err, "null aux stream or events, or slots < 1");
    if ((rc = check_bounds(err, j->local_bounds, j->n_slices, "local")) != NPU_OFFLOAD_OK) return rc;
    rc = npu_check_descriptors(err, j->local_src, j->local_dst, j->local_size, j->local_bounds[j->n_slices],
                               NPU_OFFLOAD_D2D);
    if (rc != NPU_OFFLOAD_OK || !j->link) return rc;
    if ((rc = check_bounds(err, j->link_bounds, j->n_slices, "link")) != NPU_OFFLOAD_OK) return rc;
    return npu_check_descriptors(err, j->link_src, j->link_dst, j->link_size, j->link_bounds[j->n_slices],
                                 j->store ? NPU_OFFLOAD_D2H : NPU_OFFLOAD_H2D);
}

/* The calls this job makes, resolved; the batch form, or 0 for the loop (toggle off, symbol absent). */
static int resolve(run_ctx *c) {
    const npu_offload_staged_job *j = c->job;
    npu_offload_acl_error scratch;
    c->form = j->batch ? npu_batch_pick(c->acl, &scratch) : 0;
    if (!c->form && !c->acl->memcpy_async) return npu_acl_missing(c->err, "aclrtMemcpyAsync", "");
    if (j->link && !c->acl->record_event) return npu_acl_missing(c->err, "aclrtRecordEvent", "");
    if (j->link && !c->acl->stream_wait_event) return npu_acl_missing(c->err, "aclrtStreamWaitEvent", "");
    if (!c->form)  /* the loop's D2D copies need aligned addresses: fail whole, not half-copied */
        return npu_check_d2d_alignment(c->err, j->local_src, j->local_dst, j->local_bounds[j->n_slices]);
    return NPU_OFFLOAD_OK;
}

NPU_OFFLOAD_API int npu_offload_acl_staged_run(const npu_offload_staged_job *job, npu_offload_acl_error *err) {
    npu_err_clear(err);
    int rc = check_job(job, err);
    if (rc != NPU_OFFLOAD_OK || job->n_slices == 0) return rc;
    run_ctx c = {npu_acl_load(err), job, err, 0, 0};
    if (!c.acl) return NPU_OFFLOAD_MISSING;
    if ((rc = resolve(&c)) != NPU_OFFLOAD_OK) return rc;
    const int64_t n = job->n_slices;
    if (!job->link) {  /* gather/scatter only, all on the job's stream (as Stager.run's link=False) */
        for (c.slice = 0; c.slice < n; c.slice++)
            if ((rc = copies(&c, 0, job->stream)) != NPU_OFFLOAD_OK) return rc;
        return NPU_OFFLOAD_OK;
    }
    void *stream = job->stream, *aux = job->aux, *entry = job->events[0];
    void *const *filled = job->events + 1, *const *drained = job->events + 1 + job->slots;
    const int store = job->store != 0;
    /* Compute and earlier jobs first: the engine ordered the job stream; a store's aux follows it. A
       load's scatters on aux wait for their slices' link copies (filled, recorded on the stream after
       them, so after all the stream waited for): its first link copy goes first, two ACL calls sooner. */
    if (store && ((rc = record(&c, entry, stream)) || (rc = wait_event(&c, aux, entry)))) return rc;
    for (c.slice = 0; c.slice < n; c.slice++) {
        const int64_t s = c.slice % job->slots;
        /* the slot's previous slice must be through both copies */
        if (c.slice >= job->slots && (rc = wait_event(&c, store ? aux : stream, drained[s]))) return rc;
        if (store) {  /* gather on aux, then the link copy on the job stream */
            if ((rc = copies(&c, 0, aux)) || (rc = record(&c, filled[s], aux)) ||
                (rc = wait_event(&c, stream, filled[s])) || (rc = copies(&c, 1, stream)) ||
                (rc = record(&c, drained[s], stream)))
                return rc;
        } else {  /* the link copy on the job stream, then scatter on aux */
            if ((rc = copies(&c, 1, stream)) || (rc = record(&c, filled[s], stream)) ||
                (rc = wait_event(&c, aux, filled[s])) || (rc = copies(&c, 0, aux)) ||
                (rc = record(&c, drained[s], aux)))
                return rc;
        }
    }
    c.slice = n - 1;  /* a load's stream ends after its last scatter */
    return store ? NPU_OFFLOAD_OK : wait_event(&c, stream, drained[(n - 1) % job->slots]);
}
