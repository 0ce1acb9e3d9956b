// npo_cuda_stream_create / npo_cuda_stream_destroy: the transfer streams. They are the
// driver's own non-blocking streams, not torch's pooled ones: torch hands out 32 pooled streams
// per priority round-robin, and vLLM computes on a pooled stream, so a pooled transfer stream can
// be the model's own stream and every transfer on it stalls the next forward for its whole
// duration (measured: docs/benchmarks.md). Non-blocking: work on the legacy default
// stream (a synchronous cudaMemcpy somewhere) must not wait for a transfer either.
#include "driver.h"
#include "npo_cuda.h"

extern "C" int npo_cuda_stream_create(int priority, void **out, char *msg, size_t msg_len) {
    const npo_driver *drv = npo_driver_get();
    if (drv->status != 0) return npo_failf(drv->status, msg, msg_len, "cuStreamCreateWithPriority: %s", drv->error);
    if (!drv->stream_create || !drv->stream_destroy)
        return npo_failf(NPO_ERR_UNSUPPORTED, msg, msg_len, "the driver lacks cuStreamCreateWithPriority/cuStreamDestroy");
    if (!out) return npo_failf(NPO_ERR_BAD_ARG, msg, msg_len, "cuStreamCreateWithPriority: null output");
    int rc = npo_bind_context(drv, nullptr, msg, msg_len);
    if (rc != 0) return rc;
    CUresult r = drv->stream_create((CUstream *)out, CU_STREAM_NON_BLOCKING, priority);
    if (r != CUDA_SUCCESS) {
        *out = nullptr;
        return npo_fail(drv, r, "cuStreamCreateWithPriority", -1, msg, msg_len);
    }
    return 0;
}

extern "C" int npo_cuda_stream_destroy(void *stream, char *msg, size_t msg_len) {
    const npo_driver *drv = npo_driver_get();
    if (drv->status != 0 || !drv->stream_destroy || !stream) return 0;
    CUresult r = drv->stream_destroy((CUstream)stream);
    return r == CUDA_SUCCESS ? 0 : npo_fail(drv, r, "cuStreamDestroy", -1, msg, msg_len);
}
