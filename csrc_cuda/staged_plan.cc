// npo_cuda_staged_plan / npo_cuda_staged_submit: plan a staged transfer (staging.py's
// Stager.plan: host order, slice layout, the block ids of both sides, the per-slice table
// ranges and the link runs) in C, and with submit enqueue it at once (npo_staged_run_job).
// Why: on a GPU server's host the Python planner and the job it hands over cost 100-250 us
// per transfer, most of the fixed cost that keeps a 20 MiB transfer at 60-70% of one
// contiguous copy (docs/benchmarks.md); this is the same arithmetic in a few microseconds.
// The Python planner (Stager.plan) stays the reference: the tests compare the two plans.
// The arithmetic the Ascend planner shares (host order, slices, positions, link runs) lives in
// csrc_common/staged_plan_core.h; this file keeps the table form (ids, table ranges), the
// request's checks, the per-thread scratch and the output.
#include <stdio.h>
#include <string.h>

#include <algorithm>
#include <new>
#include <vector>

#include "driver.h"
#include "npo_cuda.h"
#include "staged_run.h"
#include "staged_plan_core.h"

namespace {

struct Scratch {  // per thread: plans on different threads (worker cores in one process) never share it
    std::vector<int64_t> dev, host;
    std::vector<uint64_t> pos, edges, range_off, ranges, link_src, link_dst, link_size, link_bounds;
    std::vector<spc_pair> sort_a, sort_b;
};

int check_request(const npo_staged_request *r, uint64_t *n, char *msg, size_t msg_len) {
    if (!r || !r->groups || !r->n_groups || !r->job.host_ids || !r->record_bytes || !r->slot_blocks || !r->ramp ||
        r->growth < 2 || !r->job.slots)
        return npo_failf(NPO_ERR_BAD_ARG, msg, msg_len,
                         "npo_cuda_staged_plan: bad request (null groups or ids, or a zero record, slot, ramp, "
                         "slots, or growth < 2)");
    uint64_t total = 0;
    for (uint64_t g = 0; g < r->n_groups; ++g) {
        const npo_staged_group &gr = r->groups[g];
        if (gr.blocks && (!gr.device_ids || !gr.host_ids || !gr.table || !gr.pairs || gr.span_hi < gr.span_lo ||
                          gr.span_hi > r->record_bytes))
            return npo_failf(NPO_ERR_BAD_ARG, msg, msg_len,
                             "npo_cuda_staged_plan: group %llu is invalid (null ids or table, %llu pairs, "
                             "span [%llu, %llu) of a %llu-byte record)", (unsigned long long)g,
                             (unsigned long long)gr.pairs, (unsigned long long)gr.span_lo,
                             (unsigned long long)gr.span_hi, (unsigned long long)r->record_bytes);
        total += gr.blocks;
    }
    if (!total) return npo_failf(NPO_ERR_BAD_ARG, msg, msg_len, "npo_cuda_staged_plan: a staged transfer needs at "
                                 "least one block");
    // The block ids are checked here, not in Python (two numpy reductions there cost ~1 us each on
    // the engine thread): out of range is bad input, NPO_ERR_RANGE, before anything is enqueued.
    for (uint64_t g = 0; g < r->n_groups; ++g) {
        const npo_staged_group &gr = r->groups[g];
        for (uint64_t j = 0; j < gr.blocks; ++j) {
            if ((uint64_t)gr.device_ids[j] >= gr.device_limit)
                return npo_failf(NPO_ERR_RANGE, msg, msg_len, "device block id %lld out of range [0, %llu) (KV "
                                 "group %llu, block %llu of the transfer)", (long long)gr.device_ids[j],
                                 (unsigned long long)gr.device_limit, (unsigned long long)g, (unsigned long long)j);
            if ((uint64_t)gr.host_ids[j] >= r->host_blocks)
                return npo_failf(NPO_ERR_RANGE, msg, msg_len, "host block id %lld out of range [0, %llu) (KV "
                                 "group %llu, block %llu of the transfer)", (long long)gr.host_ids[j],
                                 (unsigned long long)r->host_blocks, (unsigned long long)g, (unsigned long long)j);
        }
    }
    if (2 * total > r->ids_capacity)
        return npo_failf(NPO_ERR_BAD_ARG, msg, msg_len, "npo_cuda_staged_plan: %llu blocks need %llu ids, the "
                         "buffer holds %llu", (unsigned long long)total, (unsigned long long)(2 * total),
                         (unsigned long long)r->ids_capacity);
    *n = total;
    return 0;
}

// The largest group's block count: the room its host-order sort needs.
uint64_t largest_group(const npo_staged_request *r) {
    uint64_t k = 0;
    for (uint64_t g = 0; g < r->n_groups; ++g) k = std::max(k, r->groups[g].blocks);
    return k;
}

// Per slice, one table range (table, pairs, first block, blocks) per group it covers, groups in order.
void table_ranges(const npo_staged_request *r, uint64_t n_slices, Scratch &s) {
    s.range_off.assign(1, 0);
    s.ranges.clear();
    for (uint64_t i = 0; i < n_slices; ++i) {
        uint64_t blk = 0;
        for (uint64_t g = 0; g < r->n_groups; ++g) {
            const npo_staged_group &gr = r->groups[g];
            const uint64_t a = std::max(s.edges[i], blk), b = std::min(s.edges[i + 1], blk + gr.blocks);
            if (a < b) s.ranges.insert(s.ranges.end(), {gr.table, gr.pairs, a, b - a});
            blk += gr.blocks;
        }
        s.range_off.push_back(s.ranges.size() / 4);
    }
}

// The link runs (staged_plan_core.h) into s.link_*: at most one copy a block.
void link_runs(const npo_staged_request *r, uint64_t n, uint64_t n_slices, Scratch &s) {
    s.link_src.resize(n);
    s.link_dst.resize(n);
    s.link_size.resize(n);
    s.link_bounds.resize(n_slices + 1);
    spc_links l = {};
    l.edges = s.edges.data(), l.pos = s.pos.data(), l.host = s.host.data();
    l.record_bytes = r->record_bytes, l.pages_end = r->pages_end;
    l.staging_base = r->staging_base, l.host_base = r->host_base;
    l.store = r->job.store != 0;
    l.src = s.link_src.data(), l.dst = s.link_dst.data(), l.size = s.link_size.data();
    l.bounds = s.link_bounds.data();
    for (uint64_t g = 0; g < r->n_groups; ++g)
        spc_links_group(&l, r->groups[g].blocks, r->groups[g].span_lo, r->groups[g].span_hi);
    spc_links_finish(&l, n_slices);
    s.link_src.resize(l.n);
    s.link_dst.resize(l.n);
    s.link_size.resize(l.n);
}

// The plan into s (and the pinned ids); every array's size is its count.
int plan(const npo_staged_request *r, Scratch &s, char *msg, size_t msg_len) {
    uint64_t n = 0;
    int rc = check_request(r, &n, msg, msg_len);
    if (rc) return rc;
    const bool store = r->job.store != 0;
    s.dev.resize(n);
    s.host.resize(n);
    s.sort_a.resize(largest_group(r));
    s.sort_b.resize(s.sort_a.size());
    for (uint64_t g = 0, at = 0; g < r->n_groups; at += r->groups[g++].blocks)
        spc_host_ordered(r->groups[g].device_ids, r->groups[g].host_ids, r->groups[g].blocks, s.sort_a.data(),
                         s.sort_b.data(), s.dev.data() + at, s.host.data() + at);
    s.edges.resize(n + 1);
    const uint64_t n_slices = spc_slice_edges(n, r->record_bytes, r->slot_blocks, r->min_slice_bytes, r->ramp,
                                              r->growth, store, s.edges.data());
    s.edges.resize(n_slices + 1);
    s.pos.resize(n);
    spc_positions(s.edges.data(), n_slices, r->job.slots, r->slot_blocks, s.pos.data());
    // the ids of both sides: src ids then dst ids (a store: device -> staging record)
    int64_t *ids = const_cast<int64_t *>(r->job.host_ids);
    for (uint64_t j = 0; j < n; ++j) {
        const int64_t p = (int64_t)s.pos[j];
        ids[j] = store ? s.dev[j] : p;
        ids[n + j] = store ? p : s.dev[j];
    }
    table_ranges(r, n_slices, s);
    link_runs(r, n, n_slices, s);
    return 0;
}

thread_local Scratch t_scratch;

void fill_job(const npo_staged_request *r, const Scratch &s, npo_staged_job *job) {
    *job = r->job;
    job->n_ids = s.pos.size();
    job->n_slices = s.edges.size() - 1;
    job->range_off = s.range_off.data();
    job->ranges = s.ranges.data();
    job->link_src = s.link_src.data();
    job->link_dst = s.link_dst.data();
    job->link_size = s.link_size.data();
    job->link_bounds = s.link_bounds.data();
}

}  // namespace

extern "C" int npo_cuda_staged_plan(const npo_staged_request *req, npo_staged_plan_out *out, char *msg,
                                    size_t msg_len) {
    if (!out) return npo_failf(NPO_ERR_BAD_ARG, msg, msg_len, "npo_cuda_staged_plan: null output");
    try {
        Scratch &s = t_scratch;
        int rc = plan(req, s, msg, msg_len);
        if (rc) return rc;
        const uint64_t slices = s.edges.size() - 1, ranges = s.ranges.size() / 4, links = s.link_src.size();
        out->n_slices = slices;
        out->n_ranges = ranges;
        out->n_links = links;
        if (slices > out->cap_slices || ranges > out->cap_ranges || links > out->cap_links)
            return npo_failf(NPO_ERR_BAD_ARG, msg, msg_len, "npo_cuda_staged_plan: the plan has %llu slices, %llu "
                             "ranges, %llu link copies; the output holds %llu, %llu, %llu",
                             (unsigned long long)slices, (unsigned long long)ranges, (unsigned long long)links,
                             (unsigned long long)out->cap_slices, (unsigned long long)out->cap_ranges,
                             (unsigned long long)out->cap_links);
        memcpy(out->range_off, s.range_off.data(), 8 * (slices + 1));
        memcpy(out->ranges, s.ranges.data(), 8 * 4 * ranges);
        memcpy(out->link_src, s.link_src.data(), 8 * links);
        memcpy(out->link_dst, s.link_dst.data(), 8 * links);
        memcpy(out->link_size, s.link_size.data(), 8 * links);
        memcpy(out->link_bounds, s.link_bounds.data(), 8 * (slices + 1));
        return 0;
    } catch (const std::bad_alloc &) {
        return npo_failf(NPO_ERR_BAD_ARG, msg, msg_len, "npo_cuda_staged_plan: out of host memory");
    }
}

namespace {

// The engine's order before the copies (see npo_staged_request): each driver call checked. A store
// waits for the model's stream before it reads a page; a load only marks it there (its scatters
// wait for the mark, npo_staged_run_job), so its link copies overlap the model's step in flight.
// A load's mark is recorded by npo_staged_run_job, after its first link batch: nothing there reads
// or writes a KV page, and a driver call less ahead of the first byte on the link is what a small-page
// load lacks (issue #22). Later is never less safe: the mark then covers at least the same work.
int order_before(const npo_driver *drv, const npo_staged_request *r, char *msg, size_t msg_len) {
    CUstream stream = (CUstream)r->job.stream;
    if ((r->compute || r->after || r->start || r->end) && (!drv->event_record || !drv->stream_wait_event))
        return npo_failf(NPO_ERR_UNSUPPORTED, msg, msg_len, "npo_cuda_staged_submit: the driver lacks cuEventRecord/"
                         "cuStreamWaitEvent");
    CUresult e = CUDA_SUCCESS;
    const char *call = "";
    if (r->compute) {
        if (!r->compute_mark)
            return npo_failf(NPO_ERR_BAD_ARG, msg, msg_len, "npo_cuda_staged_submit: a compute stream without its "
                             "mark event");
        if (!r->job.store) {
            // a load's mark: npo_staged_run_job records it
        } else if ((e = drv->event_record((CUevent)r->compute_mark, (CUstream)r->compute)) != CUDA_SUCCESS) {
            call = "cuEventRecord (the compute stream's mark)";
        } else if ((e = drv->stream_wait_event(stream, (CUevent)r->compute_mark, 0)) != CUDA_SUCCESS) {
            call = "cuStreamWaitEvent (the compute stream)";
        }
    }
    if (e == CUDA_SUCCESS && r->after && (e = drv->stream_wait_event(stream, (CUevent)r->after, 0)) != CUDA_SUCCESS)
        call = "cuStreamWaitEvent (the previous job's end)";
    if (e == CUDA_SUCCESS && r->start && (e = drv->event_record((CUevent)r->start, stream)) != CUDA_SUCCESS)
        call = "cuEventRecord (the job's start)";
    return e == CUDA_SUCCESS ? 0 : npo_fail(drv, e, call, -1, msg, msg_len);
}

}  // namespace

extern "C" int npo_cuda_staged_submit(const npo_staged_request *req, uint64_t *links, char *msg, size_t msg_len) {
    const npo_driver *drv = npo_driver_get();
    int rc = 0;
    try {
        Scratch &s = t_scratch;
        rc = plan(req, s, msg, msg_len);
        if (!rc && drv->status != 0) rc = npo_failf(drv->status, msg, msg_len, "npo_cuda_staged_submit: %s", drv->error);
        if (!rc) rc = order_before(drv, req, msg, msg_len);
        if (!rc) {
            npo_staged_job job;
            fill_job(req, s, &job);
            if (links) *links = s.link_src.size();
            const bool load = !req->job.store && req->compute;
            rc = npo_staged_run_job(&job, req->compute ? req->compute_mark : nullptr, load ? req->compute : nullptr,
                                    msg, msg_len);
        }
    } catch (const std::bad_alloc &) {
        rc = npo_failf(NPO_ERR_BAD_ARG, msg, msg_len, "npo_cuda_staged_submit: out of host memory");
    }
    // the end is recorded whatever happened before, so the engine sees the job finish (failed)
    if (req && req->end && drv->status == 0 && drv->event_record) {
        CUresult e = drv->event_record((CUevent)req->end, (CUstream)req->job.stream);
        if (e != CUDA_SUCCESS && !rc) rc = npo_fail(drv, e, "cuEventRecord (the job's end)", -1, msg, msg_len);
    }
    return rc;
}
