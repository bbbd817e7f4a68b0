/* Element-wise kernels of the CUDA backend: RMSNorm, RoPE, SwiGLU, embedding lookup, and the small helpers the
 * GEMM needs (activation narrowing, bias). Each row is computed by one block
 * in a fixed order, so a row's result does not depend on the batch. */
#include <climits>
#include <type_traits>

#include "cuda_internal.h"

/* Blocks for a grid-stride loop over `total` elements. */
static unsigned grid_for(const cv_cuda_ctx *c, int64_t total, int threads) {
    int64_t g = (total + threads - 1) / threads, cap = (int64_t)c->num_sms * 16;
    if (g > cap) g = cap;
    return (unsigned)(g < 1 ? 1 : g);
}

/* ----------------------------------------------------------------- RMSNorm */

/* One block per row: out = x * (1 / sqrt(mean(x^2) + eps)) * w. out may
 * alias x: each element is read and then written by the same thread. */
__global__ void rmsnorm_kernel(float *out, const float *x, const float *w, int dim, float eps) {
    __shared__ float sh[33];
    const int64_t row = blockIdx.x;
    const float *xr = x + row * dim;
    float *orow = out + row * dim;
    float ss = 0.f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        const float v = xr[i];
        ss = fmaf(v, v, ss);
    }
    ss = cvc_block_sum(ss, sh);
    const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) orow[i] = xr[i] * inv * w[i];
}

void cvc_rmsnorm(cv_backend *b, float *out, const float *x, const float *weight, int64_t n, int64_t dim,
                 float eps) {
    cv_cuda_ctx *c = cvc_of(b);
    if (n <= 0) return;
    if (cvc_enter(c) < 0) return;
    if (dim <= 0 || dim > INT_MAX || n > INT_MAX) {
        cvc_fail(c, CV_ERR_INVALID, "CUDA rmsnorm: bad shape n=%lld dim=%lld", (long long)n, (long long)dim);
        return;
    }
    const int threads = dim >= 2048 ? 256 : dim >= 512 ? 128 : 64;
    rmsnorm_kernel<<<(unsigned)n, threads, 0, c->stream>>>(out, x, weight, (int)dim, eps);
    cvc_check_launch(c, "rmsnorm");
}

/* -------------------------------------------------------------------- RoPE */

/* One block per token: the (cos, sin) of its position are computed once into
 * shared memory, then every query and key head is rotated in place. */
__global__ void rope_kernel(float *q, int64_t q_stride, int n_heads, float *k, int64_t k_stride, int n_kv,
                            const int32_t *pos, const float *inv_freq, int head_dim, int pairs) {
    extern __shared__ float cs[]; /* [half][2]: cos, sin */
    const int64_t t = blockIdx.x;
    const int half = head_dim / 2;
    /* Angles in double like the CPU backend: fp32 loses them at long positions.
     * Only head_dim/2 per token, so the cost is small. */
    const double p = (double)pos[t];
    for (int j = threadIdx.x; j < half; j += blockDim.x) {
        double s, co;
        sincos(p * (double)inv_freq[j], &s, &co);
        cs[2 * j] = (float)co;
        cs[2 * j + 1] = (float)s;
    }
    __syncthreads();
    const int total = (n_heads + n_kv) * half;
    for (int e = threadIdx.x; e < total; e += blockDim.x) {
        const int h = e / half, j = e - h * half;
        float *xh = h < n_heads ? q + t * q_stride + (int64_t)h * head_dim
                                : k + t * k_stride + (int64_t)(h - n_heads) * head_dim;
        const int i0 = pairs ? 2 * j : j, i1 = pairs ? 2 * j + 1 : j + half;
        const float co = cs[2 * j], s = cs[2 * j + 1];
        const float a = xh[i0], bb = xh[i1];
        xh[i0] = a * co - bb * s;
        xh[i1] = a * s + bb * co;
    }
}

/* The engine keeps inv_freq in device memory; a host pointer still works
 * (copied each call into a backend buffer). */
static const float *device_freq(cv_cuda_ctx *c, const float *f, int64_t len) {
    if (f == c->freq_checked) return f;
    cudaPointerAttributes at;
    cudaError_t e = cudaPointerGetAttributes(&at, f);
    if (e != cudaSuccess) (void)cudaGetLastError();
    if (e == cudaSuccess && at.type != cudaMemoryTypeUnregistered) {
        c->freq_checked = f;
        return f;
    }
    if (c->freq_len < len) {
        if (c->freq) {
            cudaFree(c->freq);
            c->freq = nullptr;
            c->freq_len = 0;
        }
        if (cvc_check(c, cudaMalloc(&c->freq, (size_t)len * sizeof(float)), "rope (inv_freq copy)") < 0)
            return nullptr;
        c->freq_len = len;
    }
    if (cvc_check(c, cudaMemcpyAsync(c->freq, f, (size_t)len * sizeof(float), cudaMemcpyHostToDevice,
                                     c->stream),
                  "rope (inv_freq copy)") < 0)
        return nullptr;
    return c->freq;
}

void cvc_rope(cv_backend *b, float *q, int64_t q_stride, int64_t n_heads, float *k, int64_t k_stride,
              int64_t n_kv_heads, const int32_t *pos, int64_t n, const cv_rope *rope) {
    cv_cuda_ctx *c = cvc_of(b);
    if (n <= 0) return;
    if (cvc_enter(c) < 0) return;
    if (!rope || !rope->inv_freq || rope->head_dim <= 0 || rope->head_dim % 2 != 0 || rope->head_dim > 8192 ||
        n_heads < 0 || n_kv_heads < 0 || n > INT_MAX || (n_heads > 0 && !q) || (n_kv_heads > 0 && !k) ||
        (n_heads + n_kv_heads) * rope->head_dim > INT_MAX) {
        cvc_fail(c, CV_ERR_INVALID, "CUDA rope: bad arguments (head_dim %lld, heads %lld/%lld)",
                 rope ? (long long)rope->head_dim : -1LL, (long long)n_heads, (long long)n_kv_heads);
        return;
    }
    if (n_heads + n_kv_heads == 0) return;
    const int half = (int)(rope->head_dim / 2);
    const float *f = device_freq(c, rope->inv_freq, half);
    if (!f) return;
    const int threads = 128;
    rope_kernel<<<(unsigned)n, threads, (size_t)half * 2 * sizeof(float), c->stream>>>(
        q, q_stride, (int)n_heads, k, k_stride, (int)n_kv_heads, pos, f, (int)rope->head_dim,
        rope->layout == CV_ROPE_PAIRS);
    cvc_check_launch(c, "rope");
}

/* ------------------------------------------------------------------ SwiGLU */

/* out[t][j] = silu(gu[t][j]) * gu[t][dim + j]; out must not overlap gu. */
__global__ void swiglu_kernel(float *out, const float *gu, int64_t n, int64_t dim) {
    const int64_t total = n * dim;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t t = i / dim, j = i - t * dim;
        const float g = gu[t * 2 * dim + j], u = gu[t * 2 * dim + dim + j];
        out[i] = g / (1.0f + expf(-g)) * u;
    }
}

void cvc_swiglu(cv_backend *b, float *out, const float *gu, int64_t n, int64_t dim) {
    cv_cuda_ctx *c = cvc_of(b);
    if (n <= 0 || dim <= 0) return;
    if (cvc_enter(c) < 0) return;
    swiglu_kernel<<<grid_for(c, n * dim, 256), 256, 0, c->stream>>>(out, gu, n, dim);
    cvc_check_launch(c, "swiglu");
}

/* --------------------------------------------------------------- embedding */

template <typename T>
__global__ void embedding_kernel(float *out, const int32_t *tokens, const T *table, int64_t rows, int64_t cols,
                                 int *flags) {
    const int64_t t = blockIdx.x;
    const int64_t id = tokens[t];
    float *o = out + t * cols;
    if (id < 0 || id >= rows) { /* validated by the caller; never read outside the table */
        if (threadIdx.x == 0) flags[CVC_FLAG_TOKEN] = 1;
        for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) o[i] = 0.f;
        return;
    }
    const T *row = table + id * cols;
    for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) o[i] = cvc_f32(row[i]);
}

void cvc_embedding(cv_backend *b, float *out, const int32_t *tokens, int64_t n, const cv_table *table) {
    cv_cuda_ctx *c = cvc_of(b);
    if (n <= 0) return;
    if (cvc_enter(c) < 0) return;
    if (!table || !table->data || table->cols <= 0 || n > INT_MAX) {
        cvc_fail(c, CV_ERR_INVALID, "CUDA embedding: bad table or too many rows");
        return;
    }
    const int threads = table->cols >= 1024 ? 256 : 128;
    switch (table->dtype) {
    case CV_F32:
        embedding_kernel<float><<<(unsigned)n, threads, 0, c->stream>>>(
            out, tokens, (const float *)table->data, table->rows, table->cols, c->flags_d);
        break;
    case CV_F16:
        embedding_kernel<__half><<<(unsigned)n, threads, 0, c->stream>>>(
            out, tokens, (const __half *)table->data, table->rows, table->cols, c->flags_d);
        break;
    case CV_BF16:
        embedding_kernel<__nv_bfloat16><<<(unsigned)n, threads, 0, c->stream>>>(
            out, tokens, (const __nv_bfloat16 *)table->data, table->rows, table->cols, c->flags_d);
        break;
    default:
        cvc_fail(c, CV_ERR_UNSUPPORTED, "CUDA embedding: table dtype %d is not supported", (int)table->dtype);
        return;
    }
    cvc_check_launch(c, "embedding");
}

/* ------------------------------------------------------- GEMM helpers */

/* fp16 saturates at +-65504 (large activations would otherwise become inf);
 * NaN stays NaN. */
__device__ __forceinline__ float sat16(float x) { return x != x ? x : fminf(fmaxf(x, -65504.f), 65504.f); }

template <typename T>
__global__ void narrow_kernel(T *dst, const float *src, int64_t n, int saturate) {
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += stride) {
        float v = src[i];
        if (saturate) v = sat16(v);
        dst[i] = cvc_from_f32<T>(v);
    }
}

/* Four elements per thread when both pointers allow 16/8-byte accesses. */
template <typename T2>
__global__ void narrow4_kernel(T2 *dst, const float4 *src, int64_t n4, int saturate) {
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n4; i += stride) {
        float4 v = src[i];
        if (saturate) {
            v.x = sat16(v.x);
            v.y = sat16(v.y);
            v.z = sat16(v.z);
            v.w = sat16(v.w);
        }
        T2 lo, hi;
        if constexpr (std::is_same<T2, __half2>::value) {
            lo = __floats2half2_rn(v.x, v.y);
            hi = __floats2half2_rn(v.z, v.w);
        } else {
            lo = __floats2bfloat162_rn(v.x, v.y);
            hi = __floats2bfloat162_rn(v.z, v.w);
        }
        dst[2 * i] = lo;
        dst[2 * i + 1] = hi;
    }
}

int cvc_narrow_to(cv_cuda_ctx *c, void *dst, cv_dtype dt, const float *src, int64_t n, int saturate) {
    if (n <= 0) return 0;
    const int threads = 256;
    const bool vec = n % 4 == 0 && ((uintptr_t)src % 16) == 0 && ((uintptr_t)dst % 8) == 0;
    if (dt == CV_BF16) {
        if (vec)
            narrow4_kernel<__nv_bfloat162><<<grid_for(c, n / 4, threads), threads, 0, c->stream>>>(
                (__nv_bfloat162 *)dst, (const float4 *)src, n / 4, 0);
        else
            narrow_kernel<__nv_bfloat16><<<grid_for(c, n, threads), threads, 0, c->stream>>>(
                (__nv_bfloat16 *)dst, src, n, 0);
    } else if (dt == CV_F16) {
        if (vec)
            narrow4_kernel<__half2><<<grid_for(c, n / 4, threads), threads, 0, c->stream>>>(
                (__half2 *)dst, (const float4 *)src, n / 4, saturate);
        else
            narrow_kernel<__half><<<grid_for(c, n, threads), threads, 0, c->stream>>>((__half *)dst, src, n,
                                                                                      saturate);
    } else {
        cvc_fail(c, CV_ERR_UNSUPPORTED, "CUDA narrow: dtype %d", (int)dt);
        return -1;
    }
    return cvc_check_launch(c, "narrowing to 16 bits");
}

__global__ void bias_kernel(float *out, const float *bias, int64_t n, int64_t rows, int accumulate) {
    const int64_t total = n * rows, stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += stride) {
        const float bv = bias[i % rows];
        out[i] = accumulate ? out[i] + bv : bv;
    }
}

/* ------------------------------------------------------------------ GEMV */

/* One token (decode at batch 1): out[rows] (+)= W[rows][cols] x (+ bias), one
 * warp per row streaming W with 16-byte loads, x in shared memory. x is
 * rounded to W's type first, like the cuBLAS path for more tokens, so a row
 * computes the same products whatever the batch size. */
#define GEMV_WARPS 8
template <typename T>
__global__ void __launch_bounds__(GEMV_WARPS * 32)
    gemv_kernel(float *out, const float *x, const T *w, const float *bias, int rows, int cols, int accumulate) {
    extern __shared__ __align__(16) float xs[]; /* [cols] */
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        float v = x[i];
        if constexpr (std::is_same<T, __half>::value) v = cvc_f32(cvc_from_f32<T>(sat16(v)));
        else if constexpr (std::is_same<T, __nv_bfloat16>::value) v = cvc_f32(cvc_from_f32<T>(v));
        xs[i] = v;
    }
    __syncthreads();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int row = blockIdx.x * GEMV_WARPS + warp;
    if (row >= rows) return; /* whole warps: no barrier follows */
    constexpr int VEC = 16 / (int)sizeof(T);
    const T *wr = w + (int64_t)row * cols;
    float acc = 0.f;
#pragma unroll 4
    for (int c0 = lane * VEC; c0 < cols; c0 += 32 * VEC) {
        float wv[VEC];
        cvc_load_vec<T, VEC>(wv, wr + c0);
        CVC_ALIGNED(xs + c0, 16);
#pragma unroll
        for (int e = 0; e < VEC; e += 4) {
            const float4 x4 = *reinterpret_cast<const float4 *>(xs + c0 + e);
            acc = fmaf(wv[e], x4.x, acc);
            acc = fmaf(wv[e + 1], x4.y, acc);
            acc = fmaf(wv[e + 2], x4.z, acc);
            acc = fmaf(wv[e + 3], x4.w, acc);
        }
    }
    acc = cvc_warp_sum(acc);
    if (lane == 0) {
        if (bias) acc += bias[row];
        if (accumulate) acc += out[row];
        out[row] = acc;
    }
}

int cvc_gemv(cv_cuda_ctx *c, float *out, const float *x, const cv_matrix *w, const float *bias, int accumulate) {
    const int64_t rows = w->rows, cols = w->cols;
    const int vec = w->dtype == CV_F32 ? 4 : 8;
    if (!c->use_gemv || cols % vec != 0 || cols * 4 > 48 * 1024 || rows > INT_MAX ||
        ((uintptr_t)w->data % 16) != 0)
        return 0;
    const unsigned grid = (unsigned)((rows + GEMV_WARPS - 1) / GEMV_WARPS);
    const size_t smem = (size_t)cols * 4;
    switch (w->dtype) {
    case CV_F32:
        gemv_kernel<float><<<grid, GEMV_WARPS * 32, smem, c->stream>>>(out, x, (const float *)w->data, bias,
                                                                        (int)rows, (int)cols, accumulate);
        break;
    case CV_F16:
        gemv_kernel<__half><<<grid, GEMV_WARPS * 32, smem, c->stream>>>(out, x, (const __half *)w->data, bias,
                                                                         (int)rows, (int)cols, accumulate);
        break;
    case CV_BF16:
        gemv_kernel<__nv_bfloat16><<<grid, GEMV_WARPS * 32, smem, c->stream>>>(
            out, x, (const __nv_bfloat16 *)w->data, bias, (int)rows, (int)cols, accumulate);
        break;
    default:
        return 0;
    }
    return cvc_check_launch(c, "gemm (gemv)") < 0 ? -1 : 1;
}

int cvc_bias(cv_cuda_ctx *c, float *out, const float *bias, int64_t n, int64_t rows, int accumulate) {
    if (n <= 0 || rows <= 0) return 0;
    bias_kernel<<<grid_for(c, n * rows, 256), 256, 0, c->stream>>>(out, bias, n, rows, accumulate);
    return cvc_check_launch(c, "gemm (bias)");
}
