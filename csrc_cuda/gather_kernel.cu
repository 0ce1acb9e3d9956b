// The device-local gather/scatter kernels (per-page descriptors, or the staged
// pipeline's table form), compiled to a fatbin that gather_launch.cc
// loads with cuModuleLoadData (no CUDA runtime, no torch). One block of
// NPO_GATHER_THREADS per SM at most: the launcher caps the grid at the caller's
// program count (<= 16), so model kernels keep the rest of the GPU.
#include "gather_body.h"

extern "C" __global__ void __launch_bounds__(NPO_GATHER_THREADS, 1)
    npo_gather_pages(const uint64_t *src, const uint64_t *dst, const uint64_t *size, uint64_t first, uint64_t width,
                     uint64_t rows, uint64_t stride, uint32_t group) {
    npo_gather_args a = {src, dst, size, first, width, rows, stride, group};
    npo_gather_thread(&a, blockIdx.x, gridDim.x, threadIdx.x, blockDim.x);
}

extern "C" __global__ void __launch_bounds__(NPO_GATHER_THREADS, 1)
    npo_gather_table(const int64_t *table, uint64_t m, const int64_t *src_ids, const int64_t *dst_ids, uint64_t b0,
                     uint64_t nb, uint32_t group) {
    npo_table_args a = {table, src_ids, dst_ids, m, b0, nb, group};
    npo_table_thread(&a, blockIdx.x, gridDim.x, threadIdx.x, blockDim.x);
}

extern "C" __global__ void __launch_bounds__(NPO_GATHER_THREADS, 1)
    npo_gather_table_inline(const __grid_constant__ npo_table_inline_args p) {
    npo_table_inline_thread(&p, blockIdx.x, gridDim.x, threadIdx.x, blockDim.x);
}
