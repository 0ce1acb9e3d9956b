/*
 * npu_offload_acl_staged_plan / npu_offload_acl_staged_submit: plan a staged transfer in page form
 * (staging.py's Stager.plan: host order, slice layout, one device-local copy per page block-major,
 * the per-slice descriptor bounds and the link runs) in C, and with submit enqueue it at once
 * (npu_offload_acl_staged_run). Why: the Python planner costs 30-50 us of the engine thread per
 * transfer, about 100 us on a GPU server's host; this is the same arithmetic in a few microseconds.
 * The Python planner (Stager.plan) stays the reference: the tests compare the two plans.
 * The arithmetic the CUDA planner shares (host order, slices, positions, link runs) lives in
 * csrc_common/staged_plan_core.h; this file keeps the page form (page descriptors, their slice
 * bounds), the request's checks, the per-thread scratch and the output.
 */
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "npu_offload_acl.h"
#include "staged_plan_core.h"

/* Per thread (plans on different threads never share it), grown, never shrunk, freed at thread exit;
 * valid until the thread's next plan: npu_offload_acl_staged_run reads the bounds while it enqueues.
 * Every array holds cap + 1 entries: blocks, or slices + 1 (a slice has at least one block). */
typedef struct {
    int64_t *dev, *host;                 /* per block, in plan order */
    uint64_t *pos, *edges;               /* per block; per slice + 1 */
    spc_pair *sort_a, *sort_b;           /* merge sort room */
    int64_t *local_bounds, *link_bounds;
    int64_t cap;
} plan_scratch;

typedef struct {
    const npu_offload_staged_request *r;
    npu_offload_acl_error *err;
    const char *who;  /* the entry point, for messages */
    plan_scratch *s;
    int64_t n, pages, n_slices, n_local, n_links;
} plan_ctx;

static pthread_key_t g_key;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static int g_key_rc;

static void scratch_free(void *p) {
    plan_scratch *s = p;
    if (!s) return;
    free(s->dev), free(s->host), free(s->pos), free(s->sort_a), free(s->sort_b);
    free(s->edges), free(s->local_bounds), free(s->link_bounds);
    free(s);
}

static void key_create(void) { g_key_rc = pthread_key_create(&g_key, scratch_free); }

static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* A bad request: `status` NPU_OFFLOAD_BAD_ARGUMENT (fail), or NPU_OFFLOAD_OUT_OF_RANGE for a block id
 * out of range (fail_range: bad input, raised as ValueError at submit). */
static int fail_as(const plan_ctx *c, int status, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int fail_as(const plan_ctx *c, int status, const char *fmt, ...) {
    char what[448];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof(what), fmt, ap);
    va_end(ap);
    return npu_err_set(c->err, status, "argument", 0, -1, -1, "%s: %s", c->who, what);
}
#define fail(c, ...) fail_as((c), NPU_OFFLOAD_BAD_ARGUMENT, __VA_ARGS__)
#define fail_range(c, ...) fail_as((c), NPU_OFFLOAD_OUT_OF_RANGE, __VA_ARGS__)

/* realloc that keeps the old array when it fails (the scratch stays consistent at its old cap). */
static int grow_array(void **p, size_t bytes) {
    void *q = realloc(*p, bytes);
    if (!q) return 0;
    *p = q;
    return 1;
}

/* This thread's scratch, holding at least n blocks. */
static int scratch_for(plan_ctx *c, int64_t n) {
    pthread_once(&g_once, key_create);
    if (g_key_rc) return fail(c, "pthread_key_create failed (%d)", g_key_rc);
    plan_scratch *s = pthread_getspecific(g_key);
    if (!s) {
        if (!(s = calloc(1, sizeof(*s)))) return fail(c, "out of host memory for the plan's scratch");
        if (pthread_setspecific(g_key, s)) {
            free(s);
            return fail(c, "pthread_setspecific failed");
        }
    }
    c->s = s;
    if (n <= s->cap) return NPU_OFFLOAD_OK;
    const int64_t cap = max64(n, 2 * s->cap);
    const size_t ids = (size_t)(cap + 1) * sizeof(int64_t), pairs = (size_t)(cap + 1) * sizeof(spc_pair);
    if (!grow_array((void **)&s->dev, ids) || !grow_array((void **)&s->host, ids) ||
        !grow_array((void **)&s->pos, ids) || !grow_array((void **)&s->sort_a, pairs) ||
        !grow_array((void **)&s->sort_b, pairs) || !grow_array((void **)&s->edges, ids) ||
        !grow_array((void **)&s->local_bounds, ids) || !grow_array((void **)&s->link_bounds, ids))
        return fail(c, "out of host memory for the plan's scratch (%lld blocks)", (long long)cap);
    s->cap = cap;
    return NPU_OFFLOAD_OK;
}

/* The request's scalars; a plan of zero-sized records or slots would never end. */
static int check_scalars(const plan_ctx *c) {
    const npu_offload_staged_request *r = c->r;
    if (!r) return fail(c, "null request");
    if (!r->groups || r->n_groups < 1 || r->record_bytes < 1 || r->slot_blocks < 1 || r->job.slots < 1 ||
        r->ramp < 1 || r->growth < 2 || r->min_slice_bytes < 0 || r->host_blocks < 1 || r->pages_end < 0 ||
        r->pages_end > r->record_bytes || r->capacity < 0 || !r->out_src || !r->out_dst || !r->out_size)
        return fail(c, "bad request (groups=%p n_groups=%lld record_bytes=%lld pages_end=%lld slot_blocks=%lld "
                    "slots=%lld ramp=%lld growth=%lld min_slice_bytes=%lld host_blocks=%lld, descriptor room %p "
                    "%p %p of %lld); needs groups, >= 1 record byte, slot block, slot, ramp and host block, "
                    "growth >= 2, pages_end <= record_bytes and the room",
                    (const void *)r->groups, (long long)r->n_groups, (long long)r->record_bytes,
                    (long long)r->pages_end, (long long)r->slot_blocks, (long long)r->job.slots,
                    (long long)r->ramp, (long long)r->growth, (long long)r->min_slice_bytes,
                    (long long)r->host_blocks, (void *)r->out_src, (void *)r->out_dst, (void *)r->out_size,
                    (long long)r->capacity);
    return NPU_OFFLOAD_OK;
}

/* Group g's table, span and ids: every address the plan forms must lie inside its tensor. */
static int check_group(const plan_ctx *c, int64_t g) {
    const npu_offload_staged_request *r = c->r;
    const npu_offload_staged_group *gr = &r->groups[g];
    if (gr->blocks < 0) return fail(c, "group %lld has %lld blocks", (long long)g, (long long)gr->blocks);
    if (!gr->blocks) return NPU_OFFLOAD_OK;
    if (!gr->pairs || gr->n_pairs < 1 || !gr->device_ids || !gr->host_ids || gr->device_limit < 1 ||
        gr->span_lo < 0 || gr->span_hi < gr->span_lo || gr->span_hi > r->record_bytes)
        return fail(c, "group %lld is invalid (pairs=%p n_pairs=%lld ids=%p/%p device_limit=%lld, span [%lld, %lld) "
                    "of a %lld-byte record)", (long long)g, (const void *)gr->pairs, (long long)gr->n_pairs,
                    (const void *)gr->device_ids, (const void *)gr->host_ids, (long long)gr->device_limit,
                    (long long)gr->span_lo, (long long)gr->span_hi, (long long)r->record_bytes);
    const int64_t *page = gr->pairs + 4 * gr->n_pairs;
    for (int64_t p = 0; p < gr->n_pairs; p++)
        if (page[p] < 1) return fail(c, "group %lld pair %lld copies %lld bytes", (long long)g, (long long)p,
                                     (long long)page[p]);
    for (int64_t j = 0; j < gr->blocks; j++) {
        const int64_t d = gr->device_ids[j], h = gr->host_ids[j];
        if (d < 0 || d >= gr->device_limit)
            return fail_range(c, "device block id %lld out of range [0, %lld) (KV group %lld, block %lld of the "
                              "transfer)", (long long)d, (long long)gr->device_limit, (long long)g, (long long)j);
        if (h < 0 || h >= r->host_blocks)
            return fail_range(c, "host block id %lld out of range [0, %lld) (KV group %lld, block %lld of the "
                              "transfer)", (long long)h, (long long)r->host_blocks, (long long)g, (long long)j);
    }
    return NPU_OFFLOAD_OK;
}

/* Everything is checked before anything is written: a bad request plans nothing. */
static int check_request(plan_ctx *c) {
    int rc = check_scalars(c);
    if (rc) return rc;
    const npu_offload_staged_request *r = c->r;
    c->n = c->pages = 0;
    for (int64_t g = 0; g < r->n_groups; g++) {
        if ((rc = check_group(c, g))) return rc;
        c->n += r->groups[g].blocks;
        c->pages += r->groups[g].blocks * r->groups[g].n_pairs;
    }
    if (!c->n) return fail(c, "a staged transfer needs at least one block");
    if (r->capacity < c->pages + c->n)
        return fail(c, "%lld pages and up to %lld link copies need room for %lld descriptors, the room holds %lld",
                    (long long)c->pages, (long long)c->n, (long long)(c->pages + c->n), (long long)r->capacity);
    return NPU_OFFLOAD_OK;
}

/* A stride shared by every pair (the usual case: one block layout for every tensor), else 0. */
static int64_t uniform(const int64_t *stride, int64_t m) {
    for (int64_t p = 1; p < m; p++)
        if (stride[p] != stride[0]) return 0;
    return stride[0];
}

/* One side of one block's pages: out[p] = base[p] + id * stride[p]; with a uniform stride one add
 * each, which the compiler vectorises (restrict: no reload after each store). */
static void affine(int64_t m, const int64_t *restrict base, const int64_t *restrict stride, int64_t same,
                   int64_t id, int64_t *restrict out) {
    if (same) {
        const int64_t off = id * same;
        for (int64_t p = 0; p < m; p++) out[p] = base[p] + off;
    } else {
        for (int64_t p = 0; p < m; p++) out[p] = base[p] + id * stride[p];
    }
}

/* Stager._plan_pages: one copy per (block, pair), block-major, groups in order, from each group's
 * (5, m) pair table; the staging side's ids are the blocks' positions (the tables hold this
 * direction's staging layout). */
static void plan_pages(plan_ctx *c) {
    const npu_offload_staged_request *r = c->r;
    const plan_scratch *s = c->s;
    const int store = r->job.store != 0;
    int64_t *src = r->out_src, *dst = r->out_dst, *size = r->out_size, at = 0, blk = 0;
    for (int64_t g = 0; g < r->n_groups; g++) {
        const npu_offload_staged_group *gr = &r->groups[g];
        const int64_t m = gr->n_pairs, *t = gr->pairs;
        const int64_t src_same = uniform(t + m, m), dst_same = uniform(t + 3 * m, m);
        for (int64_t j = blk; j < blk + gr->blocks; j++, at += m) {
            const int64_t p = (int64_t)s->pos[j];
            affine(m, t, t + m, src_same, store ? s->dev[j] : p, src + at);
            affine(m, t + 2 * m, t + 3 * m, dst_same, store ? p : s->dev[j], dst + at);
            memcpy(size + at, t + 4 * m, (size_t)m * sizeof(int64_t));
        }
        blk += gr->blocks;
    }
    c->n_local = at;
}

/* Each slice's first page descriptor: the copies of every block before its first block. */
static void local_bounds(const plan_ctx *c) {
    const npu_offload_staged_request *r = c->r;
    const plan_scratch *s = c->s;
    int64_t g = 0, blk = 0, desc = 0;  /* group g starts at block blk, descriptor desc */
    for (int64_t i = 0; i <= c->n_slices; i++) {
        const int64_t e = (int64_t)s->edges[i];
        for (; g < r->n_groups && e >= blk + r->groups[g].blocks; g++) {
            blk += r->groups[g].blocks;
            desc += r->groups[g].blocks * r->groups[g].n_pairs;
        }
        s->local_bounds[i] = g < r->n_groups ? desc + (e - blk) * r->groups[g].n_pairs : desc;
    }
}

/* The link runs (staged_plan_core.h), after the page descriptors. The core writes uint64_t into
 * the int64_t descriptors and bounds: a signed and an unsigned variant may alias (C11 6.5p7), and
 * for a checked request the bits are those int64_t arithmetic would give. */
static void plan_link(plan_ctx *c) {
    const npu_offload_staged_request *r = c->r;
    const plan_scratch *s = c->s;
    spc_links l = {.edges = s->edges, .pos = s->pos, .host = s->host, .record_bytes = (uint64_t)r->record_bytes,
                   .pages_end = (uint64_t)r->pages_end, .staging_base = (uint64_t)r->staging_base,
                   .host_base = (uint64_t)r->host_base, .store = r->job.store != 0,
                   .src = (uint64_t *)(r->out_src + c->n_local), .dst = (uint64_t *)(r->out_dst + c->n_local),
                   .size = (uint64_t *)(r->out_size + c->n_local), .bounds = (uint64_t *)s->link_bounds};
    for (int64_t g = 0; g < r->n_groups; g++) {
        const npu_offload_staged_group *gr = &r->groups[g];
        spc_links_group(&l, (uint64_t)gr->blocks, (uint64_t)gr->span_lo, (uint64_t)gr->span_hi);
    }
    spc_links_finish(&l, (uint64_t)c->n_slices);
    c->n_links = (int64_t)l.n;
}

/* The whole plan: descriptors into the request's room, bounds into the scratch. */
static int plan(plan_ctx *c, const npu_offload_staged_request *req, npu_offload_acl_error *err, const char *who) {
    *c = (plan_ctx){.r = req, .err = err, .who = who};
    int rc = check_request(c);
    if (rc || (rc = scratch_for(c, c->n))) return rc;
    plan_scratch *s = c->s;
    for (int64_t g = 0, at = 0; g < req->n_groups; at += req->groups[g++].blocks) {
        const npu_offload_staged_group *gr = &req->groups[g];
        spc_host_ordered(gr->device_ids, gr->host_ids, (uint64_t)gr->blocks, s->sort_a, s->sort_b, s->dev + at,
                         s->host + at);
    }
    c->n_slices = (int64_t)spc_slice_edges((uint64_t)c->n, (uint64_t)req->record_bytes, (uint64_t)req->slot_blocks,
                                           (uint64_t)req->min_slice_bytes, (uint64_t)req->ramp,
                                           (uint64_t)req->growth, req->job.store != 0, s->edges);
    spc_positions(s->edges, (uint64_t)c->n_slices, (uint64_t)req->job.slots, (uint64_t)req->slot_blocks, s->pos);
    plan_pages(c);
    local_bounds(c);
    plan_link(c);
    return NPU_OFFLOAD_OK;
}

NPU_OFFLOAD_API int npu_offload_acl_staged_plan(const npu_offload_staged_request *req, npu_offload_staged_plan_out *out,
                                                npu_offload_acl_error *err) {
    npu_err_clear(err);
    plan_ctx c = {.err = err, .who = "npu_offload_acl_staged_plan"};
    if (!out || !out->local_bounds || !out->link_bounds) return fail(&c, "null output or bounds");
    int rc = plan(&c, req, err, c.who);
    if (rc) return rc;
    out->n_slices = c.n_slices;
    out->n_local = c.n_local;
    out->n_links = c.n_links;
    if (c.n_slices > out->cap_slices)
        return fail(&c, "the plan has %lld slices, the output's bounds hold %lld", (long long)c.n_slices,
                    (long long)out->cap_slices);
    memcpy(out->local_bounds, c.s->local_bounds, (size_t)(c.n_slices + 1) * sizeof(int64_t));
    memcpy(out->link_bounds, c.s->link_bounds, (size_t)(c.n_slices + 1) * sizeof(int64_t));
    return NPU_OFFLOAD_OK;
}

/* Plan and enqueue one staged transfer; *slices and *links (if not NULL) get its counts. */
NPU_OFFLOAD_API int npu_offload_acl_staged_submit(const npu_offload_staged_request *req, int64_t *slices,
                                                  int64_t *links, npu_offload_acl_error *err) {
    npu_err_clear(err);
    plan_ctx c;
    int rc = plan(&c, req, err, "npu_offload_acl_staged_submit");
    if (rc) return rc;
    npu_offload_staged_job job = req->job;
    job.n_slices = c.n_slices;
    job.local_src = req->out_src, job.local_dst = req->out_dst, job.local_size = req->out_size;
    job.local_bounds = c.s->local_bounds;
    job.link_src = req->out_src + c.n_local, job.link_dst = req->out_dst + c.n_local;
    job.link_size = req->out_size + c.n_local;
    job.link_bounds = c.s->link_bounds;
    if (slices) *slices = c.n_slices;
    if (links) *links = c.n_links;
    return npu_offload_acl_staged_run(&job, err);
}
