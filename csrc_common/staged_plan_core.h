/*
 * The staged-transfer planning arithmetic that both native planners share: staging.py's
 * Stager.slice_sizes and the parts of Stager.plan that do not depend on the copy form (host order,
 * slice edges, staging positions, link runs). csrc_cuda/staged_plan.cc plans table form with it,
 * csrc_npu/staged_plan.c page form. Why one copy: both must plan exactly as the Python reference
 * does (the tests compare each with it), and a fix made twice is a fix that reaches one of them.
 *
 * Header-only static inline functions, valid C99 and C++17. They never allocate or report errors:
 * each caller checks its request, owns its scratch and passes arrays of the sizes named here.
 * Counts, positions and byte addresses are uint64_t (wrap-around is defined; wherever int64_t
 * arithmetic would not overflow, the bits are the same), block ids int64_t.
 */
#ifndef NPO_STAGED_PLAN_CORE_H
#define NPO_STAGED_PLAN_CORE_H

#include <stdint.h>
#include <string.h>

typedef struct {
    int64_t host, dev;
} spc_pair;

static inline uint64_t spc_min(uint64_t a, uint64_t b) { return a < b ? a : b; }
static inline uint64_t spc_max(uint64_t a, uint64_t b) { return a > b ? a : b; }
static inline uint64_t spc_ceil_div(uint64_t a, uint64_t b) { return a / b + (a % b != 0); }

/* Stable bottom-up merge sort of k pairs by host id (a tie keeps its left element first), using
 * a and b (k pairs each) in turn: returns the one that holds the result. */
static inline spc_pair *spc_merge_sort(spc_pair *a, spc_pair *b, uint64_t k) {
    for (uint64_t w = 1; w < k; w *= 2) {
        for (uint64_t lo = 0; lo < k; lo += 2 * w) {
            const uint64_t mid = spc_min(lo + w, k), hi = spc_min(lo + 2 * w, k);
            uint64_t i = lo, j = mid, o = lo;
            while (i < mid && j < hi) b[o++] = a[j].host < a[i].host ? a[j++] : a[i++];
            while (i < mid) b[o++] = a[i++];
            while (j < hi) b[o++] = a[j++];
        }
        spc_pair *t = a;
        a = b;
        b = t;
    }
    return a;
}

/* Stager.plan's host order for one group: its k (device, host) pairs stably sorted by host id,
 * into dev[0, k) and host[0, k). Ascending (the usual case) and descending ids need no sort;
 * sort_a and sort_b are room for k pairs each. */
static inline void spc_host_ordered(const int64_t *device_ids, const int64_t *host_ids, uint64_t k, spc_pair *sort_a,
                                    spc_pair *sort_b, int64_t *dev, int64_t *host) {
    if (!k) return;  /* a group without blocks may have no id arrays */
    int up = 1, down = 1;
    for (uint64_t i = 1; i < k && (up || down); i++) {
        up = up && host_ids[i] >= host_ids[i - 1];
        down = down && host_ids[i] < host_ids[i - 1];
    }
    if (up) {
        memcpy(dev, device_ids, (size_t)k * sizeof(int64_t));
        memcpy(host, host_ids, (size_t)k * sizeof(int64_t));
    } else if (down) {
        for (uint64_t i = 0; i < k; i++) {
            dev[i] = device_ids[k - 1 - i];
            host[i] = host_ids[k - 1 - i];
        }
    } else {
        for (uint64_t i = 0; i < k; i++) {
            sort_a[i].host = host_ids[i];
            sort_a[i].dev = device_ids[i];
        }
        const spc_pair *sorted = spc_merge_sort(sort_a, sort_b, k);
        for (uint64_t i = 0; i < k; i++) {
            dev[i] = sorted[i].dev;
            host[i] = sorted[i].host;
        }
    }
}

/* Stager.slice_sizes for n blocks, as edges (slice i is blocks [edges[i], edges[i + 1])): a small
 * unhidden slice (first for stores, last for loads), then slices growing growth-fold up to the
 * slot; a remainder smaller than the first slice joins the slice before it when that fits in a
 * slot. edges holds n + 1 entries (a slice has at least one block); returns the slice count. */
static inline uint64_t spc_slice_edges(uint64_t n, uint64_t record_bytes, uint64_t slot_blocks, uint64_t min_slice_bytes,
                                       uint64_t ramp, uint64_t growth, int store, uint64_t *edges) {
    const uint64_t first = spc_max(1, spc_max(spc_ceil_div(min_slice_bytes, record_bytes), spc_ceil_div(n, ramp)));
    uint64_t k = 0, left = n, cur = first;
    while (left > 0) {
        uint64_t take = spc_min(spc_min(cur, slot_blocks), left);
        if (left - take > 0 && left - take < first && left <= slot_blocks) take = left;
        edges[++k] = take;
        left -= take;
        cur = cur > slot_blocks / growth ? slot_blocks + 1 : cur * growth;  /* past a slot all alike: no overflow */
    }
    if (!store)
        for (uint64_t i = 1, j = k; i < j; i++, j--) {
            const uint64_t t = edges[i];
            edges[i] = edges[j];
            edges[j] = t;
        }
    edges[0] = 0;
    for (uint64_t i = 1; i <= k; i++) edges[i] += edges[i - 1];
    return k;
}

/* Stager._slice_layout's pos, each block's staging record: slice i fills slot i % slots from its
 * start. pos holds edges[n_slices] entries. */
static inline void spc_positions(const uint64_t *edges, uint64_t n_slices, uint64_t slots, uint64_t slot_blocks,
                                 uint64_t *pos) {
    for (uint64_t i = 0; i < n_slices; i++)
        for (uint64_t j = edges[i]; j < edges[i + 1]; j++) pos[j] = (i % slots) * slot_blocks + (j - edges[i]);
}

/* Stager._plan_link's state: what a plan's link runs are formed from (set before the first group),
 * where they go and how far they have come (zero before the first group). */
typedef struct {
    const uint64_t *edges, *pos;  /* the slices and the blocks' staging records */
    const int64_t *host;          /* the blocks' host ids, in plan order */
    uint64_t record_bytes, pages_end, staging_base, host_base;
    int store;
    uint64_t *src, *dst, *size;   /* the copies: room for one a block */
    uint64_t *bounds;             /* each slice's first copy, then the count: slices + 1 entries */
    uint64_t n, blk, slice;       /* copies so far; the next block and the slice it is in */
} spc_links;

/* The link runs of the next group, of `blocks` blocks whose pages occupy [span_lo, span_hi) of a
 * record: runs of consecutive host blocks within one slice and one group. A group that owns only
 * part of a record copies each block on its own (a run would carry the other groups' bytes
 * between its ends). */
static inline void spc_links_group(spc_links *l, uint64_t blocks, uint64_t span_lo, uint64_t span_hi) {
    const int part = !(span_lo == 0 && span_hi == l->pages_end) && span_lo != span_hi;
    const uint64_t rec = l->record_bytes, width = span_hi - span_lo, end = l->blk + blocks;
    for (uint64_t j = l->blk; j < end; j++) {
        if (j == l->edges[l->slice + 1]) l->bounds[++l->slice] = l->n;  /* slices are never empty */
        if (j == l->blk || j == l->edges[l->slice] || part || l->host[j] != l->host[j - 1] + 1) {
            const uint64_t stg = l->pos[j] * rec + l->staging_base + span_lo;
            const uint64_t hst = (uint64_t)l->host[j] * rec + span_lo + l->host_base;
            l->src[l->n] = l->store ? stg : hst;
            l->dst[l->n] = l->store ? hst : stg;
            l->size[l->n++] = width;
        } else {
            l->size[l->n - 1] += rec;  /* one more whole record in the run */
        }
    }
    l->blk = end;
}

/* After the last group: the outer bounds, 0 and the copy count. */
static inline void spc_links_finish(spc_links *l, uint64_t n_slices) {
    l->bounds[0] = 0;
    l->bounds[n_slices] = l->n;
}

#endif /* NPO_STAGED_PLAN_CORE_H */
