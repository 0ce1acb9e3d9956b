// Queries: which copy mode was compiled in and which the driver provides at run time.
#include "driver.h"
#include "npo_cuda.h"

extern "C" int npo_cuda_abi_version(void) { return NPO_CUDA_ABI_VERSION; }

extern "C" int npo_cuda_built_mode(void) { return NPO_BATCH_MEMCPY ? 1 : 0; }

extern "C" int npo_cuda_runtime_mode(int *driver_version, char *msg, size_t msg_len) {
    const npo_driver *drv = npo_driver_get();
    if (driver_version) *driver_version = drv->driver_version;
    if (drv->status != 0) return npo_failf(drv->status, msg, msg_len, "%s", drv->error);
    return drv->mode;
}
