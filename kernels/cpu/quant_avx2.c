/* AVX2 dot products of quantized weight rows with int8 activations
 * (quant.h): vpmaddubsw (u8 x s8 -> s16 pairs) then vpmaddwd (-> s32), with
 * the sign trick for signed weights (|w| x sign(x, w)). Per-function target
 * attributes: this file builds without -mavx2 and runs only where the CPU has
 * AVX2/FMA/F16C (cv_qlevel_supported). */
#include "quant.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#define AVX2_TARGET __attribute__((target("avx2,fma,f16c")))

AVX2_TARGET static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 32 nibbles (element j low, j + 16 high) as bytes 0..15 in element order. */
AVX2_TARGET static inline __m256i unpack_nibbles(const uint8_t *qs) {
    const __m128i b = _mm_loadu_si128((const __m128i *)qs), m = _mm_set1_epi8(0x0f);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m), _mm_and_si128(b, m));
}

/* sum of u8 a x s8 b in 8 int32 lanes, as floats */
AVX2_TARGET static inline __m256 dot_us(__m256i a, __m256i b) {
    const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1));
    return _mm256_cvtepi32_ps(p);
}

AVX2_TARGET static float dot_q8_0(const void *w, const cv_xq_block *x, int64_t nb) {
    const cv_block_q8_0 *b = w;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)b[i].qs);
        const __m256i v = _mm256_loadu_si256((const __m256i *)x[i].q);
        const __m256 d = _mm256_set1_ps(_cvtsh_ss(b[i].d) * x[i].d);
        acc = _mm256_fmadd_ps(dot_us(_mm256_sign_epi8(q, q), _mm256_sign_epi8(v, q)), d, acc);
    }
    return hsum8(acc);
}

AVX2_TARGET static float dot_q4_0(const void *w, const cv_xq_block *x, int64_t nb) {
    const cv_block_q4_0 *b = w;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        const __m256i q = _mm256_sub_epi8(unpack_nibbles(b[i].qs), _mm256_set1_epi8(8));
        const __m256i v = _mm256_loadu_si256((const __m256i *)x[i].q);
        const __m256 d = _mm256_set1_ps(_cvtsh_ss(b[i].d) * x[i].d);
        acc = _mm256_fmadd_ps(dot_us(_mm256_sign_epi8(q, q), _mm256_sign_epi8(v, q)), d, acc);
    }
    return hsum8(acc);
}

AVX2_TARGET static float dot_q4_1(const void *w, const cv_xq_block *x, int64_t nb) {
    const cv_block_q4_1 *b = w;
    __m256 acc = _mm256_setzero_ps();
    float mins = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        const __m256i q = unpack_nibbles(b[i].qs);
        const __m256i v = _mm256_loadu_si256((const __m256i *)x[i].q);
        const __m256 d = _mm256_set1_ps(_cvtsh_ss(b[i].d) * x[i].d);
        acc = _mm256_fmadd_ps(dot_us(q, v), d, acc);
        mins += _cvtsh_ss(b[i].m) * x[i].s;
    }
    return hsum8(acc) + mins;
}

/* Four tokens per weight block: the per-token operations are exactly those of
 * the dots above (same order), so the results are the same bits. */
AVX2_TARGET static void dot4_q8_0(const void *w, const cv_xq_block *x, int64_t xs, int64_t nb, float *out) {
    const cv_block_q8_0 *b = w;
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t i = 0; i < nb; i++) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)b[i].qs), aq = _mm256_sign_epi8(q, q);
        const float dw = _cvtsh_ss(b[i].d);
        for (int t = 0; t < 4; t++) {
            const cv_xq_block *xt = x + t * xs + i;
            const __m256i v = _mm256_loadu_si256((const __m256i *)xt->q);
            acc[t] = _mm256_fmadd_ps(dot_us(aq, _mm256_sign_epi8(v, q)), _mm256_set1_ps(dw * xt->d), acc[t]);
        }
    }
    for (int t = 0; t < 4; t++) out[t] = hsum8(acc[t]);
}

AVX2_TARGET static void dot4_q4_0(const void *w, const cv_xq_block *x, int64_t xs, int64_t nb, float *out) {
    const cv_block_q4_0 *b = w;
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t i = 0; i < nb; i++) {
        const __m256i q = _mm256_sub_epi8(unpack_nibbles(b[i].qs), _mm256_set1_epi8(8)), aq = _mm256_sign_epi8(q, q);
        const float dw = _cvtsh_ss(b[i].d);
        for (int t = 0; t < 4; t++) {
            const cv_xq_block *xt = x + t * xs + i;
            const __m256i v = _mm256_loadu_si256((const __m256i *)xt->q);
            acc[t] = _mm256_fmadd_ps(dot_us(aq, _mm256_sign_epi8(v, q)), _mm256_set1_ps(dw * xt->d), acc[t]);
        }
    }
    for (int t = 0; t < 4; t++) out[t] = hsum8(acc[t]);
}

AVX2_TARGET static void dot4_q4_1(const void *w, const cv_xq_block *x, int64_t xs, int64_t nb, float *out) {
    const cv_block_q4_1 *b = w;
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    float mins[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int64_t i = 0; i < nb; i++) {
        const __m256i q = unpack_nibbles(b[i].qs);
        const float dw = _cvtsh_ss(b[i].d), mw = _cvtsh_ss(b[i].m);
        for (int t = 0; t < 4; t++) {
            const cv_xq_block *xt = x + t * xs + i;
            const __m256i v = _mm256_loadu_si256((const __m256i *)xt->q);
            acc[t] = _mm256_fmadd_ps(dot_us(q, v), _mm256_set1_ps(dw * xt->d), acc[t]);
            mins[t] += mw * xt->s;
        }
    }
    for (int t = 0; t < 4; t++) out[t] = hsum8(acc[t]) + mins[t];
}

cv_qdot_fn cv_qdot_avx2(cv_dtype t) {
    return t == CV_Q8_0 ? dot_q8_0 : t == CV_Q4_0 ? dot_q4_0 : t == CV_Q4_1 ? dot_q4_1 : NULL;
}

cv_qdot4_fn cv_qdot4_avx2(cv_dtype t) {
    return t == CV_Q8_0 ? dot4_q8_0 : t == CV_Q4_0 ? dot4_q4_0 : t == CV_Q4_1 ? dot4_q4_1 : NULL;
}

#else
cv_qdot_fn cv_qdot_avx2(cv_dtype t) {
    (void)t;
    return NULL;
}

cv_qdot4_fn cv_qdot4_avx2(cv_dtype t) {
    (void)t;
    return NULL;
}
#endif
