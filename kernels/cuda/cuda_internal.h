/* Private declarations shared by the .cu files of the CUDA backend (C++17). */
#ifndef CV_CUDA_INTERNAL_H
#define CV_CUDA_INTERNAL_H

#include <cmath>
#include <cstddef>
#include <cstdint>

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "cv_cuda.h"

#define CV_CU_EXPORT extern "C" __attribute__((visibility("default")))

/* Flags a kernel raises (stores 1 into flags[CVC_FLAG_*], a pinned mapped
 * host array, so no atomics and no copy are needed) when its inputs are bad;
 * the host turns them into a recorded error at the next sync. Kernels never
 * read or write out of bounds because of bad indices: they skip or clamp. */
enum {
    CVC_FLAG_BLOCK = 0,  /* block id outside [0, num_blocks) */
    CVC_FLAG_MAXCTX,     /* a context longer than batch.max_context_len */
    CVC_FLAG_TABLE,      /* a context longer than max_blocks_per_seq * block_size */
    CVC_FLAG_SLOT,       /* kv_write slot >= num_blocks * block_size */
    CVC_FLAG_TOKEN,      /* embedding row outside the table */
    CVC_FLAG_QUERY,      /* query_start decreasing, or more new tokens than context */
    CVC_NFLAGS
};

/* Backend private state (b->ctx). One stream; every call runs on it. */
struct cv_cuda_ctx {
    int device;
    int num_sms;
    int cc_major, cc_minor;
    size_t smem_optin;          /* max dynamic shared memory per block */
    char name[160];

    cudaStream_t stream;
    cublasHandle_t blas;
    void *blas_ws;              /* cuBLAS workspace */
    size_t blas_ws_bytes;

    void *act;                  /* [act_elems] 16-bit activations for 16-bit GEMMs */
    size_t act_elems;
    float *part;                /* [part_floats] split-context attention partials */
    size_t part_floats;
    float *freq;                /* [freq_len] device copy of a host inv_freq */
    int64_t freq_len;
    const void *freq_checked;   /* last inv_freq pointer known to be device memory */

    void *stage;                /* pinned host staging for uploads */
    size_t stage_bytes;

    int use_gemv;               /* own kernel for one-token GEMMs (CONVEYOR_CUDA_GEMV != "0") */
    int *flags_h;               /* [CVC_NFLAGS] pinned, mapped; kernels store 1 on bad input */
    int *flags_d;               /* device alias of flags_h */

    int err_code;               /* first recorded error (0: none) */
    char err_msg[CV_ERR_MSG_LEN];
};

static inline cv_cuda_ctx *cvc_of(cv_backend *b) { return (cv_cuda_ctx *)b->ctx; }

/* Error recording (backend.cu). cvc_fail keeps only the first error. */
void cvc_fail(cv_cuda_ctx *c, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* 0 if e == cudaSuccess, else records "what: <CUDA error>" and returns -1. */
int cvc_check(cv_cuda_ctx *c, cudaError_t e, const char *what);
/* Checks the launch just made (cudaGetLastError). */
int cvc_check_launch(cv_cuda_ctx *c, const char *what);
/* Makes the backend's device current in this thread (0 ok, -1 recorded). */
int cvc_enter(cv_cuda_ctx *c);
/* After a stream sync: turns raised kernel flags into a recorded error and
 * lowers them. */
void cvc_collect_flags(cv_cuda_ctx *c);

/* Device helpers: widen one element to float, narrow with round-to-nearest-even. */
__device__ __forceinline__ float cvc_f32(float x) { return x; }
__device__ __forceinline__ float cvc_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float cvc_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T cvc_from_f32(float x);
template <> __device__ __forceinline__ float cvc_from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __half cvc_from_f32<__half>(float x) {
    return __float2half_rn(x);
}
template <> __device__ __forceinline__ __nv_bfloat16 cvc_from_f32<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

/* Vector accesses (float4, uint4) must be aligned on a GPU, where a
 * misaligned one kills the context; the CPU emulator checks them. */
#ifdef CV_CUDA_EMU_H
#define CVC_ALIGNED(p, n) cvemu::check_aligned((const void *)(p), (n), __FILE__, __LINE__)
#else
#define CVC_ALIGNED(p, n) ((void)0)
#endif

/* Widens the elements packed in one 32-bit word (little-endian: element 0 in
 * the low bits), without taking addresses (which would force local memory). */
__device__ __forceinline__ void cvc_widen_word(unsigned u, float *o, float) { o[0] = __uint_as_float(u); }
__device__ __forceinline__ void cvc_widen_word(unsigned u, float *o, __nv_bfloat16) {
    o[0] = __uint_as_float(u << 16);
    o[1] = __uint_as_float(u & 0xffff0000u);
}
__device__ __forceinline__ void cvc_widen_word(unsigned u, float *o, __half) {
    o[0] = __half2float(__ushort_as_half((unsigned short)(u & 0xffffu)));
    o[1] = __half2float(__ushort_as_half((unsigned short)(u >> 16)));
}

/* Widens VEC consecutive elements at p (aligned to VEC elements) with the
 * widest loads that allow (16 bytes at most per load). */
template <typename T, int VEC>
__device__ __forceinline__ void cvc_load_vec(float (&o)[VEC], const T *p) {
    constexpr int B = VEC * (int)sizeof(T);
    if constexpr (VEC == 1) {
        o[0] = cvc_f32(p[0]);
    } else if constexpr (B > 16) {
        constexpr int PER = 16 / (int)sizeof(T);
#pragma unroll
        for (int i = 0; i < VEC / PER; i++) {
            float t[PER];
            cvc_load_vec<T, PER>(t, p + i * PER);
#pragma unroll
            for (int e = 0; e < PER; e++) o[i * PER + e] = t[e];
        }
    } else {
        static_assert(B == 16 || B == 8 || B == 4, "vector loads of 4, 8 or 16 bytes");
        constexpr int NW = B / 4, PERW = 4 / (int)sizeof(T);
        CVC_ALIGNED(p, B);
        unsigned w[NW];
        if constexpr (B == 16) {
            const uint4 r = *reinterpret_cast<const uint4 *>(p);
            w[0] = r.x;
            w[1] = r.y;
            w[2] = r.z;
            w[3] = r.w;
        } else if constexpr (B == 8) {
            const uint2 r = *reinterpret_cast<const uint2 *>(p);
            w[0] = r.x;
            w[1] = r.y;
        } else {
            w[0] = *reinterpret_cast<const unsigned *>(p);
        }
#pragma unroll
        for (int i = 0; i < NW; i++) cvc_widen_word(w[i], &o[i * PERW], T());
    }
}

/* Warp reductions (all 32 lanes take part). */
__device__ __forceinline__ float cvc_warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float cvc_warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
/* Sum over the block (blockDim.x a multiple of 32, <= 1024); every thread
 * gets the total. Must be reached by all threads; sh holds 33 floats. */
__device__ __forceinline__ float cvc_block_sum(float v, float *sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = cvc_warp_sum(v);
    __syncthreads(); /* sh may still be read by a previous call */
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    float t = 0.f;
    for (int i = 0; i < nw; i++) t += sh[i]; /* fixed order: deterministic */
    return t;
}
__device__ __forceinline__ float cvc_block_max(float v, float *sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = cvc_warp_max(v);
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    float t = -INFINITY;
    for (int i = 0; i < nw; i++) t = fmaxf(t, sh[i]);
    return t;
}

/* Kernels of the table (elementwise.cu). */
void cvc_rmsnorm(cv_backend *b, float *out, const float *x, const float *weight, int64_t n,
                 int64_t dim, float eps);
void cvc_rope(cv_backend *b, float *q, int64_t q_stride, int64_t n_heads, float *k,
              int64_t k_stride, int64_t n_kv_heads, const int32_t *pos, int64_t n,
              const cv_rope *rope);
void cvc_swiglu(cv_backend *b, float *out, const float *gu, int64_t n, int64_t dim);
/* LoRA over segments of rows: a shrink then an expand per segment (lora.cu). */
void cvc_lora_sgmv(cv_backend *b, float *y, int64_t y_stride, const float *x, int64_t x_stride,
                   const cv_lora_segment *segs, int64_t n_segs, int64_t in, float *tmp);
void cvc_embedding(cv_backend *b, float *out, const int32_t *tokens, int64_t n,
                   const cv_table *table);
/* dst[n] (F16 or BF16) = src[n], round to nearest even; with saturate, F16
 * clamps at +-65504 instead of overflowing to inf (activations). */
int cvc_narrow_to(cv_cuda_ctx *c, void *dst, cv_dtype dt, const float *src, int64_t n, int saturate);
/* out[rows] (+)= W x (+ bias) for one token without cuBLAS: 1 done, 0 not
 * applicable (shape, alignment, or CONVEYOR_CUDA_GEMV=0), -1 error recorded. */
int cvc_gemv(cv_cuda_ctx *c, float *out, const float *x, const cv_matrix *w, const float *bias, int accumulate);
/* out[n][rows] = bias (accumulate = 0) or out += bias (accumulate = 1). */
int cvc_bias(cv_cuda_ctx *c, float *out, const float *bias, int64_t n, int64_t rows,
             int accumulate);

/* Attention (attention.cu). */
void cvc_kv_write(cv_backend *b, cv_kv_layer *cache, const float *k, int64_t k_stride,
                  const float *v, int64_t v_stride, const int64_t *slot_mapping, int64_t n);
void cvc_paged_attention(cv_backend *b, float *out, const float *q, int64_t q_stride,
                         const cv_kv_layer *cache, const cv_attn_batch *batch);
/* Per-device kernel attributes (dynamic shared memory opt-in); 0 ok. */
int cvc_attention_setup(cv_cuda_ctx *c, cv_err *err);

#endif
