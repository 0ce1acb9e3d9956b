/*
 * The slot events of staged transfers, owned by this library (created and destroyed here, not
 * torch_npu's), so npu_offload_acl_staged_run can record and wait on them without Python.
 * aclrtCreateEventExWithFlag(ACL_EVENT_SYNC) when the runtime exports it: its events may be
 * recorded again and again, as each slot's are once per slice; else plain aclrtCreateEvent.
 */
#include "npu_offload_acl.h"

/* Fill out[0..n) with new events; on failure none is left behind. */
NPU_OFFLOAD_API int npu_offload_acl_events_create(int64_t n, void **out, npu_offload_acl_error *err) {
    npu_err_clear(err);
    if (n < 0 || (n > 0 && !out))
        return npu_err_set(err, NPU_OFFLOAD_BAD_ARGUMENT, "argument", 0, -1, -1,
                           "events_create: bad arguments (n=%lld, out=%p)", (long long)n, (void *)out);
    if (n == 0) return NPU_OFFLOAD_OK;
    const npu_acl_symbols *acl = npu_acl_load(err);
    if (!acl) return NPU_OFFLOAD_MISSING;
    if (!acl->create_event_ex && !acl->create_event) return npu_acl_missing(err, "aclrtCreateEvent", "");
    if (!acl->destroy_event) return npu_acl_missing(err, "aclrtDestroyEvent", "");
    const char *call = acl->create_event_ex ? "aclrtCreateEventExWithFlag" : "aclrtCreateEvent";
    for (int64_t i = 0; i < n; i++) {
        out[i] = NULL;
        aclError rc = acl->create_event_ex ? acl->create_event_ex(&out[i], ACL_EVENT_SYNC) : acl->create_event(&out[i]);
        if (rc != ACL_SUCCESS) {
            npu_err_acl(err, acl, call, rc, i, -1);
            for (int64_t j = 0; j < i; j++) {
                acl->destroy_event(out[j]);  /* best effort: the create failure is the error reported */
                out[j] = NULL;
            }
            return NPU_OFFLOAD_ACL_FAILED;
        }
    }
    return NPU_OFFLOAD_OK;
}

/* Destroy every non-NULL event of events[0..n) and clear it; the first failure is reported. */
NPU_OFFLOAD_API int npu_offload_acl_events_destroy(int64_t n, void **events, npu_offload_acl_error *err) {
    npu_err_clear(err);
    if (n <= 0 || !events) return NPU_OFFLOAD_OK;
    const npu_acl_symbols *acl = npu_acl_load(err);
    if (!acl) return NPU_OFFLOAD_MISSING;
    if (!acl->destroy_event) return npu_acl_missing(err, "aclrtDestroyEvent", "");
    int first = NPU_OFFLOAD_OK;
    for (int64_t i = 0; i < n; i++) {
        if (!events[i]) continue;
        aclError rc = acl->destroy_event(events[i]);
        if (rc != ACL_SUCCESS && first == NPU_OFFLOAD_OK) first = npu_err_acl(err, acl, "aclrtDestroyEvent", rc, i, -1);
        events[i] = NULL;
    }
    return first;
}
