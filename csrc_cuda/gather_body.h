/* The device-local gather/scatter: one thread's share of copying a range of page
 * descriptors. Shared by the CUDA kernel (gather_kernel.cu) and the CPU test double of
 * the driver (tests/cuda_fake), which runs every thread of a launch in turn: threads
 * never communicate, so a sequential run copies exactly the same bytes.
 *
 * Why this shape: KV pages are small (1-32 KiB) and scattered, and at most 16 SMs may
 * copy. Bandwidth then comes from bytes in flight, not from threads, so
 *  - a group of G lanes (G = 1..32, a power of two sized to the smallest page) owns one
 *    page at a time, so 1 KiB pages keep every lane busy; a launch of a few large pages
 *    takes groups of up to a whole block, so that it still reaches every SM it may use;
 *  - every lane issues NPO_GATHER_UNROLL 16-byte loads before its stores;
 *  - the next page's descriptor is loaded before the current page is copied, so the
 *    descriptor's memory latency hides behind the data.
 * Pages whose src or dst is not 16-byte aligned, and the tail of a size that is not a
 * multiple of 16, are copied byte by byte.
 */
#ifndef NPO_GATHER_BODY_H
#define NPO_GATHER_BODY_H

#include <stdint.h>

/* 512 threads x 8 vectors in flight = 64 KiB per SM with no register spills on sm_90
 * (1024 x 4 spills at the 64-register cap that 1024-thread blocks impose). */
#define NPO_GATHER_UNROLL 8
#define NPO_GATHER_THREADS 512

#ifdef __CUDACC__
#define NPO_HD __device__ __forceinline__
typedef uint4 npo_vec16;
/* Streaming (evict-first) accesses: each byte is read and written once. */
NPO_HD npo_vec16 npo_load16(const npo_vec16 *p) { return __ldcs(p); }
NPO_HD void npo_store16(npo_vec16 *p, npo_vec16 v) { __stcs(p, v); }
#else
#include <string.h>
#define NPO_HD static inline
typedef struct {
    uint32_t x, y, z, w;
} npo_vec16;
NPO_HD npo_vec16 npo_load16(const npo_vec16 *p) {
    npo_vec16 v;
    memcpy(&v, p, sizeof(v));
    return v;
}
NPO_HD void npo_store16(npo_vec16 *p, npo_vec16 v) { memcpy(p, &v, sizeof(v)); }
#endif

/* Descriptors first + r * stride + c for r < rows, c < width (DescriptorRange in Python):
 * a plain range (rows 1) or one column range of every row of a tensor-major table. */
typedef struct {
    const uint64_t *src, *dst, *size; /* device arrays of descriptor columns */
    uint64_t first, width, rows, stride;
    uint32_t group; /* lanes per page: a power of two, 1..NPO_GATHER_THREADS (> 32 for a few large pages) */
} npo_gather_args;

NPO_HD uint64_t npo_desc_index(const npo_gather_args *a, uint64_t p) {
    return a->first + (p / a->width) * a->stride + p % a->width;
}

NPO_HD void npo_copy_page(uint64_t s, uint64_t d, uint64_t z, uint32_t lane, uint32_t g) {
    uint64_t nvec = ((s | d) & 15) == 0 ? z >> 4 : 0;
    /* This lane's vectors are lane, lane + g, lane + 2g, ...: walk them with pointers. */
    const npo_vec16 *sp = (const npo_vec16 *)s + lane;
    npo_vec16 *dp = (npo_vec16 *)d + lane;
    uint64_t left = nvec > lane ? (nvec - lane + g - 1) / g : 0; /* vectors this lane copies */
    for (; left >= NPO_GATHER_UNROLL; left -= NPO_GATHER_UNROLL) {
        npo_vec16 r[NPO_GATHER_UNROLL];
#ifdef __CUDACC__
#pragma unroll
#endif
        for (int u = 0; u < NPO_GATHER_UNROLL; ++u) r[u] = npo_load16(sp + u * g);
#ifdef __CUDACC__
#pragma unroll
#endif
        for (int u = 0; u < NPO_GATHER_UNROLL; ++u) npo_store16(dp + u * g, r[u]);
        sp += NPO_GATHER_UNROLL * g;
        dp += NPO_GATHER_UNROLL * g;
    }
    if (left) { /* the last partial pass, still all loads before the stores */
        npo_vec16 r[NPO_GATHER_UNROLL];
#ifdef __CUDACC__
#pragma unroll
#endif
        for (int u = 0; u < NPO_GATHER_UNROLL; ++u)
            if ((uint64_t)u < left) r[u] = npo_load16(sp + u * g);
#ifdef __CUDACC__
#pragma unroll
#endif
        for (int u = 0; u < NPO_GATHER_UNROLL; ++u)
            if ((uint64_t)u < left) npo_store16(dp + u * g, r[u]);
    }
    for (uint64_t b = nvec * 16 + lane; b < z; b += g) ((uint8_t *)d)[b] = ((const uint8_t *)s)[b];
}

/* Page p of a range in page form: its descriptor columns. */
NPO_HD void npo_desc_page(const npo_gather_args *a, uint64_t p, uint64_t *s, uint64_t *d, uint64_t *z) {
    const uint64_t i = npo_desc_index(a, p);
    *s = a->src[i];
    *d = a->dst[i];
    *z = a->size[i];
}

/* One thread's loop, for either form: lane groups of G stride over pages 0..N-1 of ARGS;
 * each copies its page, then the next one, whose descriptor PAGE(ARGS, p, &s, &d, &z)
 * loaded before the copy. (A macro, not a function pointer: the body is also C.) */
#define NPO_PAGE_LOOP(PAGE, ARGS, N, G, BLOCK, NBLOCKS, THREAD, NTHREADS)                          \
    do {                                                                                          \
        const uint64_t n_ = (N), ngroups_ = (uint64_t)(NBLOCKS) * (NTHREADS) / (G);               \
        const uint32_t lane_ = (THREAD) % (G);                                                    \
        uint64_t p_ = ((uint64_t)(BLOCK) * (NTHREADS) + (THREAD)) / (G), s_, d_, z_;              \
        if (p_ < n_) PAGE(ARGS, p_, &s_, &d_, &z_);                                               \
        for (; p_ < n_; p_ += ngroups_) {                                                         \
            uint64_t ns_ = 0, nd_ = 0, nz_ = 0;                                                   \
            if (p_ + ngroups_ < n_) PAGE(ARGS, p_ + ngroups_, &ns_, &nd_, &nz_);                  \
            npo_copy_page(s_, d_, z_, lane_, (G));                                                \
            s_ = ns_;                                                                             \
            d_ = nd_;                                                                             \
            z_ = nz_;                                                                             \
        }                                                                                         \
    } while (0)

/* Thread `thread` of block `block` (blocks of `nthreads`, `nblocks` of them), page form. */
NPO_HD void npo_gather_thread(const npo_gather_args *a, uint32_t block, uint32_t nblocks, uint32_t thread,
                              uint32_t nthreads) {
    NPO_PAGE_LOOP(npo_desc_page, a, a->rows * a->width, a->group, block, nblocks, thread, nthreads);
}

/* Table form (the staged pipeline's): page p of a range is tensor pair t = p / nb, block
 * b = b0 + p % nb; pair t is (src base, src block stride, dst base, dst block stride, bytes)
 * in a (5, m) table uploaded once, and the block ids come per transfer. So a transfer
 * uploads 16 bytes per block instead of 24 per page, and nothing per page is planned. */
typedef struct {
    const int64_t *table; /* 5 rows of m: src_base, src_stride, dst_base, dst_stride, size */
    const int64_t *src_ids, *dst_ids;
    uint64_t m, b0, nb;
    uint32_t group;
} npo_table_args;

/* The same kernel with a small range's block ids inside its launch parameters: a store's first
 * gather then needs no upload (nor reads over the link) before it starts, and that gather is
 * the one the first link copy waits for. */
#define NPO_INLINE_IDS 64
typedef struct {
    const int64_t *table;
    uint64_t m, nb;
    uint32_t group;
    int64_t ids[2 * NPO_INLINE_IDS]; /* src ids of the range's nb blocks; dst ids from NPO_INLINE_IDS */
} npo_table_inline_args;

NPO_HD void npo_table_page(const npo_table_args *a, uint64_t p, uint64_t *s, uint64_t *d, uint64_t *z) {
    const uint64_t t = p / a->nb, b = a->b0 + p % a->nb, m = a->m;
    *s = (uint64_t)(a->table[t] + a->src_ids[b] * a->table[m + t]);
    *d = (uint64_t)(a->table[2 * m + t] + a->dst_ids[b] * a->table[3 * m + t]);
    *z = (uint64_t)a->table[4 * m + t];
}

NPO_HD void npo_table_thread(const npo_table_args *a, uint32_t block, uint32_t nblocks, uint32_t thread,
                             uint32_t nthreads) {
    NPO_PAGE_LOOP(npo_table_page, a, a->m * a->nb, a->group, block, nblocks, thread, nthreads);
}

NPO_HD void npo_table_inline_thread(const npo_table_inline_args *p, uint32_t block, uint32_t nblocks,
                                    uint32_t thread, uint32_t nthreads) {
    npo_table_args a = {p->table, p->ids, p->ids + NPO_INLINE_IDS, p->m, 0, p->nb, p->group};
    npo_table_thread(&a, block, nblocks, thread, nthreads);
}

/* Lanes per page for a range whose smallest page is `min_page` bytes: one pass of
 * NPO_GATHER_UNROLL vectors per lane covers the page, up to a whole warp. */
NPO_HD uint32_t npo_gather_group(uint64_t min_page) {
    uint32_t g = 1;
    while (g < 32 && (uint64_t)g * 2 * 16 * NPO_GATHER_UNROLL <= min_page) g *= 2;
    return g;
}

#endif /* NPO_GATHER_BODY_H */
