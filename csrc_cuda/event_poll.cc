// npo_cuda_event_poll: whether a transfer's end event has completed, and its device time, in one
// call. The engine's poll asks this of the job it reports; through torch that is two calls
// (Event.query, then elapsed_time under a device guard), each a Python and a C++ layer on the
// engine thread, which the connector waits on before it sees the completion. Done, it takes one driver
// call (cuEventElapsedTime), pending one too.
#include "driver.h"
#include "npo_cuda.h"

extern "C" int npo_cuda_event_poll(void *start, void *end, float *ms, char *msg, size_t msg_len) {
    const npo_driver *drv = npo_driver_get();
    if (drv->status != 0) return npo_failf(drv->status, msg, msg_len, "cuEventQuery: %s", drv->error);
    if (!drv->event_query || !drv->event_elapsed)
        return npo_failf(NPO_ERR_UNSUPPORTED, msg, msg_len, "the driver lacks cuEventQuery/cuEventElapsedTime");
    if (!end) return npo_failf(NPO_ERR_BAD_ARG, msg, msg_len, "cuEventQuery: null end event");
    // The device time first: it answers "not ready" itself while either event is pending, so the poll
    // that reports a job makes one driver call, not two (each 2-4 us on an H200 host: docs/benchmarks.md,
    // fifteenth session). Any other answer goes to the query, which tells a failed end (a failed copy)
    // from a start whose time cannot be read.
    CUresult elapsed = CUDA_SUCCESS;
    if (start && ms) {
        elapsed = drv->event_elapsed(ms, (CUevent)start, (CUevent)end);
        if (elapsed == CUDA_SUCCESS) return 0;
        if (elapsed == CUDA_ERROR_NOT_READY) return NPO_PENDING;
    }
    CUresult r = drv->event_query((CUevent)end);
    if (r == CUDA_ERROR_NOT_READY) return NPO_PENDING;
    if (r != CUDA_SUCCESS) return npo_fail(drv, r, "cuEventQuery", -1, msg, msg_len);
    if (elapsed != CUDA_SUCCESS) {  // done, its time unreadable (e.g. a start never recorded): best effort, as through torch
        npo_fail(drv, elapsed, "cuEventElapsedTime", -1, msg, msg_len);
        return NPO_DONE_NO_TIME;
    }
    return 0;
}
