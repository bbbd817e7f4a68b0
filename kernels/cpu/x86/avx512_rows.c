/* AVX-512 row kernels: RMSNorm and SwiGLU rows, float16/bfloat16
 * conversions, a RoPE head and the int8 KV row; the AVX2 ones (x86/avx2_rows.c)
 * 16 wide, tails by masks. Each gives the bits its plain counterpart's order
 * of operations gives at this level, whichever caller runs it. */
#include <math.h>

#include "kernels.h"
#include "vec_math.h"

#if CV_HAVE_AVX512
CV_TARGET_AVX512_BEGIN
void cv_rms_row_avx512(float *out, const float *x, const float *w, int64_t dim, float eps) {
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

int64_t cv_swiglu_part_avx512(float *o, const float *g, const float *u, int64_t dim) {
    swiglu_row_avx512(o, g, u, dim);
    return dim;
}

static void widen_avx512(float *dst, const uint16_t *s, cv_dtype dt, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = cv_tail_mask16(n - i);
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
        const __mmask16 m = cv_tail_mask16(n - i);
        const __m512 v = _mm512_maskz_loadu_ps(m, src + i);
        const __m256i h = dt == CV_BF16 ? f32_to_bf16_16(v) : _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT);
        _mm256_mask_storeu_epi16(d + i, m, h);
    }
}

int64_t cv_widen_part_avx512(float *dst, const uint16_t *s, cv_dtype dt, int64_t n) {
    widen_avx512(dst, s, dt, n);
    return n;
}

int64_t cv_narrow_part_avx512(uint16_t *d, cv_dtype dt, const float *src, int64_t n) {
    narrow_avx512(d, dt, src, n);
    return n;
}

/* As cv_rope_head_avx2 (cs2/sn2 for PAIRS), 16 lanes. */
void cv_rope_head_avx512(float *x, int64_t hd, cv_rope_layout layout, int64_t i0, int64_t m,
                         const float *cs, const float *sn, const float *cs2, const float *sn2) {
    if (layout == CV_ROPE_HALVES) {
        float *xa = x + i0, *xb = x + i0 + hd / 2;
        for (int64_t i = 0; i < m; i += 16) {
            const __mmask16 k = cv_tail_mask16(m - i);
            const __m512 a = _mm512_maskz_loadu_ps(k, xa + i), bb = _mm512_maskz_loadu_ps(k, xb + i);
            const __m512 c = _mm512_maskz_loadu_ps(k, cs + i), s = _mm512_maskz_loadu_ps(k, sn + i);
            _mm512_mask_storeu_ps(xa + i, k, _mm512_fmsub_ps(a, c, _mm512_mul_ps(bb, s)));
            _mm512_mask_storeu_ps(xb + i, k, _mm512_fmadd_ps(bb, c, _mm512_mul_ps(a, s)));
        }
    } else {
        float *xp = x + 2 * i0;
        for (int64_t i = 0; i < 2 * m; i += 16) { /* 8 pairs per vector */
            const __mmask16 k = cv_tail_mask16(2 * m - i);
            const __m512 v = _mm512_maskz_loadu_ps(k, xp + i);
            const __m512 sw = _mm512_permute_ps(v, 0xB1); /* (b, a) per pair */
            _mm512_mask_storeu_ps(xp + i, k, _mm512_fmadd_ps(v, _mm512_maskz_loadu_ps(k, cs2 + i),
                                                             _mm512_mul_ps(sw, _mm512_maskz_loadu_ps(k, sn2 + i))));
        }
    }
}

/* The int8 KV row of kv_write.c, 16 lanes at a time (the same bits). */
void cv_kv_quantize_i8_avx512(int8_t *dst, float *scale, const float *x, int64_t hd) {
    __m512 vmax = _mm512_setzero_ps();
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (int64_t d = 0; d < hd; d += 16) {
        const __m512 a = _mm512_andnot_ps(sign, _mm512_maskz_loadu_ps(cv_tail_mask16(hd - d), x + d));
        vmax = _mm512_max_ps(a, vmax); /* a NaN lane keeps vmax (the second operand), as the plain loop does */
    }
    const float amax = _mm512_reduce_max_ps(vmax);
    const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
    *scale = amax / 127.0f;
    const __m512 vid = _mm512_set1_ps(id), hi = _mm512_set1_ps(127.0f), lo = _mm512_set1_ps(-127.0f);
    const __m512 magic = _mm512_set1_ps(12582912.0f);
    for (int64_t d = 0; d < hd; d += 16) {
        const __mmask16 m = cv_tail_mask16(hd - d);
        __m512 r = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + d), vid);
        r = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(r, hi, _CMP_GT_OQ), r, hi);
        r = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(r, lo, _CMP_LT_OQ), r, lo);
        r = _mm512_sub_ps(_mm512_add_ps(r, magic), magic);
        const __mmask16 num = _mm512_cmp_ps_mask(r, r, _CMP_ORD_Q); /* a NaN becomes 0 */
        const __m512i q = _mm512_maskz_cvtps_epi32(num, r);
        _mm_mask_storeu_epi8(dst + d, m, _mm512_cvtepi32_epi8(q));
    }
}
CV_TARGET_END
#endif
