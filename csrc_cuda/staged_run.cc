// npo_staged_run_job: enqueue a whole planned staged transfer for npo_cuda_staged_submit (the slice
// pipeline of vllm_npu_offload/staging.py): the block-id upload, the gather/scatter launches (on the
// direction's aux stream, except the one on the critical path), the link copies on the job's
// stream, and the slot events between them. Every driver call is checked; a failure names the call and
// the slice. Done in C because each slice costs several driver calls, and from Python
// each cost tens of microseconds that the device spends waiting on small transfers.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "driver.h"
#include "gather_body.h"
#include "npo_cuda.h"
#include "staged_run.h"

namespace {

int pipeline_ready(const npo_driver *drv, char *msg, size_t msg_len) {
    if (!drv->event_record || !drv->stream_wait_event)
        return npo_failf(NPO_ERR_UNSUPPORTED, msg, msg_len, "npo_cuda_staged_submit: the driver lacks cuEventRecord/"
                         "cuStreamWaitEvent");
    return 0;
}

struct Ctx {
    const npo_driver *drv;
    char *msg;
    size_t msg_len;
    uint64_t slice;

    int check(CUresult r, const char *call) const {
        if (r == CUDA_SUCCESS) return 0;
        char what[160];
        snprintf(what, sizeof(what), "%s (staged slice %llu)", call, (unsigned long long)slice);
        return npo_fail(drv, r, what, -1, msg, msg_len);
    }
    int record(CUevent e, CUstream s) const { return check(drv->event_record(e, s), "cuEventRecord"); }
    int wait(CUstream s, CUevent e) const { return check(drv->stream_wait_event(s, e, 0), "cuStreamWaitEvent"); }
};

}  // namespace

int npo_staged_run_job(const npo_staged_job *job, void *scatter_after, void *mark_on, char *msg, size_t msg_len) {
    const npo_driver *drv = npo_driver_get();
    if (!job) return npo_failf(NPO_ERR_BAD_ARG, msg, msg_len, "npo_cuda_staged_submit: null job");
    npo_gather_fns fns = {nullptr, nullptr, nullptr};
    int rc = npo_gather_ready(drv, job->stream, &fns, msg, msg_len);
    if (rc == 0) rc = pipeline_ready(drv, msg, msg_len);
    if (rc != 0) return rc;
    if (!job->stream || !job->aux || !job->events || job->slots < 1 || !job->host_ids || !job->dev_ids ||
        !job->n_ids || !job->range_off || !job->ranges || !job->link_bounds)
        return npo_failf(NPO_ERR_BAD_ARG, msg, msg_len,
                         "npo_cuda_staged_submit: bad job (null stream, events, ids or arrays; slots=%llu, n_ids=%llu)",
                         (unsigned long long)job->slots, (unsigned long long)job->n_ids);
    const uint64_t n_link = job->skip_link ? 0 : job->link_bounds[job->n_slices];
    for (uint64_t i = 0; i < n_link; ++i)
        if (!job->link_src[i] || !job->link_dst[i] || !job->link_size[i])
            return npo_failf(NPO_ERR_BAD_ARG, msg, msg_len, "npo_cuda_staged_submit: link descriptor %llu is invalid "
                             "(src=0x%llx dst=0x%llx size=%llu)", (unsigned long long)i,
                             (unsigned long long)job->link_src[i], (unsigned long long)job->link_dst[i],
                             (unsigned long long)job->link_size[i]);
    CUstream stream = (CUstream)job->stream, aux = (CUstream)job->aux;
    CUevent entry = (CUevent)job->events[0];
    CUevent const *filled = (CUevent const *)job->events + 1;
    CUevent const *drained = (CUevent const *)job->events + 1 + job->slots;
    Ctx c{drv, msg, msg_len, 0};
    const bool store = job->store != 0, link = !job->skip_link;
    // A load writes the KV pages only in its scatters: they alone wait for the model's stream
    // (attention may still read or write a reused block), the link copies do not.
    const CUevent model = store ? nullptr : (CUevent)scatter_after;
    // The model's mark, recorded once before anything waits for it (npo_staged_request: a load's).
    bool mark_pending = model && mark_on;
    auto mark = [&]() {
        if (!mark_pending) return 0;
        mark_pending = false;
        return c.check(drv->event_record(model, (CUstream)mark_on), "cuEventRecord (the compute stream's mark)");
    };
    const uint64_t n = job->n_slices;
    // The unhidden slice (a store's first gather, a load's last scatter) runs on the job stream
    // itself: no cross-stream event hop on the transfer's critical path. The other slices'
    // gathers/scatters run on aux, after that one (stores) or before it (loads), so at most
    // one gather kernel runs at a time (a load's last scatter may overlap the one before it).
    const uint64_t own = !link || !n ? UINT64_MAX : (store ? 0 : n - 1);
    // This transfer's block ids (both sides, 16 bytes per block) in one copy to the device.
    const CUdeviceptr ids_dst = (CUdeviceptr)job->dev_ids, ids_src = (CUdeviceptr)(uintptr_t)job->host_ids;
    // A store's first gather takes its block ids inside its launch parameters (when they fit), so
    // it starts at once: waiting for the upload was the longest gap before the first link copy.
    // The later gathers read the uploaded copy, made on aux meanwhile (every gather inline, with no
    // upload at all, made the model's concurrent decode steps no faster on an H200: docs/benchmarks.md).
    bool inline_first = store && own == 0 && fns.table_inline;
    for (uint64_t g = job->range_off[0]; inline_first && g < job->range_off[1]; ++g)
        inline_first = job->ranges[4 * g + 3] <= NPO_INLINE_IDS;
    // A load's every scatter takes its ids in its launch parameters when each range fits, so the ids
    // go to the device neither in a copy of their own nor in a link batch: nothing of the load is
    // written to device memory before the model's mark, the first link copy starts at once, and the
    // last scatter waits for the model's mark alone (on an H200 the library's call alone came
    // 0.3-1.5 points nearer one contiguous copy on loads: docs/benchmarks.md).
    // A load with a longer range sends its ids as one more descriptor of its first link batch: a copy
    // of their own (another host->device operation) delayed the first link copy by ~4.5 us. Every
    // scatter comes after that batch (aux waits for it, the last one follows it on the stream). Not
    // when the link copies start before the model's stream is through (`model`): they are then
    // uploaded on aux after the model's mark, and the load's last scatter (on the stream) waits for
    // that upload too. Written at once, they crashed vLLM 0.23's serving once (an illegal address),
    // when their device buffer was allocated on the model's stream and could be memory a kernel of
    // the step in flight still read. It is allocated on a stream of ours now
    // (CudaStagedPipeline._device_ids), which rules that out; the ids still wait for the mark, since
    // the crash's mechanism was inferred, not observed (sending them in the batch gained 0-4 us).
    bool load_inline = !store && link && n && fns.table_inline;
    for (uint64_t g = job->range_off[0]; load_inline && g < job->range_off[n]; ++g)
        load_inline = job->ranges[4 * g + 3] <= NPO_INLINE_IDS;
    const bool ids_in_link = !store && link && n && !model && !load_inline;
    const bool ids_after_model = !store && link && n && model && !load_inline;
    auto upload = [&](CUstream s) {
        return c.check(drv->memcpy_async(ids_dst, ids_src, 16 * job->n_ids, s), "cuMemcpyAsync (block id upload)");
    };
    // A one-slice store with inline ids needs no upload at all; any other upload on aux is
    // followed by a gather there that the job stream waits for (or by the final wait below).
    const bool need_upload = !ids_in_link && !load_inline && !(inline_first && n == 1);
    // A load with its ids inline orders aux in the loop, not here: each scatter on aux waits for its
    // slice's link batch (filled, recorded on the stream after it, so after all the stream waited for:
    // compute, earlier jobs), and aux waits for the model's mark once the first link batch is enqueued.
    // The driver calls before the first link copy are then the engine's order alone (two fewer here,
    // one moved behind it): they sit on every load's critical path.
    const bool aux_in_loop = load_inline;
    if (store && own == 0 && !inline_first) {
        rc = upload(stream);
    } else if (!aux_in_loop) {
        // Compute and earlier jobs first: the engine ordered the job stream; aux follows it.
        if ((rc = c.record(entry, stream)) || (rc = c.wait(aux, entry))) return rc;
        if (model && ((rc = mark()) || (rc = c.wait(aux, model)))) return rc;
        // Before the first link batch, not after it: a load's upload enqueued after that batch
        // waited behind it for the host-to-device copy engine, and every scatter with it (H200,
        // 2026-11-27: the library's call alone fell from 95-99% of one contiguous copy to 91-92% on two
        // shapes of three).
        // A store's first gather gained nothing from it either (docs/benchmarks.md).
        if (need_upload) rc = upload(aux);
        // entry again, now on aux: the ids are on the device (the load's last scatter waits for it)
        if (!rc && ids_after_model) rc = c.record(entry, aux);
    }
    if (rc) return rc;
    const uint64_t dev_src = job->dev_ids, dev_dst = job->dev_ids + 8 * job->n_ids;
    auto link_with_ids = [&](uint64_t k0, uint64_t k1) {  // a load's first link batch, then the ids
        const uint64_t m = k1 - k0;
        uint64_t *fs = (uint64_t *)malloc(3 * 8 * (m + 1));
        if (!fs)
            return npo_failf(NPO_ERR_BAD_ARG, msg, msg_len, "npo_cuda_staged_submit: malloc failed for the first "
                             "slice's %llu link descriptors (out of host memory)", (unsigned long long)(m + 1));
        uint64_t *fd = fs + m + 1, *fz = fd + m + 1;
        memcpy(fs, job->link_src + k0, 8 * m);
        memcpy(fd, job->link_dst + k0, 8 * m);
        memcpy(fz, job->link_size + k0, 8 * m);
        fs[m] = ids_src;
        fd[m] = ids_dst;
        fz[m] = 16 * job->n_ids;
        int r = npo_batch_range(drv, fs, fd, fz, m + 1, 1, stream, msg, msg_len);
        free(fs);
        return r;
    };
    for (uint64_t i = 0; i < n; ++i) {
        c.slice = i;
        const uint64_t s = i % job->slots;
        const bool mine = i == own;
        CUstream local = mine ? stream : aux;
        if (i >= job->slots && (rc = c.wait(store ? aux : stream, drained[s]))) return rc;
        const uint64_t k0 = job->link_bounds[i], k1 = job->link_bounds[i + 1];
        if (!store && link) {
            rc = i == 0 && ids_in_link ? link_with_ids(k0, k1)
                        : npo_batch_range(drv, job->link_src + k0, job->link_dst + k0, job->link_size + k0, k1 - k0, 1,
                                          stream, msg, msg_len);
            if (rc) return rc;
            // the last scatter follows on the stream; earlier scatters are waited for after it
            if (i == 0 && (rc = mark())) return rc;  // the first byte is on its way: now the model's mark
            if (!mine && ((rc = c.record(filled[s], stream)) || (rc = c.wait(aux, filled[s])))) return rc;
            if (aux_in_loop && model && i == 0 && !mine && (rc = c.wait(aux, model))) return rc;
        }
        // the load's last scatter: after the model's mark and the ids' upload (entry, recorded on aux after
        // both), or with its ids inline after the mark itself
        if (mine && model && ((rc = mark()) || (rc = c.wait(stream, load_inline ? model : entry)))) return rc;
        for (uint64_t g = job->range_off[i]; g < job->range_off[i + 1]; ++g) {
            const uint64_t *r = job->ranges + 4 * g;
            if (r[2] + r[3] > job->n_ids)
                return npo_failf(NPO_ERR_BAD_ARG, msg, msg_len, "npo_cuda_staged_submit: slice %llu range %llu covers "
                                 "blocks %llu..%llu of %llu", (unsigned long long)i, (unsigned long long)g,
                                 (unsigned long long)r[2], (unsigned long long)(r[2] + r[3]),
                                 (unsigned long long)job->n_ids);
            rc = (mine && inline_first) || load_inline
                     ? npo_table_inline_launch(drv, fns.table_inline, r[0], r[1], job->host_ids + r[2],
                                               job->host_ids + job->n_ids + r[2], r[3], job->min_page, job->programs,
                                               local, msg, msg_len)
                     : npo_table_launch(drv, fns.table, r[0], r[1], dev_src, dev_dst, r[2], r[3], job->min_page,
                                        job->programs, local, msg, msg_len);
            if (rc) return rc;
        }
        if (!link) {
            if ((rc = c.record(filled[s], aux)) || (rc = c.record(drained[s], aux))) return rc;
        } else if (store) {
            if (mine) {  // later gathers follow this one (and the upload, compute, earlier jobs)
                if ((rc = c.record(entry, stream)) || (rc = c.wait(aux, entry))) return rc;
            } else if ((rc = c.record(filled[s], aux)) || (rc = c.wait(stream, filled[s]))) {
                return rc;
            }
            rc = npo_batch_range(drv, job->link_src + k0, job->link_dst + k0, job->link_size + k0, k1 - k0, 0, stream,
                                 msg, msg_len);
            if (rc || (rc = c.record(drained[s], stream))) return rc;
        } else if (!mine) {
            if ((rc = c.record(drained[s], aux))) return rc;
        } else if (i && (rc = c.wait(stream, drained[(i - 1) % job->slots]))) {
            return rc;  // the job's stream ends after every scatter (aux runs them in order)
        }
    }
    if (!link && n) return c.wait(stream, drained[(n - 1) % job->slots]);
    return 0;
}

extern "C" int npo_cuda_events_create(size_t n, void **out, char *msg, size_t msg_len) {
    const npo_driver *drv = npo_driver_get();
    if (drv->status != 0) return npo_failf(drv->status, msg, msg_len, "cuEventCreate: %s", drv->error);
    if (!drv->event_create) return npo_failf(NPO_ERR_UNSUPPORTED, msg, msg_len, "the driver lacks cuEventCreate");
    if (!out) return npo_failf(NPO_ERR_BAD_ARG, msg, msg_len, "cuEventCreate: null output array");
    int rc = npo_bind_context(drv, nullptr, msg, msg_len);
    if (rc != 0) return rc;
    for (size_t i = 0; i < n; ++i) {
        CUresult r = drv->event_create((CUevent *)&out[i], CU_EVENT_DISABLE_TIMING);
        if (r != CUDA_SUCCESS) {
            for (size_t j = 0; j < i; ++j) drv->event_destroy((CUevent)out[j]);
            return npo_fail(drv, r, "cuEventCreate", (long long)i, msg, msg_len);
        }
    }
    return 0;
}

extern "C" int npo_cuda_events_destroy(size_t n, void **events, char *msg, size_t msg_len) {
    const npo_driver *drv = npo_driver_get();
    if (drv->status != 0 || !drv->event_destroy || !events) return 0;
    int first = 0;
    for (size_t i = 0; i < n; ++i) {
        if (!events[i]) continue;
        CUresult r = drv->event_destroy((CUevent)events[i]);
        if (r != CUDA_SUCCESS && !first) first = npo_fail(drv, r, "cuEventDestroy", (long long)i, msg, msg_len);
        events[i] = nullptr;
    }
    return first;
}
