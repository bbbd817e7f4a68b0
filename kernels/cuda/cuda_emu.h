/* A CPU emulator of the CUDA subset the backend uses, for testing the real
 * kernel code on machines without a GPU (never part of a normal build).
 *
 * build_support/cuda_build.py build_emulated_library() compiles kernels/cuda/*.cu
 * with g++ against this header (it stands in for cuda_runtime.h, cublas_v2.h,
 * cuda_fp16.h and cuda_bf16.h) after rewriting `k<<<cfg>>>(args)` into
 * cvemu::launch(k, cvemu::cfg(cfg), args) and `extern __shared__ T name[]`
 * into a pointer to the block's dynamic shared memory.
 *
 * Execution: blocks run one after another; the threads of a block are
 * fibers (ucontext) on one OS thread, switched at __syncthreads, __syncwarp
 * and warp shuffles. A barrier is released when every live thread of the
 * block (or warp) waits at it; threads waiting at different kinds of
 * barriers with no way forward are reported as a deadlock (a divergent
 * barrier, which is undefined behaviour on a GPU). Launch configurations are
 * checked like the hardware does (block size, grid limits, dynamic shared
 * memory against the opt-in attribute). Dynamic shared memory starts filled
 * with NaN bytes so that reads of unwritten shared memory show up. */
#ifndef CV_CUDA_EMU_H
#define CV_CUDA_EMU_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <ucontext.h>

#include <cmath>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))

struct dim3 {
    unsigned x, y, z;
    constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
typedef dim3 uint3;
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) float2 { float x, y; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }

inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }

/* ------------------------------------------------------------ 16-bit types */

namespace cvemu {
inline uint32_t fbits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
inline float bitsf(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
inline uint16_t f2bf(float f) {
    uint32_t u = fbits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
inline float bf2f(uint16_t h) { return bitsf((uint32_t)h << 16); }
inline float h2f(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0) { float v = (float)m * 5.9604644775390625e-8f; return sign ? -v : v; }
    if (e == 31) return bitsf(sign | 0x7f800000u | (m << 13));
    return bitsf(sign | ((e + 112u) << 23) | (m << 13));
}
inline uint16_t f2h(float f) {
    uint32_t u = fbits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t au = u & 0x7fffffffu;
    if (au > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);
    if (au >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);
    if (au < 0x38800000u) return (uint16_t)(sign | (uint16_t)lrintf(bitsf(au) * 16777216.0f));
    uint32_t v = au - (112u << 23);
    v += 0xfffu + ((v >> 13) & 1u);
    return (uint16_t)(sign | (v >> 13));
}
} // namespace cvemu

struct __half { uint16_t b; };
struct __nv_bfloat16 { uint16_t b; };
struct __half2 { __half x, y; };
struct __nv_bfloat162 { __nv_bfloat16 x, y; };
inline float __half2float(__half h) { return cvemu::h2f(h.b); }
inline __half __float2half_rn(float f) { return __half{cvemu::f2h(f)}; }
inline float __bfloat162float(__nv_bfloat16 h) { return cvemu::bf2f(h.b); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16{cvemu::f2bf(f)}; }
inline float __uint_as_float(unsigned u) { return cvemu::bitsf(u); }
inline __half __ushort_as_half(unsigned short u) { return __half{u}; }
inline __half2 __floats2half2_rn(float a, float b) { return __half2{__float2half_rn(a), __float2half_rn(b)}; }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
    return __nv_bfloat162{__float2bfloat16_rn(a), __float2bfloat16_rn(b)};
}

/* ------------------------------------------------------------ runtime API */

typedef enum cudaError {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorInvalidConfiguration = 9,
    cudaErrorInvalidDeviceFunction = 98,
    cudaErrorNoDevice = 100,
    cudaErrorNoKernelImageForDevice = 209,
    cudaErrorUnsupportedPtxVersion = 222,
    cudaErrorLaunchFailure = 719
} cudaError_t;
typedef enum { cudaMemcpyHostToHost, cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost, cudaMemcpyDeviceToDevice,
               cudaMemcpyDefault } cudaMemcpyKind;
typedef enum { cudaMemoryTypeUnregistered = 0, cudaMemoryTypeHost = 1, cudaMemoryTypeDevice = 2,
               cudaMemoryTypeManaged = 3 } cudaMemoryType;
typedef enum { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 } cudaFuncAttribute;
#define cudaHostAllocMapped 2u
typedef struct cvemu_stream *cudaStream_t;
typedef struct cvemu_event { double t; } *cudaEvent_t;
struct cudaDeviceProp {
    char name[256];
    int major, minor, multiProcessorCount;
    size_t sharedMemPerBlockOptin, totalGlobalMem;
};
struct cudaFuncAttributes { int maxThreadsPerBlock; };
struct cudaPointerAttributes { cudaMemoryType type; int device; void *devicePointer, *hostPointer; };

namespace cvemu {
inline cudaError_t last_error = cudaSuccess;
inline std::map<uintptr_t, size_t> allocs; /* device allocations: base -> bytes */
inline std::map<const void *, int> smem_attr; /* kernel -> max dynamic shared memory */
inline std::mutex mu;                        /* the emulated device runs one call at a time */
inline cudaError_t fail(cudaError_t e) { last_error = e; return e; }
inline double now() { timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts); return ts.tv_sec + 1e-9 * ts.tv_nsec; }
} // namespace cvemu

inline cudaError_t cudaGetLastError() { cudaError_t e = cvemu::last_error; cvemu::last_error = cudaSuccess; return e; }
inline const char *cudaGetErrorString(cudaError_t e) {
    switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    default: return "emulated CUDA error";
    }
}
inline const char *cudaGetErrorName(cudaError_t e) { return e == cudaSuccess ? "cudaSuccess" : "cudaErrorEmulated"; }
inline cudaError_t cudaGetDeviceCount(int *n) { *n = 1; return cudaSuccess; }
inline cudaError_t cudaGetDevice(int *d) { *d = 0; return cudaSuccess; }
inline cudaError_t cudaSetDevice(int d) { return d == 0 ? cudaSuccess : cvemu::fail(cudaErrorInvalidValue); }
inline cudaError_t cudaGetDeviceProperties(cudaDeviceProp *p, int) {
    memset(p, 0, sizeof *p);
    snprintf(p->name, sizeof p->name, "CPU emulator");
    p->major = 9;
    p->minor = 0;
    p->multiProcessorCount = 2; /* small persistent grids */
    p->sharedMemPerBlockOptin = 227 * 1024;
    p->totalGlobalMem = (size_t)16 << 30;
    return cudaSuccess;
}
template <class F> inline cudaError_t cudaFuncGetAttributes(cudaFuncAttributes *a, F) {
    a->maxThreadsPerBlock = 1024;
    return cudaSuccess;
}
inline cudaError_t cudaFuncSetAttribute(const void *f, cudaFuncAttribute, int v) {
    cvemu::smem_attr[f] = v;
    return cudaSuccess;
}
template <class T> inline cudaError_t cudaMalloc(T **p, size_t bytes) {
    void *q = nullptr; /* exact size, so that AddressSanitizer builds catch overruns */
    if (posix_memalign(&q, 256, bytes ? bytes : 1) != 0) return cvemu::fail(cudaErrorMemoryAllocation);
    memset(q, 0xA5, bytes); /* device memory is not zeroed */
    cvemu::allocs[(uintptr_t)q] = bytes;
    *p = (T *)q;
    return cudaSuccess;
}
inline cudaError_t cudaFree(void *p) {
    if (!p) return cudaSuccess;
    auto it = cvemu::allocs.find((uintptr_t)p);
    if (it == cvemu::allocs.end()) return cvemu::fail(cudaErrorInvalidValue);
    cvemu::allocs.erase(it);
    free(p);
    return cudaSuccess;
}
template <class T> inline cudaError_t cudaMallocHost(T **p, size_t bytes) {
    *p = (T *)aligned_alloc(256, (bytes + 255) / 256 * 256);
    return *p ? cudaSuccess : cvemu::fail(cudaErrorMemoryAllocation);
}
template <class T> inline cudaError_t cudaHostAlloc(T **p, size_t bytes, unsigned) { return cudaMallocHost(p, bytes); }
inline cudaError_t cudaFreeHost(void *p) { free(p); return cudaSuccess; }
inline cudaError_t cudaHostGetDevicePointer(void **d, void *h, unsigned) { *d = h; return cudaSuccess; }
inline cudaError_t cudaMemcpyAsync(void *d, const void *s, size_t n, cudaMemcpyKind, cudaStream_t = nullptr) {
    if (n) memmove(d, s, n);
    return cudaSuccess;
}
inline cudaError_t cudaMemcpy(void *d, const void *s, size_t n, cudaMemcpyKind k) { return cudaMemcpyAsync(d, s, n, k); }
inline cudaError_t cudaMemsetAsync(void *d, int v, size_t n, cudaStream_t = nullptr) {
    memset(d, v, n);
    return cudaSuccess;
}
inline cudaError_t cudaStreamCreate(cudaStream_t *s) { *s = (cudaStream_t)new char[1]; return cudaSuccess; }
inline cudaError_t cudaStreamDestroy(cudaStream_t s) { delete[] (char *)s; return cudaSuccess; }
inline cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
inline cudaError_t cudaEventCreate(cudaEvent_t *e) { *e = new cvemu_event{0}; return cudaSuccess; }
inline cudaError_t cudaEventDestroy(cudaEvent_t e) { delete e; return cudaSuccess; }
inline cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t = nullptr) { e->t = cvemu::now(); return cudaSuccess; }
inline cudaError_t cudaEventSynchronize(cudaEvent_t) { return cudaSuccess; }
inline cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t a, cudaEvent_t b) {
    *ms = (float)((b->t - a->t) * 1e3);
    return cudaSuccess;
}
inline cudaError_t cudaMemGetInfo(size_t *f, size_t *t) {
    *f = (size_t)8 << 30;
    *t = (size_t)16 << 30;
    return cudaSuccess;
}
inline cudaError_t cudaPointerGetAttributes(cudaPointerAttributes *a, const void *p) {
    memset(a, 0, sizeof *a);
    auto it = cvemu::allocs.upper_bound((uintptr_t)p);
    if (it != cvemu::allocs.begin()) {
        --it;
        if ((uintptr_t)p < it->first + it->second) a->type = cudaMemoryTypeDevice;
    }
    return cudaSuccess;
}

/* ------------------------------------------------------------------ cuBLAS */

typedef enum { CUBLAS_STATUS_SUCCESS = 0, CUBLAS_STATUS_ALLOC_FAILED = 3, CUBLAS_STATUS_INVALID_VALUE = 7,
               CUBLAS_STATUS_NOT_SUPPORTED = 15 } cublasStatus_t;
typedef enum { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1 } cublasOperation_t;
typedef enum { CUBLAS_DEFAULT_MATH = 0 } cublasMath_t;
typedef enum { CUDA_R_32F = 0, CUDA_R_16F = 2, CUDA_R_16BF = 14 } cudaDataType_t;
typedef enum { CUBLAS_COMPUTE_32F = 68 } cublasComputeType_t;
typedef enum { CUBLAS_GEMM_DEFAULT = -1 } cublasGemmAlgo_t;
typedef struct cvemu_blas *cublasHandle_t;
inline cublasStatus_t cublasCreate(cublasHandle_t *h) { *h = (cublasHandle_t)new char[1]; return CUBLAS_STATUS_SUCCESS; }
inline cublasStatus_t cublasDestroy(cublasHandle_t h) { delete[] (char *)h; return CUBLAS_STATUS_SUCCESS; }
inline cublasStatus_t cublasSetStream(cublasHandle_t, cudaStream_t) { return CUBLAS_STATUS_SUCCESS; }
inline cublasStatus_t cublasSetMathMode(cublasHandle_t, cublasMath_t) { return CUBLAS_STATUS_SUCCESS; }
inline cublasStatus_t cublasSetWorkspace(cublasHandle_t, void *, size_t) { return CUBLAS_STATUS_SUCCESS; }
inline const char *cublasGetStatusString(cublasStatus_t) { return "emulated cuBLAS status"; }

namespace cvemu {
inline float ld(const void *p, cudaDataType_t t, int64_t i) {
    switch (t) {
    case CUDA_R_32F: return ((const float *)p)[i];
    case CUDA_R_16F: return h2f(((const uint16_t *)p)[i]);
    default: return bf2f(((const uint16_t *)p)[i]);
    }
}
/* Column-major C[m][n] = alpha op(A) op(B) + beta C, fp32 accumulation in k order. */
inline cublasStatus_t gemm(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const float *alpha,
                           const void *A, cudaDataType_t at, int lda, const void *B, cudaDataType_t bt, int ldb,
                           const float *beta, float *C, int ldc) {
    if (m < 0 || n < 0 || k < 0 || lda < (ta == CUBLAS_OP_N ? m : k) || ldb < (tb == CUBLAS_OP_N ? k : n) || ldc < m)
        return CUBLAS_STATUS_INVALID_VALUE;
    for (int j = 0; j < n; j++)
        for (int i = 0; i < m; i++) {
            float s = 0.f;
            for (int p = 0; p < k; p++) {
                const float a = ta == CUBLAS_OP_N ? ld(A, at, i + (int64_t)p * lda) : ld(A, at, p + (int64_t)i * lda);
                const float b = tb == CUBLAS_OP_N ? ld(B, bt, p + (int64_t)j * ldb) : ld(B, bt, j + (int64_t)p * ldb);
                s = fmaf(a, b, s);
            }
            float *c = C + i + (int64_t)j * ldc;
            *c = *alpha * s + (*beta != 0.f ? *beta * *c : 0.f);
        }
    return CUBLAS_STATUS_SUCCESS;
}
} // namespace cvemu

inline cublasStatus_t cublasSgemm(cublasHandle_t, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                                  const float *alpha, const float *A, int lda, const float *B, int ldb,
                                  const float *beta, float *C, int ldc) {
    return cvemu::gemm(ta, tb, m, n, k, alpha, A, CUDA_R_32F, lda, B, CUDA_R_32F, ldb, beta, C, ldc);
}
inline cublasStatus_t cublasGemmEx(cublasHandle_t, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                                   const void *alpha, const void *A, cudaDataType_t at, int lda, const void *B,
                                   cudaDataType_t bt, int ldb, const void *beta, void *C, cudaDataType_t ct, int ldc,
                                   cublasComputeType_t, cublasGemmAlgo_t) {
    if (at != bt || ct != CUDA_R_32F) return CUBLAS_STATUS_NOT_SUPPORTED; /* what cuBLAS accepts, for our uses */
    return cvemu::gemm(ta, tb, m, n, k, (const float *)alpha, A, at, lda, B, bt, ldb, (const float *)beta,
                       (float *)C, ldc);
}

/* ------------------------------------------------------------- execution */

namespace cvemu {
enum { RUN = 0, AT_BLOCK = 1, AT_WARP = 2, DONE = 3 };
struct Fiber {
    ucontext_t ctx;
    dim3 tid;
    int lane, warp, state;
};
constexpr size_t STACK = 256 * 1024;
inline std::vector<Fiber> fibers;
inline std::vector<char *> stacks;
inline Fiber *cur = nullptr;
inline ucontext_t sched;
inline void (*body)(void *) = nullptr;
inline void *body_arg = nullptr;
inline dim3 g_grid, g_block, g_bidx;
inline std::vector<unsigned char> dsmem;
inline uint64_t slots[32][32]; /* [warp][lane] shuffle exchange */

inline void *dyn_smem() { return dsmem.data(); }

inline void check_aligned(const void *p, size_t n, const char *file, int line) {
    if ((uintptr_t)p % n) {
        fprintf(stderr, "cvemu: misaligned %zu-byte access at %p (%s:%d)\n", n, p, file, line);
        abort();
    }
}

inline void entry() {
    body(body_arg);
    cur->state = DONE;
    swapcontext(&cur->ctx, &sched);
}

inline void wait(int kind) {
    cur->state = kind;
    swapcontext(&cur->ctx, &sched);
}

/* Runs one block to completion; returns false on a barrier deadlock. */
inline bool run_block(int nthreads) {
    if ((int)fibers.size() < nthreads) fibers.resize(nthreads);
    while ((int)stacks.size() < nthreads) stacks.push_back((char *)malloc(STACK));
    for (int t = 0; t < nthreads; t++) {
        Fiber &f = fibers[t];
        f.tid = dim3(t % g_block.x, (t / g_block.x) % g_block.y, t / (g_block.x * g_block.y));
        f.lane = t % 32;
        f.warp = t / 32;
        f.state = RUN;
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = stacks[t];
        f.ctx.uc_stack.ss_size = STACK;
        f.ctx.uc_link = &sched;
        makecontext(&f.ctx, (void (*)())entry, 0);
    }
    const int nwarps = (nthreads + 31) / 32;
    /* Threads run between barriers in a fresh random order each round, so a
     * missing barrier shows up whichever thread writes first. */
    static std::vector<int> order;
    static uint64_t rng = 0x9E3779B97F4A7C15ull;
    order.resize(nthreads);
    for (int t = 0; t < nthreads; t++) order[t] = t;
    for (;;) {
        bool ran = false;
        for (int i = nthreads - 1; i > 0; i--) {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            std::swap(order[i], order[(int)(rng % (uint64_t)(i + 1))]);
        }
        for (int i = 0; i < nthreads; i++) {
            const int t = order[i];
            if (fibers[t].state != RUN) continue;
            cur = &fibers[t];
            swapcontext(&sched, &cur->ctx);
            ran = true;
        }
        if (ran) continue;
        int live = 0, at_block = 0;
        for (int t = 0; t < nthreads; t++) {
            live += fibers[t].state != DONE;
            at_block += fibers[t].state == AT_BLOCK;
        }
        if (live == 0) return true;
        bool released = false;
        for (int w = 0; w < nwarps; w++) {
            int wl = 0, ww = 0;
            for (int t = w * 32; t < nthreads && t < (w + 1) * 32; t++) {
                wl += fibers[t].state != DONE;
                ww += fibers[t].state == AT_WARP;
            }
            if (wl > 0 && ww == wl) {
                for (int t = w * 32; t < nthreads && t < (w + 1) * 32; t++) fibers[t].state = RUN;
                released = true;
            }
        }
        if (released) continue;
        if (at_block == live) {
            for (int t = 0; t < nthreads; t++)
                if (fibers[t].state == AT_BLOCK) fibers[t].state = RUN;
            continue;
        }
        return false;
    }
}

struct cfg {
    dim3 g, b;
    size_t smem;
    cfg(dim3 g_, dim3 b_, size_t smem_ = 0, cudaStream_t = nullptr) : g(g_), b(b_), smem(smem_) {}
};

template <class Tup, class K> struct invoker {
    static void call(void *p) {
        auto *pr = (std::pair<K, Tup> *)p;
        std::apply(pr->first, pr->second);
    }
};

template <class... P, class... A> inline void launch(void (*k)(P...), cfg c, A &&...a) {
    const long long threads = (long long)c.b.x * c.b.y * c.b.z;
    auto it = smem_attr.find((const void *)k);
    const size_t smax = it != smem_attr.end() ? (size_t)it->second : 48 * 1024;
    if (threads < 1 || threads > 1024 || c.g.x < 1 || c.g.y < 1 || c.g.z < 1 || c.g.y > 65535 || c.g.z > 65535 ||
        c.smem > smax || threads % 32 != 0) {
        fprintf(stderr, "cvemu: bad launch config grid (%u,%u,%u) block (%u,%u,%u) smem %zu (max %zu)\n", c.g.x, c.g.y,
                c.g.z, c.b.x, c.b.y, c.b.z, c.smem, smax);
        last_error = cudaErrorInvalidConfiguration;
        return;
    }
    typedef std::tuple<std::decay_t<P>...> Tup;
    std::pair<void (*)(P...), Tup> pr(k, Tup(std::forward<A>(a)...));
    g_grid = c.g;
    g_block = c.b;
    for (unsigned z = 0; z < c.g.z; z++)
        for (unsigned y = 0; y < c.g.y; y++)
            for (unsigned x = 0; x < c.g.x; x++) {
                g_bidx = dim3(x, y, z);
                dsmem.assign(c.smem ? c.smem : 1, 0xFF); /* NaN bytes: unwritten shared memory shows up */
                body = invoker<Tup, void (*)(P...)>::call;
                body_arg = &pr;
                if (!run_block((int)threads)) {
                    fprintf(stderr, "cvemu: barrier deadlock (divergent __syncthreads/__syncwarp) in block (%u,%u,%u)\n",
                            x, y, z);
                    abort();
                }
            }
}

template <class T> inline T shfl(T v, int src_lane_fn(int, int), int arg) {
    static_assert(sizeof(T) <= 8, "shuffle of a large type");
    uint64_t u = 0;
    memcpy(&u, &v, sizeof(T));
    slots[cur->warp][cur->lane] = u;
    wait(AT_WARP);
    const int src = src_lane_fn(cur->lane, arg);
    T r;
    memcpy(&r, &slots[cur->warp][src], sizeof(T));
    wait(AT_WARP);
    return r;
}
inline int xor_lane(int lane, int o) { return lane ^ o; }
inline int up_lane(int lane, int o) { return lane >= o ? lane - o : lane; }
} // namespace cvemu

#define threadIdx (cvemu::cur->tid)
#define blockIdx (cvemu::g_bidx)
#define blockDim (cvemu::g_block)
#define gridDim (cvemu::g_grid)
inline void __syncthreads() { cvemu::wait(cvemu::AT_BLOCK); }
inline void __syncwarp(unsigned = 0xffffffffu) { cvemu::wait(cvemu::AT_WARP); }
template <class T> inline T __shfl_xor_sync(unsigned, T v, int o) { return cvemu::shfl(v, cvemu::xor_lane, o); }
template <class T> inline T __shfl_up_sync(unsigned, T v, int o) { return cvemu::shfl(v, cvemu::up_lane, o); }

#endif
