/* The per-row code of RMSNorm, SwiGLU and GeGLU at each SIMD level (a shared
 * piece: it calls nothing above it). The unfused kernels (elementwise.c) and
 * the prologues of the fused GEMMs (gemm.c, quant.c) run these same rows, so
 * fused and unfused results agree bit for bit. */
#include <math.h>
#include <string.h>

#include "cpu_internal.h"
#include "vec_math.h"

#if CV_HAVE_AVX512
CV_TARGET_AVX512_BEGIN
static void rms_row_avx512(float *out, const float *x, const float *w, int64_t dim, float eps) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= dim; i += 32) {
        const __m512 v0 = _mm512_loadu_ps(x + i), v1 = _mm512_loadu_ps(x + i + 16);
        a0 = _mm512_fmadd_ps(v0, v0, a0);
        a1 = _mm512_fmadd_ps(v1, v1, a1);
    }
    for (; i < dim; i += 16) {
        const __m512 v = _mm512_maskz_loadu_ps(cv_tail_mask16(dim - i), x + i);
        a0 = _mm512_fmadd_ps(v, v, a0);
    }
    const float ss = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
    const __m512 vi = _mm512_set1_ps((float)(1.0 / sqrt((double)ss / (double)dim + (double)eps)));
    for (i = 0; i < dim; i += 16) {
        const __mmask16 m = cv_tail_mask16(dim - i);
        const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), vi);
        _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, w + i)));
    }
}

static void swiglu_row_avx512(float *o, const float *g, const float *u, int64_t dim) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t i = 0; i < dim; i += 16) {
        const __mmask16 m = cv_tail_mask16(dim - i);
        const __m512 gv = _mm512_maskz_loadu_ps(m, g + i);
        const __m512 e = cv_exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        const __m512 s = _mm512_div_ps(gv, _mm512_add_ps(one, e));
        _mm512_mask_storeu_ps(o + i, m, _mm512_mul_ps(s, _mm512_maskz_loadu_ps(m, u + i)));
    }
}
CV_TARGET_END
#endif
/* ------------------------------------------------------------------------ */
/* RMSNorm                                                                   */

/* out[dim] = x * rsqrt(mean(x^2) + eps) * w; out may alias x. */
static void rms_row_plain(float *out, const float *x, const float *w, int64_t dim, float eps) {
    double ss = 0.0;
    for (int64_t i = 0; i < dim; i++) ss += (double)x[i] * (double)x[i];
    const float inv = (float)(1.0 / sqrt(ss / (double)dim + (double)eps));
    for (int64_t i = 0; i < dim; i++) out[i] = x[i] * inv * w[i];
}

#if CV_HAVE_AVX2
CV_TARGET_AVX2_BEGIN
static void rms_row_avx2(float *out, const float *x, const float *w, int64_t dim, float eps) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= dim; i += 16) {
        __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
        a0 = _mm256_fmadd_ps(v0, v0, a0);
        a1 = _mm256_fmadd_ps(v1, v1, a1);
    }
    for (; i + 8 <= dim; i += 8) {
        __m256 v0 = _mm256_loadu_ps(x + i);
        a0 = _mm256_fmadd_ps(v0, v0, a0);
    }
    float ss = cv_hsum256(_mm256_add_ps(a0, a1));
    for (; i < dim; i++) ss += x[i] * x[i];
    const float inv = (float)(1.0 / sqrt((double)ss / (double)dim + (double)eps));
    const __m256 vi = _mm256_set1_ps(inv);
    for (i = 0; i + 8 <= dim; i += 8)
        _mm256_storeu_ps(out + i,
                         _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), vi), _mm256_loadu_ps(w + i)));
    for (; i < dim; i++) out[i] = x[i] * inv * w[i];
}

CV_TARGET_END
#endif

/* One row at the backend's level: the row code every RMSNorm runs, fused or not. */
void cv_cpu_rms_row(float *out, const float *x, const float *w, int64_t dim, float eps, int simd) {
#if CV_HAVE_AVX512
    if (simd >= CV_SIMD_AVX512) {
        rms_row_avx512(out, x, w, dim, eps);
        return;
    }
#endif
#if CV_HAVE_AVX2
    if (simd) {
        rms_row_avx2(out, x, w, dim, eps);
        return;
    }
#endif
    (void)simd;
    rms_row_plain(out, x, w, dim, eps);
}

/* GELU (tanh form, PyTorch's gelu(approximate="tanh")) gated by up: Gemma's
 * FFN. 0.5 x (1 + tanh(y)) = x / (1 + exp(-2y)) with y = sqrt(2/pi) (x +
 * 0.044715 x^3): SwiGLU's form with the exponent -2y, so the same exp. */
#define GELU_K 0.7978845608028654f
#define GELU_C 0.044715f

#if CV_HAVE_AVX2
CV_TARGET_AVX2_BEGIN
/* The 8-wide part of a gated row, x / (1 + exp(z)) * u with z = -x (SwiGLU)
 * or -2 sqrt(2/pi) (x + 0.044715 x^3) (GeGLU); returns the count done. */
static CV_ALWAYS_INLINE int64_t gated_row_avx2(float *o, const float *g, const float *u, int64_t dim,
                                               const int gelu) {
    const __m256 one = _mm256_set1_ps(1.0f), k2 = _mm256_set1_ps(-2.0f * GELU_K), c = _mm256_set1_ps(GELU_C);
    int64_t i = 0;
    for (; i + 8 <= dim; i += 8) {
        const __m256 x = _mm256_loadu_ps(g + i);
        const __m256 z = gelu ? _mm256_mul_ps(k2, _mm256_fmadd_ps(_mm256_mul_ps(c, x), _mm256_mul_ps(x, x), x))
                              : _mm256_sub_ps(_mm256_setzero_ps(), x);
        const __m256 e = cv_exp256(z);
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
    }
    return i;
}
static int64_t swiglu_row_avx2(float *o, const float *g, const float *u, int64_t dim) {
    return gated_row_avx2(o, g, u, dim, 0);
}
static int64_t geglu_row_avx2(float *o, const float *g, const float *u, int64_t dim) {
    return gated_row_avx2(o, g, u, dim, 1);
}
CV_TARGET_END
#endif

/* One row at the backend's level: the row code every SwiGLU runs, fused or not. */
void cv_cpu_swiglu_row(float *o, const float *g, const float *u, int64_t dim, int simd) {
    int64_t i = 0;
#if CV_HAVE_AVX512
    if (simd >= CV_SIMD_AVX512) {
        swiglu_row_avx512(o, g, u, dim);
        return;
    }
#endif
#if CV_HAVE_AVX2
    if (simd >= CV_SIMD_AVX2) i = swiglu_row_avx2(o, g, u, dim);
#endif
    (void)simd;
    for (; i < dim; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

void cv_cpu_geglu_row(float *o, const float *g, const float *u, int64_t dim, int simd) {
    int64_t i = 0;
#if CV_HAVE_AVX2
    if (simd >= CV_SIMD_AVX2) i = geglu_row_avx2(o, g, u, dim);
#endif
    (void)simd;
    for (; i < dim; i++) {
        const float x = g[i];
        o[i] = x / (1.0f + expf(-2.0f * GELU_K * (x + GELU_C * x * x * x))) * u[i];
    }
}

/* ------------------------------------------------------------------------ */
/* GEMM input rows made on the fly (the prologue of the fused GEMMs)         */

void cv_cpu_gemm_in_rows(const cv_gemm_in *in, float *dst, int64_t t0, int64_t m, int64_t cols, int simd) {
    for (int64_t t = t0; t < t0 + m; t++, dst += cols) {
        if (in->kind == CV_IN_RMSNORM)
            cv_cpu_rms_row(dst, in->src + (size_t)t * (size_t)cols, in->gain, cols, in->eps, simd);
        else if (in->kind == CV_IN_SWIGLU)
            cv_cpu_swiglu_row(dst, in->src + (size_t)t * 2 * (size_t)cols, in->src + ((size_t)t * 2 + 1) * (size_t)cols,
                       cols, simd);
        else
            memcpy(dst, in->src + (size_t)t * (size_t)cols, (size_t)cols * sizeof(float));
    }
}
