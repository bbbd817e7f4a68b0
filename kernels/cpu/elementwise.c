/* Row-wise kernels of the CPU backend: rmsnorm, rotary embedding, SwiGLU,
 * embedding lookup, and dtype widening/narrowing.
 * Each has a plain-C version and an AVX2 version; rows are split across the
 * pool only when there is enough work to pay for waking it. */
#include <math.h>
#include <string.h>

#include "cpu_internal.h"
#include "quant.h"

/* Elements per thread below which a row kernel stays on one thread. */
#define ROW_GRAIN 16384.0

/* ------------------------------------------------------------------------ */
/* AVX-512 versions: the AVX2 ones 16 wide, tails by masks.                 */

#if CV_HAVE_AVX512
CV_TARGET_AVX512_BEGIN
static CV_ALWAYS_INLINE __mmask16 tail_mask(int64_t left) {
    return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u);
}

static void widen_avx512(float *dst, const uint16_t *s, cv_dtype dt, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = tail_mask(n - i);
        const __m256i h = _mm256_maskz_loadu_epi16(m, s + i);
        const __m512 v = dt == CV_BF16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
                                       : _mm512_cvtph_ps(h);
        _mm512_mask_storeu_ps(dst + i, m, v);
    }
}

/* Round-to-nearest-even float32 -> bfloat16 of 16 lanes (NaN stays a quiet
 * NaN), as f32_to_bf16_8 and cv_f32_to_bf16. */
static CV_ALWAYS_INLINE __m256i f32_to_bf16_16(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
    const __m512i nan = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), nan);
    return _mm512_cvtepi32_epi16(r); /* keeps the low 16 bits of each lane */
}

static void narrow_avx512(uint16_t *d, cv_dtype dt, const float *src, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = tail_mask(n - i);
        const __m512 v = _mm512_maskz_loadu_ps(m, src + i);
        const __m256i h = dt == CV_BF16 ? f32_to_bf16_16(v) : _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT);
        _mm256_mask_storeu_epi16(d + i, m, h);
    }
}

/* exp(x) on 16 lanes: cv_exp256's method (same constants, same results). */
__m512 cv_exp512(__m512 x) {
    const __m512 hi = _mm512_set1_ps(88.3762626647949f);
    const __m512 lo = _mm512_set1_ps(-87.3365447505531f);
    const __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_min_ps(_mm512_max_ps(x, lo), hi);
    const __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mov_ps((__mmask16)~under, _mm512_mul_ps(p, _mm512_castsi512_ps(e)));
}

static void rms_row_avx512(float *out, const float *x, const float *w, int64_t dim, float eps) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= dim; i += 32) {
        const __m512 v0 = _mm512_loadu_ps(x + i), v1 = _mm512_loadu_ps(x + i + 16);
        a0 = _mm512_fmadd_ps(v0, v0, a0);
        a1 = _mm512_fmadd_ps(v1, v1, a1);
    }
    for (; i < dim; i += 16) {
        const __m512 v = _mm512_maskz_loadu_ps(tail_mask(dim - i), x + i);
        a0 = _mm512_fmadd_ps(v, v, a0);
    }
    const float ss = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
    const __m512 vi = _mm512_set1_ps((float)(1.0 / sqrt((double)ss / (double)dim + (double)eps)));
    for (i = 0; i < dim; i += 16) {
        const __mmask16 m = tail_mask(dim - i);
        const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), vi);
        _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, w + i)));
    }
}

/* As rope_head_avx2 (cs2/sn2 for PAIRS), 16 lanes. */
static void rope_head_avx512(float *x, int64_t hd, cv_rope_layout layout, int64_t i0, int64_t m,
                             const float *cs, const float *sn, const float *cs2, const float *sn2) {
    if (layout == CV_ROPE_HALVES) {
        float *xa = x + i0, *xb = x + i0 + hd / 2;
        for (int64_t i = 0; i < m; i += 16) {
            const __mmask16 k = tail_mask(m - i);
            const __m512 a = _mm512_maskz_loadu_ps(k, xa + i), bb = _mm512_maskz_loadu_ps(k, xb + i);
            const __m512 c = _mm512_maskz_loadu_ps(k, cs + i), s = _mm512_maskz_loadu_ps(k, sn + i);
            _mm512_mask_storeu_ps(xa + i, k, _mm512_fmsub_ps(a, c, _mm512_mul_ps(bb, s)));
            _mm512_mask_storeu_ps(xb + i, k, _mm512_fmadd_ps(bb, c, _mm512_mul_ps(a, s)));
        }
    } else {
        float *xp = x + 2 * i0;
        for (int64_t i = 0; i < 2 * m; i += 16) { /* 8 pairs per vector */
            const __mmask16 k = tail_mask(2 * m - i);
            const __m512 v = _mm512_maskz_loadu_ps(k, xp + i);
            const __m512 sw = _mm512_permute_ps(v, 0xB1); /* (b, a) per pair */
            _mm512_mask_storeu_ps(xp + i, k, _mm512_fmadd_ps(v, _mm512_maskz_loadu_ps(k, cs2 + i),
                                                             _mm512_mul_ps(sw, _mm512_maskz_loadu_ps(k, sn2 + i))));
        }
    }
}

static void swiglu_row_avx512(float *o, const float *g, const float *u, int64_t dim) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t i = 0; i < dim; i += 16) {
        const __mmask16 m = tail_mask(dim - i);
        const __m512 gv = _mm512_maskz_loadu_ps(m, g + i);
        const __m512 e = cv_exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        const __m512 s = _mm512_div_ps(gv, _mm512_add_ps(one, e));
        _mm512_mask_storeu_ps(o + i, m, _mm512_mul_ps(s, _mm512_maskz_loadu_ps(m, u + i)));
    }
}
CV_TARGET_END
#endif

/* ------------------------------------------------------------------------ */
/* Conversions                                                               */

#if CV_HAVE_AVX2
CV_TARGET_AVX2_BEGIN
/* The 8-wide part of cv_cpu_widen from a 16-bit dtype; returns the count done. */
static int64_t widen_avx2(float *dst, const uint16_t *s, cv_dtype dt, int64_t n) {
    int64_t i = 0;
    if (dt == CV_BF16) {
        for (; i + 8 <= n; i += 8) {
            __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(s + i)));
            _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
        }
    } else {
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i))));
    }
    return i;
}
CV_TARGET_END
#endif

void cv_cpu_widen(float *dst, const void *src, cv_dtype dt, int64_t n, int simd) {
    int64_t i = 0;
    if (dt == CV_F32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
        return;
    }
    const uint16_t *s = src; /* [n] */
#if CV_HAVE_AVX2
    if (simd >= CV_SIMD_AVX512) {
        widen_avx512(dst, s, dt, n);
        return;
    }
    if (simd >= CV_SIMD_AVX2) i = widen_avx2(dst, s, dt, n);
#else
    (void)simd;
#endif
    if (dt == CV_BF16)
        for (; i < n; i++) dst[i] = cv_bf16_to_f32(s[i]);
    else
        for (; i < n; i++) dst[i] = cv_f16_to_f32(s[i]);
}

#if CV_HAVE_AVX2
CV_TARGET_AVX2_BEGIN
/* Round-to-nearest-even float32 -> bfloat16 of 8 lanes (NaN stays a quiet NaN). */
static inline __m128i f32_to_bf16_8(__m256 x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
    r = _mm256_srli_epi32(r, 16);
    const __m256i nan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    const __m256 isnan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    r = _mm256_castps_si256(
        _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(nan), isnan));
    r = _mm256_and_si256(r, _mm256_set1_epi32(0xffff));
    const __m256i packed = _mm256_packus_epi32(r, _mm256_setzero_si256());
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

/* The 8-wide part of cv_cpu_narrow into a 16-bit dtype; returns the count done. */
static int64_t narrow_avx2(uint16_t *d, cv_dtype dt, const float *src, int64_t n) {
    int64_t i = 0;
    if (dt == CV_BF16) {
        for (; i + 8 <= n; i += 8)
            _mm_storeu_si128((__m128i *)(d + i), f32_to_bf16_8(_mm256_loadu_ps(src + i)));
    } else {
        for (; i + 8 <= n; i += 8)
            _mm_storeu_si128((__m128i *)(d + i),
                             _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    }
    return i;
}
CV_TARGET_END
#endif

void cv_cpu_narrow(void *dst, cv_dtype dt, const float *src, int64_t n, int simd) {
    int64_t i = 0;
    if (dt == CV_F32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
        return;
    }
    uint16_t *d = dst; /* [n] */
#if CV_HAVE_AVX2
    if (simd >= CV_SIMD_AVX512) {
        narrow_avx512(d, dt, src, n);
        return;
    }
    if (simd >= CV_SIMD_AVX2) i = narrow_avx2(d, dt, src, n);
#else
    (void)simd;
#endif
    if (dt == CV_BF16)
        for (; i < n; i++) d[i] = cv_f32_to_bf16(src[i]);
    else
        for (; i < n; i++) d[i] = cv_f32_to_f16(src[i]);
}

#if CV_HAVE_AVX2
CV_TARGET_AVX2_BEGIN
/* exp(x) on 8 lanes: x = n ln2 + r, |r| <= ln2/2, exp(r) by a degree-6
 * polynomial (Cephes expf coefficients), 2^n through the exponent bits.
 * Below about -87.3 the result is 0 (so -inf gives 0). */
__m256 cv_exp256(__m256 x) {
    const __m256 hi = _mm256_set1_ps(88.3762626647949f);
    const __m256 lo = _mm256_set1_ps(-87.3365447505531f);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    /* 2^fx: fx in [-126, 127] after the clamp */
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
    return _mm256_andnot_ps(under, y);
}

static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
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
    float ss = hsum256(_mm256_add_ps(a0, a1));
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

typedef struct norm_job {
    float *out;         /* [n][dim] */
    const float *x;     /* [n][dim] */
    const float *w;     /* [dim] */
    int64_t n, dim;
    float eps;
    int simd;
    cv_rows *rows;      /* claimed in chunks (dynamic region) */
} norm_job;

/* One row at the backend's level: the row code every RMSNorm runs, fused or not. */
static void rms_row(float *out, const float *x, const float *w, int64_t dim, float eps, int simd) {
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

static void norm_fn(void *arg, int tid, int nth) {
    const norm_job *j = arg;
    (void)tid;
    (void)nth;
    for (int64_t t0, t1; cv_rows_claim(j->rows, &t0, &t1);)
        for (int64_t t = t0; t < t1; t++)
            rms_row(j->out + (size_t)t * (size_t)j->dim, j->x + (size_t)t * (size_t)j->dim, j->w, j->dim,
                    j->eps, j->simd);
}

void cv_cpu_rmsnorm(cv_backend *b, float *out, const float *x, const float *weight, int64_t n,
                    int64_t dim, float eps) {
    cv_cpu *c = cv_cpu_of(b);
    if (n <= 0 || dim <= 0) return;
    norm_job j = {.out = out, .x = x, .w = weight, .n = n, .dim = dim,
                  .eps = eps, .simd = c->simd};
    int nth = cv_threads_for(c, (double)n * (double)dim, ROW_GRAIN);
    if (nth > n) nth = (int)n;
    cv_rows rows;
    j.rows = &rows;
    cv_cpu_run_rows(c, nth, &rows, n, norm_fn, &j);
}

/* ------------------------------------------------------------------------ */
/* RoPE                                                                      */

#define ROPE_CHUNK 128 /* frequencies per pass: cos/sin live on the stack */

typedef struct rope_job {
    float *q;           /* [n][q_stride], heads [n_heads][head_dim] at the start */
    float *k;           /* [n][k_stride], heads [n_kv_heads][head_dim] */
    int64_t q_stride, k_stride, n_heads, n_kv_heads, n;
    const int32_t *pos; /* [n] */
    const cv_rope *rope;
    int simd;
    cv_rows *rows;      /* claimed in chunks (dynamic region) */
    /* rope_kv_write: each token's rotated k and its v go to the cache while
     * they are in L1 (cache NULL: rope alone) */
    cv_kv_layer *cache;
    const float *v;     /* [n][v_stride] */
    int64_t v_stride;
    const int64_t *slots; /* [n] */
} rope_job;

/* Rotates frequencies [i0, i0 + m) of one head x[head_dim] with cs/sn[m]. */
static void rope_head_plain(float *x, int64_t hd, cv_rope_layout layout, int64_t i0, int64_t m,
                            const float *cs, const float *sn) {
    if (layout == CV_ROPE_HALVES) {
        const int64_t half = hd / 2;
        for (int64_t i = 0; i < m; i++) {
            const float a = x[i0 + i], bb = x[i0 + i + half];
            x[i0 + i] = a * cs[i] - bb * sn[i];
            x[i0 + i + half] = bb * cs[i] + a * sn[i];
        }
    } else {
        for (int64_t i = 0; i < m; i++) {
            const float a = x[2 * (i0 + i)], bb = x[2 * (i0 + i) + 1];
            x[2 * (i0 + i)] = a * cs[i] - bb * sn[i];
            x[2 * (i0 + i) + 1] = a * sn[i] + bb * cs[i];
        }
    }
}

#if CV_HAVE_AVX2
CV_TARGET_AVX2_BEGIN
/* cs2/sn2[2m] hold, for PAIRS, (c, c) and (-s, s) per frequency. */
static void rope_head_avx2(float *x, int64_t hd, cv_rope_layout layout, int64_t i0, int64_t m,
                           const float *cs, const float *sn, const float *cs2, const float *sn2) {
    int64_t i = 0;
    if (layout == CV_ROPE_HALVES) {
        const int64_t half = hd / 2;
        float *xa = x + i0, *xb = x + i0 + half;
        for (; i + 8 <= m; i += 8) {
            const __m256 a = _mm256_loadu_ps(xa + i), bb = _mm256_loadu_ps(xb + i);
            const __m256 c = _mm256_loadu_ps(cs + i), s = _mm256_loadu_ps(sn + i);
            _mm256_storeu_ps(xa + i, _mm256_fmsub_ps(a, c, _mm256_mul_ps(bb, s)));
            _mm256_storeu_ps(xb + i, _mm256_fmadd_ps(bb, c, _mm256_mul_ps(a, s)));
        }
        for (; i < m; i++) {
            const float a = xa[i], bb = xb[i];
            xa[i] = a * cs[i] - bb * sn[i];
            xb[i] = bb * cs[i] + a * sn[i];
        }
    } else {
        float *xp = x + 2 * i0;
        for (; i + 4 <= m; i += 4) {
            const __m256 v = _mm256_loadu_ps(xp + 2 * i);
            const __m256 sw = _mm256_permute_ps(v, 0xB1); /* (b, a) per pair */
            _mm256_storeu_ps(xp + 2 * i, _mm256_fmadd_ps(v, _mm256_loadu_ps(cs2 + 2 * i),
                                                         _mm256_mul_ps(sw, _mm256_loadu_ps(sn2 + 2 * i))));
        }
        for (; i < m; i++) {
            const float a = xp[2 * i], bb = xp[2 * i + 1];
            xp[2 * i] = a * cs[i] - bb * sn[i];
            xp[2 * i + 1] = a * sn[i] + bb * cs[i];
        }
    }
}
CV_TARGET_END
#endif

static void rope_fn(void *arg, int tid, int nth) {
    const rope_job *j = arg;
    const int64_t hd = j->rope->head_dim, nf = hd / 2;
    const cv_rope_layout layout = j->rope->layout;
    (void)tid;
    (void)nth;
    float cs[ROPE_CHUNK], sn[ROPE_CHUNK];
#if CV_HAVE_AVX2
    float cs2[2 * ROPE_CHUNK], sn2[2 * ROPE_CHUNK];
#endif
    for (int64_t t0, t1; cv_rows_claim(j->rows, &t0, &t1);)
    for (int64_t t = t0; t < t1; t++) {
        const double p = (double)j->pos[t];
        for (int64_t i0 = 0; i0 < nf; i0 += ROPE_CHUNK) {
            const int64_t m = nf - i0 < ROPE_CHUNK ? nf - i0 : ROPE_CHUNK;
            /* angles once per token, in double: exact enough for long positions */
            for (int64_t i = 0; i < m; i++) {
                const double a = p * (double)j->rope->inv_freq[i0 + i];
                cs[i] = (float)cos(a);
                sn[i] = (float)sin(a);
            }
#if CV_HAVE_AVX2
            if (j->simd) {
                if (layout == CV_ROPE_PAIRS)
                    for (int64_t i = 0; i < m; i++) {
                        cs2[2 * i] = cs2[2 * i + 1] = cs[i];
                        sn2[2 * i] = -sn[i];
                        sn2[2 * i + 1] = sn[i];
                    }
                void (*head)(float *, int64_t, cv_rope_layout, int64_t, int64_t, const float *,
                             const float *, const float *, const float *) = rope_head_avx2;
#if CV_HAVE_AVX512
                if (j->simd >= CV_SIMD_AVX512) head = rope_head_avx512;
#endif
                for (int64_t h = 0; h < j->n_heads; h++)
                    head(j->q + (size_t)t * (size_t)j->q_stride + (size_t)(h * hd), hd, layout, i0, m,
                         cs, sn, cs2, sn2);
                for (int64_t h = 0; h < j->n_kv_heads; h++)
                    head(j->k + (size_t)t * (size_t)j->k_stride + (size_t)(h * hd), hd, layout, i0, m,
                         cs, sn, cs2, sn2);
                continue;
            }
#endif
            for (int64_t h = 0; h < j->n_heads; h++)
                rope_head_plain(j->q + (size_t)t * (size_t)j->q_stride + (size_t)(h * hd), hd, layout,
                                i0, m, cs, sn);
            for (int64_t h = 0; h < j->n_kv_heads; h++)
                rope_head_plain(j->k + (size_t)t * (size_t)j->k_stride + (size_t)(h * hd), hd, layout,
                                i0, m, cs, sn);
        }
        if (j->cache)
            cv_cpu_kv_write_token(j->cache, j->k + (size_t)t * (size_t)j->k_stride,
                                  j->v + (size_t)t * (size_t)j->v_stride, j->slots[t], j->simd);
    }
}

/* Runs rope_fn over n tokens on enough threads for `work`. */
static void run_rope(cv_cpu *c, rope_job *j, double work) {
    int nth = cv_threads_for(c, work, ROW_GRAIN);
    if (nth > j->n) nth = (int)j->n;
    cv_rows rows;
    j->rows = &rows;
    cv_cpu_run_rows(c, nth, &rows, j->n, rope_fn, j);
}

/* sin/cos cost about as much as rotating a few heads: count them in */
static double rope_work(int64_t n, int64_t hd, int64_t heads) { return (double)n * (double)hd * (double)(heads + 8); }

void cv_cpu_rope(cv_backend *b, float *q, int64_t q_stride, int64_t n_heads, float *k,
                 int64_t k_stride, int64_t n_kv_heads, const int32_t *pos, int64_t n,
                 const cv_rope *rope) {
    cv_cpu *c = cv_cpu_of(b);
    if (n <= 0 || rope->head_dim < 2) return;
    if (!q) n_heads = 0;
    if (!k) n_kv_heads = 0;
    rope_job j = {.q = q, .k = k, .q_stride = q_stride, .k_stride = k_stride, .n_heads = n_heads,
                  .n_kv_heads = n_kv_heads, .n = n, .pos = pos, .rope = rope, .simd = c->simd};
    run_rope(c, &j, rope_work(n, rope->head_dim, n_heads + n_kv_heads));
}

void cv_cpu_rope_kv_write(cv_backend *b, float *q, int64_t q_stride, int64_t n_heads, float *k,
                          int64_t k_stride, int64_t n_kv_heads, const float *v, int64_t v_stride,
                          const int32_t *pos, int64_t n, const cv_rope *rope, cv_kv_layer *cache,
                          const int64_t *slot_mapping) {
    cv_cpu *c = cv_cpu_of(b);
    if (n <= 0) return;
    if (rope->head_dim < 2) { /* nothing to rotate */
        cv_cpu_kv_write(b, cache, k, k_stride, v, v_stride, slot_mapping, n);
        return;
    }
    if (!q) n_heads = 0;
    rope_job j = {.q = q, .k = k, .q_stride = q_stride, .k_stride = k_stride, .n_heads = n_heads,
                  .n_kv_heads = n_kv_heads, .n = n, .pos = pos, .rope = rope, .simd = c->simd,
                  .cache = cache, .v = v, .v_stride = v_stride, .slots = slot_mapping};
    /* narrowing k and v into the cache costs about one rotation per kv head */
    run_rope(c, &j, rope_work(n, rope->head_dim, n_heads + 2 * n_kv_heads));
}

/* Per-head RMSNorm (Qwen3 and Gemma 3 q/k norms), in place; rows claimed as
 * tokens, each token's heads normed by the row code of cv_cpu_rmsnorm. */
typedef struct head_norm_job {
    float *x;           /* [n] rows, x_stride apart, of n_heads heads of hd */
    const float *w;     /* [hd] */
    int64_t x_stride, n_heads, hd;
    float eps;
    int simd;
    cv_rows *rows;
} head_norm_job;

static void head_norm_fn(void *arg, int tid, int nth) {
    const head_norm_job *j = arg;
    (void)tid;
    (void)nth;
    for (int64_t t0, t1; cv_rows_claim(j->rows, &t0, &t1);)
        for (int64_t t = t0; t < t1; t++)
            for (int64_t h = 0; h < j->n_heads; h++) {
                float *v = j->x + (size_t)t * (size_t)j->x_stride + (size_t)(h * j->hd);
                rms_row(v, v, j->w, j->hd, j->eps, j->simd);
            }
}

void cv_cpu_head_rmsnorm(cv_backend *b, float *x, int64_t x_stride, int64_t n_heads, int64_t n, int64_t head_dim,
                         const float *weight, float eps) {
    cv_cpu *c = cv_cpu_of(b);
    if (n <= 0 || n_heads <= 0 || head_dim <= 0) return;
    head_norm_job j = {.x = x, .w = weight, .x_stride = x_stride, .n_heads = n_heads, .hd = head_dim,
                       .eps = eps, .simd = c->simd};
    int nth = cv_threads_for(c, (double)n * (double)(n_heads * head_dim), ROW_GRAIN);
    if (nth > n) nth = (int)n;
    cv_rows rows;
    j.rows = &rows;
    cv_cpu_run_rows(c, nth, &rows, n, head_norm_fn, &j);
}

/* x += rmsnorm(y) * w (Gemma's norms after attention and after the FFN). */
typedef struct add_norm_job {
    float *x, *y;       /* [n][dim] */
    const float *w;     /* [dim] */
    int64_t dim;
    float eps;
    int simd;
    cv_rows *rows;
} add_norm_job;

static void add_norm_fn(void *arg, int tid, int nth) {
    const add_norm_job *j = arg;
    (void)tid;
    (void)nth;
    for (int64_t t0, t1; cv_rows_claim(j->rows, &t0, &t1);)
        for (int64_t t = t0; t < t1; t++) {
            float *y = j->y + (size_t)t * (size_t)j->dim, *x = j->x + (size_t)t * (size_t)j->dim;
            rms_row(y, y, j->w, j->dim, j->eps, j->simd);
            for (int64_t i = 0; i < j->dim; i++) x[i] += y[i];
        }
}

void cv_cpu_add_rmsnorm(cv_backend *b, float *x, float *y, const float *weight, int64_t n, int64_t dim,
                        float eps) {
    cv_cpu *c = cv_cpu_of(b);
    if (n <= 0 || dim <= 0) return;
    add_norm_job j = {.x = x, .y = y, .w = weight, .dim = dim, .eps = eps, .simd = c->simd};
    int nth = cv_threads_for(c, (double)n * (double)dim, ROW_GRAIN);
    if (nth > n) nth = (int)n;
    cv_rows rows;
    j.rows = &rows;
    cv_cpu_run_rows(c, nth, &rows, n, add_norm_fn, &j);
}

void cv_cpu_scale(cv_backend *b, float *x, int64_t n, float s) {
    (void)b;
    for (int64_t i = 0; i < n; i++) x[i] *= s;
}

/* ------------------------------------------------------------------------ */
/* SwiGLU                                                                    */

/* A gated activation (SwiGLU, GeGLU) over rows: out = act(gate) * up. */
typedef void (*gated_row_fn)(float *o, const float *g, const float *u, int64_t dim, int simd);
typedef struct gated_job {
    float *out;       /* [n][dim] */
    const float *gu;  /* [n][2*dim]: gate then up */
    int64_t n, dim;
    int simd;
    gated_row_fn row;
    cv_rows *rows;      /* claimed in chunks (dynamic region) */
} gated_job;

static void gated_fn(void *arg, int tid, int nth) {
    const gated_job *j = arg;
    (void)tid;
    (void)nth;
    for (int64_t t0, t1; cv_rows_claim(j->rows, &t0, &t1);)
        for (int64_t t = t0; t < t1; t++) {
            const float *g = j->gu + (size_t)t * 2 * (size_t)j->dim;
            j->row(j->out + (size_t)t * (size_t)j->dim, g, g + j->dim, j->dim, j->simd);
        }
}

/* flops_per: rough cost of one output, for the thread count. */
static void run_gated(cv_backend *b, float *out, const float *gu, int64_t n, int64_t dim, gated_row_fn row,
                      double flops_per) {
    cv_cpu *c = cv_cpu_of(b);
    if (n <= 0 || dim <= 0) return;
    gated_job j = {.out = out, .gu = gu, .n = n, .dim = dim, .simd = c->simd, .row = row};
    int nth = cv_threads_for(c, (double)n * (double)dim * flops_per, ROW_GRAIN);
    if (nth > n) nth = (int)n;
    cv_rows rows;
    j.rows = &rows;
    cv_cpu_run_rows(c, nth, &rows, n, gated_fn, &j);
}

#if CV_HAVE_AVX2
CV_TARGET_AVX2_BEGIN
/* The 8-wide part of a SwiGLU row; returns the count done. */
static int64_t swiglu_row_avx2(float *o, const float *g, const float *u, int64_t dim) {
    const __m256 one = _mm256_set1_ps(1.0f);
    int64_t i = 0;
    for (; i + 8 <= dim; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 e = cv_exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv));
        const __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, e));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
    }
    return i;
}
CV_TARGET_END
#endif

/* One row at the backend's level: the row code every SwiGLU runs, fused or not. */
static void swiglu_row(float *o, const float *g, const float *u, int64_t dim, int simd) {
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

void cv_cpu_swiglu(cv_backend *b, float *out, const float *gu, int64_t n, int64_t dim) {
    run_gated(b, out, gu, n, dim, swiglu_row, 4.0);
}

/* GELU (tanh form, PyTorch's gelu(approximate="tanh")) gated by up: Gemma's
 * FFN. 0.5 x (1 + tanh(y)) = x / (1 + exp(-2y)) with y = sqrt(2/pi) (x +
 * 0.044715 x^3): SwiGLU's form with the exponent -2y, so the same exp. */
#define GELU_K 0.7978845608028654f
#define GELU_C 0.044715f

#if CV_HAVE_AVX2
CV_TARGET_AVX2_BEGIN
/* The 8-wide part of a GeGLU row; returns the count done. */
static int64_t geglu_row_avx2(float *o, const float *g, const float *u, int64_t dim) {
    const __m256 one = _mm256_set1_ps(1.0f), k2 = _mm256_set1_ps(-2.0f * GELU_K), c = _mm256_set1_ps(GELU_C);
    int64_t i = 0;
    for (; i + 8 <= dim; i += 8) {
        const __m256 x = _mm256_loadu_ps(g + i);
        const __m256 y = _mm256_fmadd_ps(_mm256_mul_ps(c, x), _mm256_mul_ps(x, x), x); /* x + c x^3 */
        const __m256 e = cv_exp256(_mm256_mul_ps(k2, y));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
    }
    return i;
}
CV_TARGET_END
#endif

static void geglu_row(float *o, const float *g, const float *u, int64_t dim, int simd) {
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

void cv_cpu_geglu(cv_backend *b, float *out, const float *gu, int64_t n, int64_t dim) {
    run_gated(b, out, gu, n, dim, geglu_row, 8.0);
}

/* ------------------------------------------------------------------------ */
/* GEMM input rows made on the fly (the prologue of the fused GEMMs)         */

void cv_cpu_gemm_in_rows(const cv_gemm_in *in, float *dst, int64_t t0, int64_t m, int64_t cols, int simd) {
    for (int64_t t = t0; t < t0 + m; t++, dst += cols) {
        if (in->kind == CV_IN_RMSNORM)
            rms_row(dst, in->src + (size_t)t * (size_t)cols, in->gain, cols, in->eps, simd);
        else if (in->kind == CV_IN_SWIGLU)
            swiglu_row(dst, in->src + (size_t)t * 2 * (size_t)cols, in->src + ((size_t)t * 2 + 1) * (size_t)cols,
                       cols, simd);
        else
            memcpy(dst, in->src + (size_t)t * (size_t)cols, (size_t)cols * sizeof(float));
    }
}

void cv_cpu_gemm_in_all(cv_backend *b, float *dst, const cv_gemm_in *in, int64_t n, int64_t cols) {
    if (in->kind == CV_IN_RMSNORM)
        cv_cpu_rmsnorm(b, dst, in->src, in->gain, n, cols, in->eps);
    else if (in->kind == CV_IN_SWIGLU)
        cv_cpu_swiglu(b, dst, in->src, n, cols);
    else if (n > 0)
        memcpy(dst, in->src, (size_t)n * (size_t)cols * sizeof(float));
}

/* ------------------------------------------------------------------------ */
/* Embedding                                                                 */

typedef struct embed_job {
    float *out;             /* [n][cols] */
    const int32_t *tokens;  /* [n] */
    int64_t n;
    const cv_table *t;
    int simd;
    cv_rows *rows;      /* claimed in chunks (dynamic region) */
} embed_job;

static void embed_fn(void *arg, int tid, int nth) {
    const embed_job *j = arg;
    (void)tid;
    (void)nth;
    const int64_t cols = j->t->cols;
    const size_t esz = cv_dtype_size(j->t->dtype);
    for (int64_t t0, t1; cv_rows_claim(j->rows, &t0, &t1);)
    for (int64_t i = t0; i < t1; i++) {
        const char *row = (const char *)j->t->data + (size_t)j->tokens[i] * (size_t)cols * esz;
        cv_cpu_widen(j->out + (size_t)i * (size_t)cols, row, j->t->dtype, cols, j->simd);
    }
}

void cv_cpu_embedding(cv_backend *b, float *out, const int32_t *tokens, int64_t n,
                      const cv_table *table) {
    cv_cpu *c = cv_cpu_of(b);
    if (n <= 0 || table->cols <= 0) return;
    if (cv_dtype_is_quant(table->dtype)) {
        cv_cpu_qembedding(b, out, tokens, n, table);
        return;
    }
    embed_job j = {.out = out, .tokens = tokens, .n = n, .t = table, .simd = c->simd};
    int nth = cv_threads_for(c, (double)n * (double)table->cols, 4 * ROW_GRAIN);
    if (nth > n) nth = (int)n;
    cv_rows rows;
    j.rows = &rows;
    cv_cpu_run_rows(c, nth, &rows, n, embed_fn, &j);
}
