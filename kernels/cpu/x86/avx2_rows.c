/* AVX2 row kernels: RMSNorm rows, the 8-wide parts of SwiGLU and GeGLU rows
 * and of float16/bfloat16 conversions (the plain code finishes the row), and a
 * RoPE head. */
#include <math.h>

#include "kernels.h"
#include "vec_math.h"

#if CV_HAVE_AVX2
CV_TARGET_AVX2_BEGIN
void cv_rms_row_avx2(float *out, const float *x, const float *w, int64_t dim, float eps) {
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

/* The 8-wide part of a gated row, x / (1 + exp(z)) * u with z = -x (SwiGLU)
 * or -2 sqrt(2/pi) (x + 0.044715 x^3) (GeGLU); returns the count done. */
static CV_ALWAYS_INLINE int64_t gated_row_avx2(float *o, const float *g, const float *u, int64_t dim,
                                               const int gelu) {
    const __m256 one = _mm256_set1_ps(1.0f), k2 = _mm256_set1_ps(-2.0f * CV_GELU_K), c = _mm256_set1_ps(CV_GELU_C);
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
int64_t cv_swiglu_part_avx2(float *o, const float *g, const float *u, int64_t dim) {
    return gated_row_avx2(o, g, u, dim, 0);
}
int64_t cv_geglu_part_avx2(float *o, const float *g, const float *u, int64_t dim) {
    return gated_row_avx2(o, g, u, dim, 1);
}

/* The 8-wide part of cv_cpu_widen from a 16-bit dtype; returns the count done. */
int64_t cv_widen_part_avx2(float *dst, const uint16_t *s, cv_dtype dt, int64_t n) {
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
int64_t cv_narrow_part_avx2(uint16_t *d, cv_dtype dt, const float *src, int64_t n) {
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

/* cs2/sn2[2m] hold, for PAIRS, (c, c) and (-s, s) per frequency. */
void cv_rope_head_avx2(float *x, int64_t hd, cv_rope_layout layout, int64_t i0, int64_t m,
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
