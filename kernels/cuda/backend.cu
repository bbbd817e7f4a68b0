/* The CUDA backend: lifetime, memory, weight upload, GEMM through cuBLAS,
 * error recording, and the entry points of _conveyor_cuda.so.
 *
 * Weights keep the row-major layout W[rows][cols] they arrive in. cuBLAS is
 * column-major, where that buffer reads as W^T ([cols][rows], ld = cols), x
 * [n][cols] as [cols][n] (ld = cols) and out [n][rows] as [rows][n] (ld =
 * rows); so out = x W^T is the column-major out = op(W^T) x with op = T:
 * gemm(T, N, m = rows, n = n, k = cols). */
#include <climits>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "cuda_internal.h"
#include "../../base/quant_format.h"

/* Fixed scratch sizes, allocated once at creation so the engine's memory
 * sizing (mem_info after the model loads) already accounts for them. */
#define CVC_BLAS_WS_BYTES ((size_t)32 << 20)
#define CVC_ACT_ELEMS ((size_t)16 << 20)     /* 32 MiB of 16-bit activations */
#define CVC_PART_FLOATS ((size_t)8 << 20)    /* 32 MiB of attention partials */
#define CVC_STAGE_BYTES ((size_t)16 << 20)   /* pinned upload staging */

/* ------------------------------------------------------------------ errors */

static int set_err(cv_err *err, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int set_err(cv_err *err, int code, const char *fmt, ...) {
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err->msg, sizeof err->msg, fmt, ap);
        va_end(ap);
        err->code = code;
    }
    return code;
}

void cvc_fail(cv_cuda_ctx *c, int code, const char *fmt, ...) {
    if (c->err_code != 0) return; /* keep the first error: later ones are often consequences */
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->err_msg, sizeof c->err_msg, fmt, ap);
    va_end(ap);
    c->err_code = code;
}

static int code_of(cudaError_t e) {
    switch (e) {
    case cudaErrorMemoryAllocation: return CV_ERR_NOMEM;
    case cudaErrorNoKernelImageForDevice:
    case cudaErrorInvalidDeviceFunction:
    case cudaErrorUnsupportedPtxVersion: return CV_ERR_UNSUPPORTED;
    case cudaErrorInvalidValue:
    case cudaErrorInvalidConfiguration: return CV_ERR_INVALID;
    default: return CV_ERR_IO;
    }
}

int cvc_check(cv_cuda_ctx *c, cudaError_t e, const char *what) {
    if (e == cudaSuccess) return 0;
    (void)cudaGetLastError(); /* reset the runtime's last error so a later launch check does not re-report it */
    cvc_fail(c, code_of(e), "CUDA error in %s: %s (%s)", what, cudaGetErrorString(e),
             cudaGetErrorName(e));
    return -1;
}

int cvc_check_launch(cv_cuda_ctx *c, const char *what) {
    return cvc_check(c, cudaGetLastError(), what);
}

static int blas_check(cv_cuda_ctx *c, cublasStatus_t s, const char *what) {
    if (s == CUBLAS_STATUS_SUCCESS) return 0;
    cvc_fail(c, s == CUBLAS_STATUS_ALLOC_FAILED ? CV_ERR_NOMEM : CV_ERR_IO,
             "cuBLAS error in %s: %s (%d)", what, cublasGetStatusString(s), (int)s);
    return -1;
}

int cvc_enter(cv_cuda_ctx *c) {
    int cur = -1;
    if (cudaGetDevice(&cur) == cudaSuccess && cur == c->device) return 0;
    return cvc_check(c, cudaSetDevice(c->device), "cudaSetDevice");
}

void cvc_collect_flags(cv_cuda_ctx *c) {
    static const char *what[CVC_NFLAGS] = {
        "a block table holds a block id outside the cache",
        "a context is longer than cv_attn_batch.max_context_len",
        "a context is longer than max_blocks_per_seq * block_size",
        "kv_write got a slot outside the cache",
        "embedding got a row index outside the table",
        "query_start is not increasing or a sequence has more new tokens than context",
    };
    volatile int *f = c->flags_h;
    if (!f) return;
    for (int i = 0; i < CVC_NFLAGS; i++) {
        if (f[i]) {
            cvc_fail(c, CV_ERR_INVALID, "CUDA backend: %s (the kernel skipped or clamped it)", what[i]);
            f[i] = 0;
        }
    }
}

/* ------------------------------------------------------ host conversions */

static float h_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static uint16_t h_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

static float h_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
    if (exp == 0) {
        float v = (float)man * 5.9604644775390625e-8f; /* man * 2^-24, zero or subnormal */
        return sign ? -v : v;
    }
    if (exp == 31) u = sign | 0x7f800000u | (man << 13);
    else u = sign | ((exp + 112u) << 23) | (man << 13);
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static uint16_t h_f32_to_f16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t au = u & 0x7fffffffu;
    if (au > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);  /* NaN */
    if (au >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds past 65504: inf */
    if (au < 0x38800000u) {                                    /* below 2^-14: subnormal or zero */
        float a;
        memcpy(&a, &au, 4);
        return (uint16_t)(sign | (uint16_t)lrintf(a * 16777216.0f)); /* exact scaling, RNE */
    }
    uint32_t v = au - (112u << 23); /* rebias the exponent from 127 to 15 */
    v += 0xfffu + ((v >> 13) & 1u);  /* round the mantissa to 10 bits, nearest even */
    return (uint16_t)(sign | (v >> 13));
}

static float h_widen(const void *src, cv_dtype st, size_t i) {
    switch (st) {
    case CV_F32: return ((const float *)src)[i];
    case CV_F64: return (float)((const double *)src)[i];
    case CV_F16: return h_f16_to_f32(((const uint16_t *)src)[i]);
    case CV_BF16: return h_bf16_to_f32(((const uint16_t *)src)[i]);
    default: return 0.f;
    }
}

static size_t esize(cv_dtype t) {
    switch (t) {
    case CV_F32: return 4;
    case CV_F16:
    case CV_BF16: return 2;
    case CV_F64: return 8;
    default: return 0;
    }
}

/* Copies count elements of host src (dtype st) into device dst as dtype dt,
 * converting on the host through the pinned staging buffer. */
static int upload(cv_cuda_ctx *c, void *dst, cv_dtype dt, const void *src, cv_dtype st, size_t count,
                  cv_err *err) {
    const size_t de = esize(dt);
    cudaError_t e;
    if (count == 0) return CV_OK;
    if (st == dt) {
        e = cudaMemcpyAsync(dst, src, count * de, cudaMemcpyHostToDevice, c->stream);
        if (e == cudaSuccess) e = cudaStreamSynchronize(c->stream);
        if (e != cudaSuccess) {
            (void)cudaGetLastError();
            return set_err(err, code_of(e), "CUDA upload of %zu bytes failed: %s", count * de,
                           cudaGetErrorString(e));
        }
        return CV_OK;
    }
    if (!c->stage) {
        e = cudaMallocHost(&c->stage, CVC_STAGE_BYTES);
        if (e != cudaSuccess) {
            (void)cudaGetLastError();
            c->stage = NULL;
            return set_err(err, CV_ERR_NOMEM, "cannot allocate %zu bytes of pinned host memory: %s",
                           (size_t)CVC_STAGE_BYTES, cudaGetErrorString(e));
        }
        c->stage_bytes = CVC_STAGE_BYTES;
    }
    if (st == CV_F32 && dt != CV_F32 && c->act) {
        /* fp32 -> 16-bit on the device: stage fp32 chunks through pinned memory
         * into the activation buffer, narrow them there (round to nearest even,
         * no saturation, as the CPU does). */
        size_t per = c->stage_bytes / 4, act_floats = c->act_elems * 2 / 4;
        if (per > act_floats) per = act_floats;
        for (size_t i0 = 0; i0 < count; i0 += per) {
            const size_t m = count - i0 < per ? count - i0 : per;
            memcpy(c->stage, (const float *)src + i0, m * 4);
            e = cudaMemcpyAsync(c->act, c->stage, m * 4, cudaMemcpyHostToDevice, c->stream);
            if (e == cudaSuccess && cvc_narrow_to(c, (char *)dst + i0 * de, dt, (const float *)c->act, (int64_t)m, 0) < 0)
                e = cudaErrorLaunchFailure;
            if (e == cudaSuccess) e = cudaStreamSynchronize(c->stream); /* the stage is reused next */
            if (e != cudaSuccess) {
                (void)cudaGetLastError();
                return set_err(err, code_of(e), "CUDA upload of %zu values failed: %s", m,
                               c->err_code ? c->err_msg : cudaGetErrorString(e));
            }
        }
        return CV_OK;
    }
    const size_t per = c->stage_bytes / de;
    for (size_t i0 = 0; i0 < count; i0 += per) {
        const size_t m = count - i0 < per ? count - i0 : per;
        if (dt == CV_F32) {
            float *o = (float *)c->stage;
            for (size_t i = 0; i < m; i++) o[i] = h_widen(src, st, i0 + i);
        } else {
            uint16_t *o = (uint16_t *)c->stage;
            if (dt == CV_BF16)
                for (size_t i = 0; i < m; i++) o[i] = h_f32_to_bf16(h_widen(src, st, i0 + i));
            else
                for (size_t i = 0; i < m; i++) o[i] = h_f32_to_f16(h_widen(src, st, i0 + i));
        }
        e = cudaMemcpyAsync((char *)dst + i0 * de, c->stage, m * de, cudaMemcpyHostToDevice, c->stream);
        if (e == cudaSuccess) e = cudaStreamSynchronize(c->stream); /* the stage is reused next */
        if (e != cudaSuccess) {
            (void)cudaGetLastError();
            return set_err(err, code_of(e), "CUDA upload of %zu bytes failed: %s", m * de,
                           cudaGetErrorString(e));
        }
    }
    return CV_OK;
}

static int prepare_2d(cv_backend *b, void **data, size_t *bytes_out, const void *src,
                      cv_dtype src_dtype, int64_t rows, int64_t cols, cv_dtype dtype,
                      const char *what, cv_err *err);

/* Block-quantized weights (GGUF Q8_0/Q4_0/Q4_1, Q5_0/Q5_1, the K-quants and
 * the CPU's repackings of them) are dequantized on the host at
 * load and kept in bfloat16 (a quantized target dtype means bfloat16 here):
 * the CUDA kernels read 16-bit weights only. */
static int prepare_quantized(cv_backend *b, void **data, size_t *bytes_out, const void *src,
                             cv_dtype src_dtype, int64_t rows, int64_t cols, cv_dtype dtype,
                             const char *what, cv_err *err) {
    if (cv_dtype_is_quant(dtype)) dtype = CV_BF16;
    if (!cv_dtype_is_quant(src_dtype))
        return prepare_2d(b, data, bytes_out, src, src_dtype, rows, cols, dtype, what, err);
    if (!src || rows <= 0 || cols <= 0 || cols % CV_QK != 0 || rows > INT_MAX || cols > INT_MAX)
        return set_err(err, CV_ERR_INVALID, "CUDA %s: bad %s shape [%lld][%lld] (cols a multiple of %d)", what,
                       cv_dtype_name(src_dtype), (long long)rows, (long long)cols, CV_QK);
    const size_t count = (size_t)rows * (size_t)cols;
    float *host = (float *)malloc(count * sizeof(float));
    if (!host) return set_err(err, CV_ERR_NOMEM, "CUDA %s: out of host memory dequantizing [%lld][%lld]", what,
                              (long long)rows, (long long)cols);
    cv_dequantize(host, src, src_dtype, count);
    int rc = prepare_2d(b, data, bytes_out, host, CV_F32, rows, cols, dtype, what, err);
    free(host);
    return rc;
}

/* Shared by matrix_prepare and table_prepare: both keep row-major [rows][cols]. */
static int prepare_2d(cv_backend *b, void **data, size_t *bytes_out, const void *src,
                      cv_dtype src_dtype, int64_t rows, int64_t cols, cv_dtype dtype,
                      const char *what, cv_err *err) {
    cv_cuda_ctx *c = cvc_of(b);
    *data = NULL;
    *bytes_out = 0;
    if (dtype != CV_F32 && dtype != CV_F16 && dtype != CV_BF16)
        return set_err(err, CV_ERR_UNSUPPORTED, "CUDA %s: dtype %s is not supported (float32, float16, bfloat16)",
                       what, cv_dtype_name(dtype));
    if (src_dtype != CV_F32 && src_dtype != CV_F16 && src_dtype != CV_BF16 && src_dtype != CV_F64)
        return set_err(err, CV_ERR_UNSUPPORTED, "CUDA %s: source dtype %s is not supported", what,
                       cv_dtype_name(src_dtype));
    if (rows <= 0 || cols <= 0 || rows > INT_MAX || cols > INT_MAX)
        return set_err(err, CV_ERR_INVALID, "CUDA %s: bad shape [%lld][%lld]", what, (long long)rows,
                       (long long)cols);
    if (!src) return set_err(err, CV_ERR_INVALID, "CUDA %s: no source data", what);
    if (cvc_enter(c) < 0) return set_err(err, c->err_code, "%s", c->err_msg);
    size_t count = (size_t)rows * (size_t)cols, bytes = count * esize(dtype);
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, bytes);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return set_err(err, CV_ERR_NOMEM, "CUDA %s: out of device memory for [%lld][%lld] %s (%zu bytes): %s",
                       what, (long long)rows, (long long)cols, cv_dtype_name(dtype), bytes, cudaGetErrorString(e));
    }
    int rc = upload(c, p, dtype, src, src_dtype, count, err);
    if (rc != CV_OK) {
        cudaFree(p);
        return rc;
    }
    *data = p;
    *bytes_out = bytes;
    return CV_OK;
}

static int cvc_matrix_prepare(cv_backend *b, cv_matrix *out, const void *src, cv_dtype src_dtype,
                              int64_t rows, int64_t cols, cv_dtype dtype, cv_err *err) {
    memset(out, 0, sizeof *out);
    int rc = prepare_quantized(b, &out->data, &out->bytes, src, src_dtype, rows, cols, dtype, "matrix_prepare", err);
    if (rc != CV_OK) return rc;
    out->dtype = cv_dtype_is_quant(dtype) ? CV_BF16 : dtype;
    out->rows = rows;
    out->cols = cols;
    return CV_OK;
}

static void cvc_matrix_free(cv_backend *b, cv_matrix *m) {
    if (!m || !m->data) return;
    cvc_enter(cvc_of(b));
    cvc_check(cvc_of(b), cudaFree(m->data), "matrix_free");
    m->data = NULL;
    m->bytes = 0;
}

static int cvc_table_prepare(cv_backend *b, cv_table *out, const void *src, cv_dtype src_dtype,
                             int64_t rows, int64_t cols, cv_dtype dtype, cv_err *err) {
    memset(out, 0, sizeof *out);
    int rc = prepare_quantized(b, &out->data, &out->bytes, src, src_dtype, rows, cols, dtype, "table_prepare", err);
    if (rc != CV_OK) return rc;
    out->dtype = cv_dtype_is_quant(dtype) ? CV_BF16 : dtype;
    out->rows = rows;
    out->cols = cols;
    return CV_OK;
}

static void cvc_table_free(cv_backend *b, cv_table *t) {
    if (!t || !t->data) return;
    cvc_enter(cvc_of(b));
    cvc_check(cvc_of(b), cudaFree(t->data), "table_free");
    t->data = NULL;
    t->bytes = 0;
}

/* ------------------------------------------------------------------ memory */

/* A failed allocation returns NULL and is NOT recorded: the caller reports it
 * (the engine may retry with a smaller KV cache). */
static void *cvc_alloc(cv_backend *b, size_t bytes) {
    cv_cuda_ctx *c = cvc_of(b);
    void *p = NULL;
    if (cvc_enter(c) < 0) return NULL;
    if (cudaMalloc(&p, bytes ? bytes : 1) != cudaSuccess) {
        (void)cudaGetLastError();
        return NULL;
    }
    if (bytes && cvc_check(c, cudaMemsetAsync(p, 0, bytes, c->stream), "alloc (memset)") < 0) {
        cudaFree(p);
        return NULL;
    }
    return p;
}

static void cvc_free(cv_backend *b, void *p) {
    if (!p) return;
    cv_cuda_ctx *c = cvc_of(b);
    cvc_enter(c);
    cvc_check(c, cudaFree(p), "free");
}

/* Pageable sources are staged by the driver before the call returns, so the
 * caller may reuse src at once; the copy is ordered with the kernels. */
static void cvc_to_device(cv_backend *b, void *dst, const void *src, size_t bytes) {
    cv_cuda_ctx *c = cvc_of(b);
    if (bytes == 0 || cvc_enter(c) < 0) return;
    cvc_check(c, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, c->stream), "to_device");
}

static void cvc_to_host(cv_backend *b, void *dst, const void *src, size_t bytes) {
    cv_cuda_ctx *c = cvc_of(b);
    if (bytes == 0 || cvc_enter(c) < 0) return;
    if (cvc_check(c, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, c->stream), "to_host") < 0)
        return;
    if (cvc_check(c, cudaStreamSynchronize(c->stream), "to_host (sync)") == 0) cvc_collect_flags(c);
}

static void cvc_sync(cv_backend *b) {
    cv_cuda_ctx *c = cvc_of(b);
    if (cvc_enter(c) < 0) return;
    if (cvc_check(c, cudaStreamSynchronize(c->stream), "sync") == 0) cvc_collect_flags(c);
}

static int cvc_mem_info(cv_backend *b, size_t *free_bytes, size_t *total_bytes) {
    cv_cuda_ctx *c = cvc_of(b);
    size_t f = 0, t = 0;
    if (cvc_enter(c) < 0) return c->err_code;
    cudaError_t e = cudaMemGetInfo(&f, &t);
    if (e != cudaSuccess) {
        cvc_check(c, e, "cudaMemGetInfo");
        return c->err_code ? c->err_code : CV_ERR_IO;
    }
    if (free_bytes) *free_bytes = f;
    if (total_bytes) *total_bytes = t;
    return CV_OK;
}

/* -------------------------------------------------------------------- GEMM */

static void cvc_gemm(cv_backend *b, float *out, const float *x, int64_t n, const cv_matrix *w,
                     const float *bias, int accumulate) {
    cv_cuda_ctx *c = cvc_of(b);
    if (n <= 0) return;
    if (cvc_enter(c) < 0) return;
    if (!w || !w->data || w->rows <= 0 || w->cols <= 0 || w->rows > INT_MAX || w->cols > INT_MAX) {
        cvc_fail(c, CV_ERR_INVALID, "CUDA gemm: matrix not prepared or too large");
        return;
    }
    if (n == 1) { /* decode at batch 1: one fused launch, bias and accumulate included */
        const int r = cvc_gemv(c, out, x, w, bias, accumulate);
        if (r != 0) return;
    }
    const int rows = (int)w->rows, cols = (int)w->cols;
    float beta = accumulate ? 1.f : 0.f;
    const float alpha = 1.f;
    if (bias) { /* out = bias (or out += bias), then the GEMM accumulates onto it */
        if (cvc_bias(c, out, bias, n, rows, accumulate) < 0) return;
        beta = 1.f;
    }
    if (w->dtype == CV_F32) {
        /* Plain fp32 (no TF32: the handle keeps CUBLAS_DEFAULT_MATH). */
        for (int64_t i0 = 0; i0 < n; i0 += INT_MAX) {
            const int m = (int)(n - i0 < INT_MAX ? n - i0 : INT_MAX);
            if (blas_check(c, cublasSgemm(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, rows, m, cols, &alpha,
                                          (const float *)w->data, cols, x + i0 * cols, cols, &beta,
                                          out + i0 * rows, rows),
                           "cublasSgemm") < 0)
                return;
        }
        return;
    }
    if (w->dtype != CV_BF16 && w->dtype != CV_F16) {
        cvc_fail(c, CV_ERR_UNSUPPORTED, "CUDA gemm: weight dtype %s is not supported", cv_dtype_name(w->dtype));
        return;
    }
    /* 16-bit weights: the activations are narrowed to the weights' type in
     * chunks of rows (cuBLAS wants A and B of one type), fp32 accumulation
     * and fp32 output. */
    const cudaDataType_t t16 = w->dtype == CV_BF16 ? CUDA_R_16BF : CUDA_R_16F;
    if ((size_t)cols > c->act_elems) {
        cvc_fail(c, CV_ERR_UNSUPPORTED, "CUDA gemm: %d input features exceed the activation buffer", cols);
        return;
    }
    const int64_t per = (int64_t)(c->act_elems / (size_t)cols);
    for (int64_t i0 = 0; i0 < n; i0 += per) {
        const int64_t m = n - i0 < per ? n - i0 : per;
        if (cvc_narrow_to(c, c->act, w->dtype, x + i0 * cols, m * cols, 1) < 0) return;
        if (blas_check(c, cublasGemmEx(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, rows, (int)m, cols, &alpha,
                                       w->data, t16, cols, c->act, t16, cols, &beta, out + i0 * rows,
                                       CUDA_R_32F, rows, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                       "cublasGemmEx") < 0)
            return;
    }
}

/* ---------------------------------------------------------------- lifetime */

__global__ void cvc_probe_kernel(int *p) {
    if (p) *p = 1;
}

static void cvc_destroy(cv_backend *b) {
    if (!b) return;
    cv_cuda_ctx *c = cvc_of(b);
    if (c) {
        cudaSetDevice(c->device);
        if (c->stream) cudaStreamSynchronize(c->stream);
        if (c->blas) cublasDestroy(c->blas);
        cudaFree(c->blas_ws);
        cudaFree(c->act);
        cudaFree(c->part);
        cudaFree(c->freq);
        if (c->stage) cudaFreeHost(c->stage);
        if (c->flags_h) cudaFreeHost(c->flags_h);
        if (c->stream) cudaStreamDestroy(c->stream);
        (void)cudaGetLastError();
        free(c);
    }
    free(b);
}

CV_CU_EXPORT int cv_cuda_abi_version_impl(void) { return CV_CUDA_ABI_VERSION; }

CV_CU_EXPORT cv_backend *cv_cuda_backend_create_impl(int device, cv_err *err) {
    cv_backend *b = NULL;
    cv_cuda_ctx *c = NULL;
    cudaError_t e;
    int count = 0;
    cudaDeviceProp prop;
    cudaFuncAttributes fa;

    e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess || count <= 0) {
        (void)cudaGetLastError();
        set_err(err, CV_ERR_UNSUPPORTED, "no CUDA device found (%s)",
                e != cudaSuccess ? cudaGetErrorString(e) : "the driver reports no devices");
        return NULL;
    }
    if (device < 0 || device >= count) {
        set_err(err, CV_ERR_INVALID, "CUDA device %d does not exist (%d found)", device, count);
        return NULL;
    }
    b = (cv_backend *)calloc(1, sizeof *b);
    c = (cv_cuda_ctx *)calloc(1, sizeof *c);
    if (!b || !c) {
        free(b);
        free(c);
        set_err(err, CV_ERR_NOMEM, "out of host memory for the CUDA backend");
        return NULL;
    }
    b->name = "cuda";
    b->device_memory = 1;
    b->last_error = cv_cuda_last_error_impl;
    b->ctx = c;
    b->destroy = cvc_destroy; /* from here on, failures clean up with cvc_destroy */
    c->device = device;
    {
        const char *g = getenv("CONVEYOR_CUDA_GEMV");
        c->use_gemv = !(g && strcmp(g, "0") == 0);
    }

#define CREATE_CHECK(call, what)                                                                  \
    do {                                                                                          \
        e = (call);                                                                               \
        if (e != cudaSuccess) {                                                                   \
            (void)cudaGetLastError();                                                             \
            set_err(err, e == cudaErrorMemoryAllocation ? CV_ERR_NOMEM : CV_ERR_UNSUPPORTED,      \
                    "CUDA backend on device %d: %s failed: %s", device, what, cudaGetErrorString(e)); \
            goto fail;                                                                            \
        }                                                                                         \
    } while (0)

    CREATE_CHECK(cudaSetDevice(device), "cudaSetDevice");
    CREATE_CHECK(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
    c->num_sms = prop.multiProcessorCount;
    c->cc_major = prop.major;
    c->cc_minor = prop.minor;
    c->smem_optin = prop.sharedMemPerBlockOptin;
    snprintf(c->name, sizeof c->name, "%.100s, sm_%d%d, %d SMs, %.1f GiB", prop.name, prop.major, prop.minor,
             prop.multiProcessorCount, (double)prop.totalGlobalMem / (1024.0 * 1024.0 * 1024.0));
    /* No kernel image for this GPU shows up here rather than at the first launch. */
    e = cudaFuncGetAttributes(&fa, cvc_probe_kernel);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        set_err(err, CV_ERR_UNSUPPORTED,
                "this build of conveyor has no CUDA kernels for %s (sm_%d%d): %s; rebuild with "
                "CONVEYOR_CUDA_ARCHS including %d%d",
                prop.name, prop.major, prop.minor, cudaGetErrorString(e), prop.major, prop.minor);
        goto fail;
    }
    CREATE_CHECK(cudaStreamCreate(&c->stream), "cudaStreamCreate");
    {
        cublasStatus_t s = cublasCreate(&c->blas);
        if (s == CUBLAS_STATUS_SUCCESS) s = cublasSetStream(c->blas, c->stream);
        if (s == CUBLAS_STATUS_SUCCESS) s = cublasSetMathMode(c->blas, CUBLAS_DEFAULT_MATH);
        if (s != CUBLAS_STATUS_SUCCESS) {
            set_err(err, s == CUBLAS_STATUS_ALLOC_FAILED ? CV_ERR_NOMEM : CV_ERR_UNSUPPORTED,
                    "CUDA backend: cuBLAS initialisation failed: %s", cublasGetStatusString(s));
            goto fail;
        }
    }
    CREATE_CHECK(cudaMalloc(&c->blas_ws, CVC_BLAS_WS_BYTES), "cudaMalloc (cuBLAS workspace)");
    c->blas_ws_bytes = CVC_BLAS_WS_BYTES;
    if (cublasSetWorkspace(c->blas, c->blas_ws, c->blas_ws_bytes) != CUBLAS_STATUS_SUCCESS) {
        set_err(err, CV_ERR_UNSUPPORTED, "CUDA backend: cublasSetWorkspace failed");
        goto fail;
    }
    CREATE_CHECK(cudaMalloc(&c->act, CVC_ACT_ELEMS * 2), "cudaMalloc (activation buffer)");
    c->act_elems = CVC_ACT_ELEMS;
    CREATE_CHECK(cudaMalloc(&c->part, CVC_PART_FLOATS * sizeof(float)), "cudaMalloc (attention partials)");
    c->part_floats = CVC_PART_FLOATS;
    CREATE_CHECK(cudaHostAlloc(&c->flags_h, CVC_NFLAGS * sizeof(int), cudaHostAllocMapped),
                 "cudaHostAlloc (flags)");
    memset(c->flags_h, 0, CVC_NFLAGS * sizeof(int));
    CREATE_CHECK(cudaHostGetDevicePointer((void **)&c->flags_d, c->flags_h, 0), "cudaHostGetDevicePointer");
    if (cvc_attention_setup(c, err) != CV_OK) goto fail;
#undef CREATE_CHECK

    b->matrix_prepare = cvc_matrix_prepare;
    b->matrix_free = cvc_matrix_free;
    b->table_prepare = cvc_table_prepare;
    b->table_free = cvc_table_free;
    b->alloc = cvc_alloc;
    b->free = cvc_free;
    b->to_device = cvc_to_device;
    b->to_host = cvc_to_host;
    b->gemm = cvc_gemm;
    b->rmsnorm = cvc_rmsnorm;
    b->rope = cvc_rope;
    b->swiglu = cvc_swiglu;
    b->lora_sgmv = cvc_lora_sgmv;
    b->embedding = cvc_embedding;
    b->kv_write = cvc_kv_write;
    b->paged_attention = cvc_paged_attention;
    b->sync = cvc_sync;
    b->mem_info = cvc_mem_info;
    return b;

fail:
    cvc_destroy(b);
    return NULL;
}

CV_CU_EXPORT int cv_cuda_last_error_impl(cv_backend *b, cv_err *err) {
    if (!b || !b->ctx) return 0;
    cv_cuda_ctx *c = cvc_of(b);
    if (c->err_code != 0 && err) set_err(err, c->err_code, "%s", c->err_msg);
    return c->err_code;
}

CV_CU_EXPORT void cv_cuda_clear_error_impl(cv_backend *b) {
    if (!b || !b->ctx) return;
    cv_cuda_ctx *c = cvc_of(b);
    c->err_code = 0;
    c->err_msg[0] = '\0';
}

CV_CU_EXPORT double cv_cuda_memcpy_bandwidth_impl(cv_backend *b, size_t bytes, int repeats, cv_err *err) {
    cv_cuda_ctx *c = cvc_of(b);
    void *src = NULL, *dst = NULL;
    cudaEvent_t t0 = NULL, t1 = NULL;
    double best = -1.0;
    cudaError_t e;
    if (bytes == 0 || repeats <= 0) {
        set_err(err, CV_ERR_INVALID, "memcpy_bandwidth: bytes and repeats must be positive");
        return -1.0;
    }
    if (cvc_enter(c) < 0) {
        set_err(err, c->err_code, "%s", c->err_msg);
        return -1.0;
    }
#define BW_CHECK(call, what)                                                                     \
    do {                                                                                         \
        e = (call);                                                                              \
        if (e != cudaSuccess) {                                                                  \
            (void)cudaGetLastError();                                                            \
            set_err(err, code_of(e), "memcpy_bandwidth: %s: %s", what, cudaGetErrorString(e));   \
            best = -1.0;                                                                         \
            goto done;                                                                           \
        }                                                                                        \
    } while (0)
    BW_CHECK(cudaMalloc(&src, bytes), "cudaMalloc");
    BW_CHECK(cudaMalloc(&dst, bytes), "cudaMalloc");
    BW_CHECK(cudaMemsetAsync(src, 1, bytes, c->stream), "cudaMemset");
    BW_CHECK(cudaEventCreate(&t0), "cudaEventCreate");
    BW_CHECK(cudaEventCreate(&t1), "cudaEventCreate");
    BW_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, c->stream), "warm-up copy");
    for (int r = 0; r < repeats; r++) {
        float ms = 0.f;
        BW_CHECK(cudaEventRecord(t0, c->stream), "cudaEventRecord");
        BW_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, c->stream), "copy");
        BW_CHECK(cudaEventRecord(t1, c->stream), "cudaEventRecord");
        BW_CHECK(cudaEventSynchronize(t1), "cudaEventSynchronize");
        BW_CHECK(cudaEventElapsedTime(&ms, t0, t1), "cudaEventElapsedTime");
        if (ms > 0.f) {
            double gbs = 2.0 * (double)bytes / (ms * 1e-3) / 1e9; /* read + write */
            if (gbs > best) best = gbs;
        }
    }
#undef BW_CHECK
done:
    if (t0) cudaEventDestroy(t0);
    if (t1) cudaEventDestroy(t1);
    if (src) cudaFree(src);
    if (dst) cudaFree(dst);
    return best;
}

CV_CU_EXPORT void cv_cuda_device_name_impl(cv_backend *b, char *buf, size_t len) {
    if (!buf || len == 0) return;
    snprintf(buf, len, "%s", (b && b->ctx) ? cvc_of(b)->name : "");
}
