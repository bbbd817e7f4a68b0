/* The CUDA backend's C API beyond the backend table (kernels/backend.h).
 *
 * The kernels live in a separate shared library, conveyor/_conveyor_cuda.so,
 * built by build_support/cuda_build.py when nvcc is found. conveyor._core never links
 * against CUDA: kernels/cuda_loader.c dlopen()s that library on the first
 * cv_cuda_backend_create(), so `import conveyor` works on machines without a
 * GPU, a driver or the CUDA runtime.
 *
 * Errors. Kernel functions of the table return void and run asynchronously,
 * so the backend records the FIRST error it sees (a failed launch, a failed
 * cuBLAS call, an out-of-range block id or slot found by a kernel, an
 * unsupported shape) and keeps it until cleared. Device-side problems surface
 * at the next sync(). The engine should call b->sync(b) and then
 * cv_cuda_last_error() after each step. Codes: CV_ERR_NOMEM (device memory),
 * CV_ERR_UNSUPPORTED (shape or GPU not supported), CV_ERR_INVALID (bad
 * arguments or indices), CV_ERR_IO (any other CUDA/cuBLAS failure; errors such
 * as an illegal address leave the CUDA context unusable). */
#ifndef CV_CUDA_H
#define CV_CUDA_H

#ifdef __cplusplus
extern "C" {
#endif

#include "../backend.h"

/* Bumped whenever the table or the entry points below change, so that a
 * stale _conveyor_cuda.so is refused instead of misused. */
#define CV_CUDA_ABI_VERSION 6 /* 6: cv_attn_batch.window, the qwen3/gemma3 kernels, the GGUF Q5/K dtypes */
#define CV_CUDA_LIB_NAME "_conveyor_cuda.so"

/* --- implemented by the loader (kernels/cuda_loader.c, in each module) --- */

/* 1 if b was made by cv_cuda_backend_create. */
int cv_cuda_is_backend(const cv_backend *b);
/* The first error recorded since creation or the last clear: returns its
 * code (0 = none) and copies it into err when err is non-NULL and code != 0.
 * Returns 0 for a non-CUDA backend. Does not wait for the device. */
int cv_cuda_last_error(cv_backend *b, cv_err *err);
/* Forgets the recorded error (sticky CUDA errors will be recorded again). */
void cv_cuda_clear_error(cv_backend *b);
/* Device-to-device copy bandwidth in GB/s (bytes read + bytes written per
 * second) over buffers of `bytes`, best of `repeats`; < 0 on error (err set). */
double cv_cuda_memcpy_bandwidth(cv_backend *b, size_t bytes, int repeats, cv_err *err);
/* Describes the device ("NVIDIA H200, sm_90, 132 SMs, 139.8 GiB") into buf. */
void cv_cuda_device_name(cv_backend *b, char *buf, size_t len);

/* --- exported by _conveyor_cuda.so (looked up with dlsym) ----------------- */
int cv_cuda_abi_version_impl(void);
cv_backend *cv_cuda_backend_create_impl(int device, cv_err *err);
int cv_cuda_last_error_impl(cv_backend *b, cv_err *err);
void cv_cuda_clear_error_impl(cv_backend *b);
double cv_cuda_memcpy_bandwidth_impl(cv_backend *b, size_t bytes, int repeats, cv_err *err);
void cv_cuda_device_name_impl(cv_backend *b, char *buf, size_t len);

#ifdef __cplusplus
}
#endif

#endif
