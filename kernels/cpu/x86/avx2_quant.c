/* The AVX2 quantized micro-kernels (quant_ukr.h, quant_tile.h): the block dot is
 * vpmaddubsw (u8 x s8 -> s16 pairs) then vpmaddwd (-> s32), with the sign
 * trick for signed weights (|w| x sign(x, w)); no pair saturates (|w| <= 128,
 * |x| <= 127). Per-function target attributes: this file builds without
 * -mavx2 and runs only where the CPU has AVX2/FMA/F16C (cv_qlevel_supported). */
#include "../quant_ukr.h"

#if CV_HAVE_AVX2

#define QT_TARGET "avx2,fma,f16c"
#define QT_NAME(name) name##_avx2
#define QT_DOT(a, b) _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1))
#include "quant_tile.h"

int cv_qtiles_avx2(cv_dtype t, cv_qtiles *out) {
    const cv_qtiles *k = qtiles_for_avx2(t);
    if (k) *out = *k;
    return k != NULL;
}

/* cv_quantize_x, 32 activations at a time, the same bytes: the same float
 * products v * (1/d), rounded half away from zero exactly (floor of |t|, plus
 * one where the exact fraction is >= 0.5, the sign put back). */
#ifdef CV_EMULATE_AVX512
#define QX_TARGET
#else
#define QX_TARGET __attribute__((target(QT_TARGET)))
#endif
QX_TARGET static void quantize_x_avx2(cv_xq_block *out, const float *x, int64_t n) {
    const __m256 sign = _mm256_set1_ps(-0.0f), half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.0f);
    for (int64_t i = 0; i < n / CV_QK; i++) {
        const float *v = x + i * CV_QK;
        __m256 a[4], m = _mm256_setzero_ps();
        for (int k = 0; k < 4; k++) {
            a[k] = _mm256_loadu_ps(v + 8 * k);
            m = _mm256_max_ps(_mm256_andnot_ps(sign, a[k]), m); /* a NaN lane is skipped, as in C */
        }
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        const float amax = _mm_cvtss_f32(h), d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        __m256i q[4], sum = _mm256_setzero_si256();
        for (int k = 0; k < 4; k++) {
            const __m256 t = _mm256_mul_ps(a[k], _mm256_set1_ps(id)), u = _mm256_andnot_ps(sign, t);
            const __m256 f = _mm256_floor_ps(u);
            const __m256 r = _mm256_add_ps(f, _mm256_and_ps(_mm256_cmp_ps(_mm256_sub_ps(u, f), half, _CMP_GE_OQ), one));
            q[k] = _mm256_cvtps_epi32(_mm256_or_ps(r, _mm256_and_ps(t, sign)));
            sum = _mm256_add_epi32(sum, q[k]);
        }
        const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        _mm256_storeu_si256((__m256i *)out[i].q, _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
        s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
        out[i].d = d;
        out[i].sum = _mm_cvtsi128_si32(s);
        out[i].s = d * (float)out[i].sum;
    }
}

cv_quantize_x_fn cv_quantize_x_avx2(void) {
    return quantize_x_avx2;
}

#else
int cv_qtiles_avx2(cv_dtype t, cv_qtiles *out) {
    (void)t;
    (void)out;
    return 0;
}

cv_quantize_x_fn cv_quantize_x_avx2(void) {
    return NULL;
}
#endif
