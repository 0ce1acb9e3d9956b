// Run-time resolution of the CUDA driver: dlopen("libcuda.so.1") and cuGetProcAddress
// with an explicit version, so one build serves 12.8/12.9 drivers (9-argument
// cuMemcpyBatchAsync with failIdx) and 13.x drivers (the _v2 form) and loads without
// any driver installed (calls then report "libcuda.so.1 not found").
#include <dlfcn.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include <mutex>

#include "driver.h"
#include "npo_cuda.h"

namespace {

typedef CUresult (*GetProcV2)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);
typedef CUresult (*GetProcV1)(const char *, void **, int, cuuint64_t);
typedef CUresult (*DriverGetVersion)(int *);

npo_driver g_drv;
std::once_flag g_once;

struct Resolver {
    GetProcV2 v2 = nullptr;
    GetProcV1 v1 = nullptr;

    // The entry point of `name` as of CUDA `version` (legacy-stream flavour: we always
    // pass explicit streams, as torch does), or nullptr.
    void *get(const char *name, int version) const {
        void *fn = nullptr;
        CUresult rc;
        if (v2) {
            CUdriverProcAddressQueryResult q = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
            rc = v2(name, &fn, version, CU_GET_PROC_ADDRESS_LEGACY_STREAM, &q);
            if (rc != CUDA_SUCCESS || q != CU_GET_PROC_ADDRESS_SUCCESS) return nullptr;
        } else {
            rc = v1(name, &fn, version, CU_GET_PROC_ADDRESS_LEGACY_STREAM);
            if (rc != CUDA_SUCCESS) return nullptr;
        }
        return fn;
    }
};

void fail_resolve(const char *fmt, const char *arg) {
    g_drv.status = NPO_ERR_NO_DRIVER;
    snprintf(g_drv.error, sizeof(g_drv.error), fmt, arg ? arg : "");
}

void resolve() {
    memset(&g_drv, 0, sizeof(g_drv));
    g_drv.mode = NPO_MODE_LOOP;
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        const char *why = dlerror();
        fail_resolve("libcuda.so.1 not found (no NVIDIA driver on this machine?): %s", why);
        return;
    }
    Resolver r;
    r.v2 = reinterpret_cast<GetProcV2>(dlsym(lib, "cuGetProcAddress_v2"));
    if (!r.v2) r.v1 = reinterpret_cast<GetProcV1>(dlsym(lib, "cuGetProcAddress"));
    auto drv_version = reinterpret_cast<DriverGetVersion>(dlsym(lib, "cuDriverGetVersion"));
    if ((!r.v2 && !r.v1) || !drv_version) {
        fail_resolve("libcuda.so.1 lacks cuGetProcAddress/cuDriverGetVersion (driver older than CUDA 11.3)%s", "");
        return;
    }
    CUresult rc = drv_version(&g_drv.driver_version);
    if (rc != CUDA_SUCCESS) {
        char code[32];
        snprintf(code, sizeof(code), "%d", (int)rc);
        fail_resolve("cuDriverGetVersion failed with CUresult %s", code);
        return;
    }
    struct {
        const char *name;
        void **slot;
    } required[] = {
        {"cuMemcpyAsync", reinterpret_cast<void **>(&g_drv.memcpy_async)},
        {"cuGetErrorString", reinterpret_cast<void **>(&g_drv.get_error_string)},
        {"cuGetErrorName", reinterpret_cast<void **>(&g_drv.get_error_name)},
        {"cuCtxGetCurrent", reinterpret_cast<void **>(&g_drv.ctx_get_current)},
        {"cuCtxSetCurrent", reinterpret_cast<void **>(&g_drv.ctx_set_current)},
        {"cuStreamGetCtx", reinterpret_cast<void **>(&g_drv.stream_get_ctx)},
    };
    for (auto &req : required) {
        *req.slot = r.get(req.name, 11030);
        if (!*req.slot) {
            fail_resolve("libcuda.so.1: cuGetProcAddress found no %s", req.name);
            return;
        }
    }
    // The kernel launch entry points are optional: without them only the gather is unsupported.
    g_drv.module_load_data = reinterpret_cast<npo_cuModuleLoadData_t>(r.get("cuModuleLoadData", 11030));
    g_drv.module_get_function = reinterpret_cast<npo_cuModuleGetFunction_t>(r.get("cuModuleGetFunction", 11030));
    g_drv.launch_kernel = reinterpret_cast<npo_cuLaunchKernel_t>(r.get("cuLaunchKernel", 11030));
    g_drv.event_create = reinterpret_cast<npo_cuEventCreate_t>(r.get("cuEventCreate", 11030));
    g_drv.event_destroy = reinterpret_cast<npo_cuEventDestroy_t>(r.get("cuEventDestroy", 11030));
    g_drv.event_record = reinterpret_cast<npo_cuEventRecord_t>(r.get("cuEventRecord", 11030));
    g_drv.stream_wait_event = reinterpret_cast<npo_cuStreamWaitEvent_t>(r.get("cuStreamWaitEvent", 11030));
    g_drv.stream_create = reinterpret_cast<npo_cuStreamCreateWithPriority_t>(r.get("cuStreamCreateWithPriority", 11030));
    g_drv.stream_destroy = reinterpret_cast<npo_cuStreamDestroy_t>(r.get("cuStreamDestroy", 11030));
#if NPO_BATCH_MEMCPY
    // Ask for the ABI we have a prototype for: 13.0 gives cuMemcpyBatchAsync_v2,
    // 12.8 the form with failIdx. Drivers older than 12.8 have neither: loop.
    if (g_drv.driver_version >= 13000) {
        g_drv.batch_v2 = reinterpret_cast<npo_cuMemcpyBatchAsync_v2_t>(r.get("cuMemcpyBatchAsync", 13000));
        if (g_drv.batch_v2) g_drv.mode = NPO_MODE_BATCH_V2;
    }
    if (g_drv.mode == NPO_MODE_LOOP && g_drv.driver_version >= 12080) {
        g_drv.batch_v1 = reinterpret_cast<npo_cuMemcpyBatchAsync_v1_t>(r.get("cuMemcpyBatchAsync", 12080));
        if (g_drv.batch_v1) g_drv.mode = NPO_MODE_BATCH_V1;
    }
#endif
    g_drv.status = 0;
    // The library handle is kept open for the life of the process.
}

}  // namespace

const npo_driver *npo_driver_get(void) {
    std::call_once(g_once, resolve);
    return &g_drv;
}

int npo_failf(int rc, char *msg, size_t msg_len, const char *fmt, ...) {
    if (msg && msg_len) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(msg, msg_len, fmt, ap);
        va_end(ap);
    }
    return rc;
}

int npo_fail(const npo_driver *drv, int rc, const char *call, long long index, char *msg, size_t msg_len) {
    const char *name = nullptr, *text = nullptr;
    if (drv->get_error_name && drv->get_error_name((CUresult)rc, &name) != CUDA_SUCCESS) name = nullptr;
    if (drv->get_error_string && drv->get_error_string((CUresult)rc, &text) != CUDA_SUCCESS) text = nullptr;
    if (index >= 0)
        return npo_failf(rc, msg, msg_len, "%s failed at descriptor %lld: %s (%d): %s", call, index,
                         name ? name : "CUDA_ERROR_UNKNOWN", rc, text ? text : "unrecognized error code");
    return npo_failf(rc, msg, msg_len, "%s failed: %s (%d): %s", call, name ? name : "CUDA_ERROR_UNKNOWN", rc,
                     text ? text : "unrecognized error code");
}

int npo_prepare(const npo_driver **out, const uint64_t *src, const uint64_t *dst, const uint64_t *sizes, size_t n,
                void *stream, const char *call, char *msg, size_t msg_len) {
    const npo_driver *drv = npo_driver_get();
    *out = drv;
    if (drv->status != 0) return npo_failf(drv->status, msg, msg_len, "%s: %s", call, drv->error);
    if (n == 0) return 0;
    if (!src || !dst || !sizes) return npo_failf(NPO_ERR_BAD_ARG, msg, msg_len, "%s: null descriptor array", call);
    for (size_t i = 0; i < n; ++i) {
        if (!src[i] || !dst[i] || !sizes[i])
            return npo_failf(NPO_ERR_BAD_ARG, msg, msg_len,
                             "%s: descriptor %zu is invalid (src=0x%llx dst=0x%llx size=%llu); addresses and sizes "
                             "must be nonzero",
                             call, i, (unsigned long long)src[i], (unsigned long long)dst[i],
                             (unsigned long long)sizes[i]);
    }
    return npo_bind_context(drv, stream, msg, msg_len);
}

int npo_bind_context(const npo_driver *drv, void *stream, char *msg, size_t msg_len) {
    // Driver calls need a current context; a thread that never touched the runtime
    // has none, so borrow the stream's (the primary context torch made current).
    CUcontext ctx = nullptr;
    CUresult rc = drv->ctx_get_current(&ctx);
    if (rc != CUDA_SUCCESS) return npo_fail(drv, rc, "cuCtxGetCurrent", -1, msg, msg_len);
    if (!ctx && stream) {
        rc = drv->stream_get_ctx((CUstream)stream, &ctx);
        if (rc != CUDA_SUCCESS) return npo_fail(drv, rc, "cuStreamGetCtx", -1, msg, msg_len);
        rc = drv->ctx_set_current(ctx);
        if (rc != CUDA_SUCCESS) return npo_fail(drv, rc, "cuCtxSetCurrent", -1, msg, msg_len);
    }
    return 0;
}
