/*
 * TEST DOUBLE -- NOT ASCEND SOFTWARE. An emulation of the few ACL runtime entry points
 * that libnpu_offload_acl calls, with host-memory semantics, built as
 * libacl_emulation.so for CPU-only CI (point NPU_OFFLOAD_ACL_LIBRARY at it).
 *
 * - Copies really happen (memcpy) at submit time; "device" memory is host memory.
 * - Arguments are validated like the documented API: count <= destMax, batch attribute
 *   locations consistent (host id 0 <-> device id = aclrtGetDevice, or device <-> the same
 *   device), rsv zero, attrsIndexes[0] == 0 and increasing, memcpy kind H2D, D2H or D2D,
 *   64-byte aligned addresses for a D2D aclrtMemcpyAsync (acl_rt.h), aligned host registration.
 *   Overlapping source and destination ranges are rejected (memcpy would be undefined).
 * - Failure injection: ACL_EMU_FAIL_AT=k (or acl_emu_set_fail_at(k)) fails the k-th
 *   descriptor (0-based) submitted since acl_emu_reset(), counted across calls: in a batch
 *   call it sets failIndex to its position in that call and nothing of that call is copied;
 *   as an aclrtMemcpyAsync call, the earlier calls have copied. The code returned is ACL_EMU_FAIL_CODE
 *   (default ACL_ERROR_RT_INTERNAL_ERROR).
 * - Counters (acl_emu_count) and the last stream seen let tests check which path ran;
 *   "d2d_copies" counts descriptors copied as device->device by either entry point.
 * - Events (aclrtCreateEvent[ExWithFlag], aclrtDestroyEvent, aclrtRecordEvent, aclrtStreamWaitEvent)
 *   are recording no-ops: copies are synchronous, so there is nothing to order. "events_live" counts
 *   created minus destroyed; recording or waiting on an event that is not live fails.
 * - An ordered op log (acl_emu_log, since acl_emu_reset) names every copy call and event
 *   operation with its stream and event handles (%p), so tests can check the order a staged pipeline enqueues.
 * It is compiled against the same ACL headers, so its signatures are checked by the compiler.
 */
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <acl/acl_rt.h>
#include <acl/error_codes/rt_error_codes.h>

#define EMU_API __attribute__((visibility("default")))

static int32_t g_device;
static long long g_fail_at = -1;
static int g_fail_set;
static long long g_seen; /* descriptors submitted since reset (loop calls + batch entries) */
static long long g_counts[11]; /* see COUNT_NAMES */
static void *g_last_stream;
static __thread char g_msg[256];
static void *g_registered[64];

static const char *const COUNT_NAMES[] = {"aclrtMemcpyAsync", "aclrtMemcpyBatchAsync", "aclrtMemcpyBatchAsyncV2",
                                          "aclrtHostRegisterV2", "aclrtHostUnregister", "d2d_copies",
                                          "aclrtCreateEvent", "aclrtDestroyEvent", "aclrtRecordEvent",
                                          "aclrtStreamWaitEvent", "events_live"};
enum { C_CREATE = 6, C_DESTROY, C_RECORD, C_WAIT, C_LIVE };
#define N_EVENTS 256
static unsigned char g_events[N_EVENTS]; /* an event handle is &g_events[i]; 1 = live */
static char g_log[1 << 16];
static size_t g_log_len;
#define N_COUNTS (int)(sizeof(COUNT_NAMES) / sizeof(COUNT_NAMES[0]))

/* One line per operation; the log stops (ending in "...") when full. */
static void log_op(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void log_op(const char *fmt, ...) {
    if (g_log_len + 128 >= sizeof(g_log)) {
        if (g_log_len + 4 < sizeof(g_log)) g_log_len += (size_t)snprintf(g_log + g_log_len, 5, "...\n");
        return;
    }
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(g_log + g_log_len, 120, fmt, ap);
    va_end(ap);
    if (n > 0) g_log_len += (size_t)(n < 119 ? n : 119);
    g_log[g_log_len++] = '\n';
    g_log[g_log_len] = 0;
}

static const char *kind_name(aclrtMemcpyKind kind) {
    return kind == ACL_MEMCPY_HOST_TO_DEVICE ? "H2D" : kind == ACL_MEMCPY_DEVICE_TO_HOST ? "D2H"
         : kind == ACL_MEMCPY_DEVICE_TO_DEVICE ? "D2D" : "?";
}

static const char *batch_kind(const aclrtMemcpyBatchAttr *attrs) {
    if (!attrs) return "?";
    return attrs->srcLoc.type == ACL_MEM_LOCATION_TYPE_HOST ? "H2D"
         : attrs->dstLoc.type == ACL_MEM_LOCATION_TYPE_HOST ? "D2H" : "D2D";
}

static aclError fail(aclError code, const char *fmt, const char *what, long long i) {
    snprintf(g_msg, sizeof(g_msg), fmt, what, i);
    return code;
}

static long long fail_at(void) {
    if (g_fail_set) return g_fail_at;
    const char *env = getenv("ACL_EMU_FAIL_AT");
    return (env && *env) ? atoll(env) : -1;
}

static int overlaps(const void *dst, const void *src, size_t n) {
    uintptr_t d = (uintptr_t)dst, s = (uintptr_t)src;
    return d < s + n && s < d + n;
}

static aclError injected_code(void) {
    const char *env = getenv("ACL_EMU_FAIL_CODE");
    return (env && *env) ? (aclError)atoi(env) : ACL_ERROR_RT_INTERNAL_ERROR;
}

/* ---- test controls -------------------------------------------------------------------- */
EMU_API void acl_emu_set_fail_at(long long k) { g_fail_at = k, g_fail_set = 1; }
EMU_API void acl_emu_set_device(int32_t dev) { g_device = dev; }
EMU_API void *acl_emu_last_stream(void) { return g_last_stream; }
EMU_API void acl_emu_reset(void) {
    g_fail_at = -1, g_fail_set = 0, g_seen = 0, g_last_stream = NULL, g_device = 0;
    memset(g_counts, 0, sizeof(g_counts));
    for (int i = 0; i < N_EVENTS; i++) g_counts[C_LIVE] += g_events[i];  /* events outlive a reset */
    g_msg[0] = 0;
    g_log_len = 0, g_log[0] = 0;
}
EMU_API const char *acl_emu_log(void) { return g_log; }
EMU_API long long acl_emu_count(const char *name) {
    for (int i = 0; i < N_COUNTS; i++)
        if (!strcmp(name, COUNT_NAMES[i])) return g_counts[i];
    return -1;
}

/* ---- ACL entry points ----------------------------------------------------------------- */
const char *aclGetRecentErrMsg(void) { return g_msg; }

aclError aclrtGetDevice(int32_t *deviceId) {
    if (!deviceId) return fail(ACL_ERROR_INVALID_PARAM, "%s is NULL%lld", "deviceId", 0);
    *deviceId = g_device;
    return ACL_SUCCESS;
}

aclError aclrtMemcpyAsync(void *dst, size_t destMax, const void *src, size_t count, aclrtMemcpyKind kind,
                          aclrtStream stream) {
    g_counts[0]++;
    g_last_stream = stream;
    long long call = g_seen++;
    int d2d = kind == ACL_MEMCPY_DEVICE_TO_DEVICE;
    if (kind != ACL_MEMCPY_HOST_TO_DEVICE && kind != ACL_MEMCPY_DEVICE_TO_HOST && !d2d)
        return fail(ACL_ERROR_INVALID_PARAM, "emulation: %s %lld not supported", "memcpy kind", (long long)kind);
    if (!dst || !src) return fail(ACL_ERROR_INVALID_PARAM, "emulation: %s (call %lld)", "NULL address", call);
    if (count > destMax)
        return fail(ACL_ERROR_INVALID_PARAM, "emulation: %s (call %lld)", "count exceeds destMax", call);
    if (d2d && (((uintptr_t)dst | (uintptr_t)src) & 63u))
        return fail(ACL_ERROR_INVALID_PARAM, "emulation: %s (call %lld)", "D2D addresses not 64-byte aligned", call);
    if (overlaps(dst, src, count))
        return fail(ACL_ERROR_INVALID_PARAM, "emulation: %s (call %lld)", "overlapping src/dst", call);
    log_op("aclrtMemcpyAsync %s s=%p", kind_name(kind), stream);
    if (call == fail_at()) return fail(injected_code(), "emulation: %s at call %lld", "injected failure", call);
    memcpy(dst, src, count);
    g_counts[5] += d2d;
    return ACL_SUCCESS;
}

static int is_loc(aclrtMemLocation l, aclrtMemLocationType type, uint32_t id) {
    return l.type == type && l.id == id;
}

/* Which end is where: H2D/D2H pair host id 0 with the current device; D2D has both ends on it. */
static int attr_pair_ok(const aclrtMemcpyBatchAttr *at, int *d2d) {
    uint32_t dev = (uint32_t)g_device;
    int src_dev = is_loc(at->srcLoc, ACL_MEM_LOCATION_TYPE_DEVICE, dev);
    int dst_dev = is_loc(at->dstLoc, ACL_MEM_LOCATION_TYPE_DEVICE, dev);
    int src_host = is_loc(at->srcLoc, ACL_MEM_LOCATION_TYPE_HOST, 0);
    int dst_host = is_loc(at->dstLoc, ACL_MEM_LOCATION_TYPE_HOST, 0);
    *d2d = src_dev && dst_dev;
    return (src_host && dst_dev) || (src_dev && dst_host) || *d2d;
}

static aclError batch(void **dsts, size_t *destMaxs, void **srcs, size_t *sizes, size_t n,
                      aclrtMemcpyBatchAttr *attrs, size_t *attrsIndexes, size_t numAttrs, size_t *failIndex) {
    if (failIndex) *failIndex = SIZE_MAX;
    if (!dsts || !destMaxs || !srcs || !sizes || !attrs || !attrsIndexes || n == 0)
        return fail(ACL_ERROR_INVALID_PARAM, "emulation: %s (n=%lld)", "NULL array or empty batch", (long long)n);
    if (numAttrs == 0 || numAttrs > n || attrsIndexes[0] != 0)
        return fail(ACL_ERROR_INVALID_PARAM, "emulation: %s (numAttrs=%lld)", "bad attrsIndexes/numAttrs",
                    (long long)numAttrs);
    for (size_t a = 0; a < numAttrs; a++) {
        aclrtMemcpyBatchAttr *at = &attrs[a];
        if ((a && attrsIndexes[a] <= attrsIndexes[a - 1]) || attrsIndexes[a] >= n)
            return fail(ACL_ERROR_INVALID_PARAM, "emulation: %s %lld", "attrsIndexes not increasing or >= n at",
                        (long long)a);
        for (size_t r = 0; r < sizeof(at->rsv); r++)
            if (at->rsv[r]) return fail(ACL_ERROR_INVALID_PARAM, "emulation: %s %lld", "rsv non-zero in attr", (long long)a);
        int d2d;
        if (!attr_pair_ok(at, &d2d))
            return fail(ACL_ERROR_INVALID_PARAM,
                        "emulation: %s %lld (need host id 0 <-> current device, or current device -> itself)",
                        "inconsistent src/dst locations in attr", (long long)a);
    }
    for (size_t i = 0; i < n; i++) {
        if (!dsts[i] || !srcs[i] || sizes[i] == 0 || sizes[i] > destMaxs[i] || overlaps(dsts[i], srcs[i], sizes[i])) {
            if (failIndex) *failIndex = i;
            return fail(ACL_ERROR_INVALID_PARAM, "emulation: %s %lld", "bad address/size/destMax/overlap at descriptor",
                        (long long)i);
        }
    }
    long long first = g_seen, k = fail_at();
    g_seen += (long long)n;
    if (k >= first && k < first + (long long)n) {
        if (failIndex) *failIndex = (size_t)(k - first);
        return fail(injected_code(), "emulation: %s at descriptor %lld", "injected failure", k - first);
    }
    size_t a = 0;
    for (size_t i = 0; i < n; i++) {
        while (a + 1 < numAttrs && attrsIndexes[a + 1] <= i) a++;
        int d2d;
        attr_pair_ok(&attrs[a], &d2d);
        memcpy(dsts[i], srcs[i], sizes[i]);
        g_counts[5] += d2d;
    }
    return ACL_SUCCESS;
}

aclError aclrtMemcpyBatchAsync(void **dsts, size_t *destMaxs, void **srcs, size_t *sizes, size_t numBatches,
                               aclrtMemcpyBatchAttr *attrs, size_t *attrsIndexes, size_t numAttrs,
                               size_t *failIndex, aclrtStream stream) {
    g_counts[1]++;
    g_last_stream = stream;
    log_op("aclrtMemcpyBatchAsync %s n=%zu s=%p", batch_kind(attrs), numBatches, stream);
    if (!failIndex) return fail(ACL_ERROR_INVALID_PARAM, "emulation: %s%lld", "failIndex is NULL", 0);
    return batch(dsts, destMaxs, srcs, sizes, numBatches, attrs, attrsIndexes, numAttrs, failIndex);
}

aclError aclrtMemcpyBatchAsyncV2(void **dsts, size_t *destMaxs, void **srcs, size_t *sizes, size_t numBatches,
                                 aclrtMemcpyBatchAttr *attrs, size_t *attrsIndexes, size_t numAttrs,
                                 aclrtStream stream) {
    g_counts[2]++;
    g_last_stream = stream;
    log_op("aclrtMemcpyBatchAsyncV2 %s n=%zu s=%p", batch_kind(attrs), numBatches, stream);
    return batch(dsts, destMaxs, srcs, sizes, numBatches, attrs, attrsIndexes, numAttrs, NULL);
}

aclError aclrtHostRegisterV2(void *ptr, uint64_t size, uint32_t flag) {
    g_counts[3]++;
    if (!ptr || size == 0 || ((uintptr_t)ptr & 4095u))
        return fail(ACL_ERROR_INVALID_PARAM, "emulation: %s %lld", "unaligned or empty range at", (long long)(uintptr_t)ptr);
    if (!(flag & ACL_HOST_REG_PINNED))
        return fail(ACL_ERROR_INVALID_PARAM, "emulation: %s %lld", "flag lacks ACL_HOST_REG_PINNED:", (long long)flag);
    for (int i = 0; i < 64; i++)
        if (!g_registered[i]) return g_registered[i] = ptr, ACL_SUCCESS;
    return fail(ACL_ERROR_INVALID_PARAM, "emulation: %s%lld", "too many registrations", 0);
}

aclError aclrtHostUnregister(void *ptr) {
    g_counts[4]++;
    for (int i = 0; i < 64; i++)
        if (ptr && g_registered[i] == ptr) return g_registered[i] = NULL, ACL_SUCCESS;
    return fail(ACL_ERROR_INVALID_PARAM, "emulation: %s %lld", "pointer was not registered:", (long long)(uintptr_t)ptr);
}

/* ---- events: no-ops that log (copies are synchronous) -------------------------------- */
static long long event_index(aclrtEvent event) {
    unsigned char *e = (unsigned char *)event;
    return (e >= g_events && e < g_events + N_EVENTS && *e) ? (long long)(e - g_events) : -1;
}

static aclError create(aclrtEvent *event, const char *how) {
    g_counts[C_CREATE]++;
    if (!event) return fail(ACL_ERROR_INVALID_PARAM, "emulation: %s%lld", "event is NULL", 0);
    for (int i = 0; i < N_EVENTS; i++)
        if (!g_events[i]) {
            g_events[i] = 1, g_counts[C_LIVE]++;
            *event = &g_events[i];
            log_op("%s e=%p", how, *event);
            return ACL_SUCCESS;
        }
    return fail(ACL_ERROR_INVALID_PARAM, "emulation: %s%lld", "too many events", 0);
}

aclError aclrtCreateEvent(aclrtEvent *event) { return create(event, "aclrtCreateEvent"); }

aclError aclrtCreateEventExWithFlag(aclrtEvent *event, uint32_t flag) {
    if (flag != ACL_EVENT_SYNC)
        return fail(ACL_ERROR_INVALID_PARAM, "emulation: %s %lld", "unexpected event flag", (long long)flag);
    return create(event, "aclrtCreateEventExWithFlag");
}

aclError aclrtDestroyEvent(aclrtEvent event) {
    g_counts[C_DESTROY]++;
    long long i = event_index(event);
    if (i < 0) return fail(ACL_ERROR_INVALID_PARAM, "emulation: %s%lld", "destroying an event that is not live", 0);
    g_events[i] = 0, g_counts[C_LIVE]--;
    log_op("aclrtDestroyEvent e=%p", event);
    return ACL_SUCCESS;
}

/* Record and wait: counted, refused on an event that is not live, logged; the copies already ran. */
static aclError event_op(int counter, aclrtEvent event, aclrtStream stream, const char *what, const char *call) {
    g_counts[counter]++;
    if (event_index(event) < 0) return fail(ACL_ERROR_INVALID_PARAM, "emulation: %s%lld", what, 0);
    log_op("%s e=%p s=%p", call, event, stream);
    return ACL_SUCCESS;
}

aclError aclrtRecordEvent(aclrtEvent event, aclrtStream stream) {
    return event_op(C_RECORD, event, stream, "recording an event that is not live", "aclrtRecordEvent");
}

aclError aclrtStreamWaitEvent(aclrtStream stream, aclrtEvent event) {
    return event_op(C_WAIT, event, stream, "waiting on an event that is not live", "aclrtStreamWaitEvent");
}
