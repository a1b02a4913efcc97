/*
 * troupe's stand-in for libcuda.so.1: a driver that is installed but sees no GPU.
 *
 * Built by tests/no_cuda.rs into a temporary directory and put first on LD_LIBRARY_PATH of a child
 * test process, so the "driver present, no device" path runs on machines without a GPU.
 * It exports only what that path calls; every answer mirrors what a real driver returns
 * when no device is visible (cuInit fails with CUDA_ERROR_NO_DEVICE).
 */
typedef int CUresult;

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_NO_DEVICE = 100,
};

CUresult cuInit(unsigned int flags) {
    (void)flags;
    return CUDA_ERROR_NO_DEVICE;
}

CUresult cuDriverGetVersion(int *version) {
    if (!version) return CUDA_ERROR_INVALID_VALUE;
    *version = 12080;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetCount(int *count) {
    if (!count) return CUDA_ERROR_INVALID_VALUE;
    *count = 0;
    return CUDA_ERROR_NOT_INITIALIZED;
}

CUresult cuDeviceGet(int *device, int ordinal) {
    (void)device;
    (void)ordinal;
    return CUDA_ERROR_NOT_INITIALIZED;
}

static const char *error_name(CUresult e) {
    switch (e) {
    case CUDA_SUCCESS: return "CUDA_SUCCESS";
    case CUDA_ERROR_INVALID_VALUE: return "CUDA_ERROR_INVALID_VALUE";
    case CUDA_ERROR_NOT_INITIALIZED: return "CUDA_ERROR_NOT_INITIALIZED";
    case CUDA_ERROR_NO_DEVICE: return "CUDA_ERROR_NO_DEVICE";
    default: return "CUDA_ERROR_UNKNOWN";
    }
}

static const char *error_text(CUresult e) {
    switch (e) {
    case CUDA_SUCCESS: return "no error";
    case CUDA_ERROR_INVALID_VALUE: return "invalid argument";
    case CUDA_ERROR_NOT_INITIALIZED: return "initialization error";
    case CUDA_ERROR_NO_DEVICE: return "no CUDA-capable device is detected";
    default: return "unknown error";
    }
}

CUresult cuGetErrorName(CUresult e, const char **out) {
    if (!out) return CUDA_ERROR_INVALID_VALUE;
    *out = error_name(e);
    return CUDA_SUCCESS;
}

CUresult cuGetErrorString(CUresult e, const char **out) {
    if (!out) return CUDA_ERROR_INVALID_VALUE;
    *out = error_text(e);
    return CUDA_SUCCESS;
}
