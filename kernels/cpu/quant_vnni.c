/* VNNI dot products of quantized weight rows with int8 activations
 * (quant.h): vpdpbusd (u8 x s8, four products summed into each s32 lane) on
 * ymm registers, once with the EVEX encoding (AVX512-VNNI + VL) and once with
 * the VEX one (AVX-VNNI, e.g. Alder Lake). Built with per-function target
 * attributes; chosen at run time only where the CPU has them. */
#include "quant.h"

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__) && \
    (__GNUC__ >= 11 || (defined(__clang_major__) && __clang_major__ >= 12))
#include <immintrin.h>

#define CV_QUANT_VNNI_BUILT 1

/* One set of dots per encoding; DPBUSD(acc, u8, s8) is the accumulate. */
#define VNNI_DOTS(SUFFIX, TARGET, DPBUSD)                                                          \
    __attribute__((target(TARGET))) static inline float hsum8_##SUFFIX(__m256 v) {                 \
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));             \
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));                                                   \
        s = _mm_add_ss(s, _mm_movehdup_ps(s));                                                    \
        return _mm_cvtss_f32(s);                                                                  \
    }                                                                                             \
    __attribute__((target(TARGET))) static inline __m256i nibbles_##SUFFIX(const uint8_t *qs) {    \
        const __m128i b = _mm_loadu_si128((const __m128i *)qs), m = _mm_set1_epi8(0x0f);           \
        return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m), _mm_and_si128(b, m));     \
    }                                                                                             \
    __attribute__((target(TARGET))) static float dot_q8_0_##SUFFIX(const void *w, const cv_xq_block *x, \
                                                                  int64_t nb) {                   \
        const cv_block_q8_0 *b = w;                                                               \
        __m256 acc = _mm256_setzero_ps();                                                         \
        for (int64_t i = 0; i < nb; i++) {                                                        \
            const __m256i q = _mm256_loadu_si256((const __m256i *)b[i].qs);                        \
            const __m256i v = _mm256_loadu_si256((const __m256i *)x[i].q);                         \
            const __m256i p = DPBUSD(_mm256_setzero_si256(), _mm256_sign_epi8(q, q), _mm256_sign_epi8(v, q)); \
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(_cvtsh_ss(b[i].d) * x[i].d), acc); \
        }                                                                                         \
        return hsum8_##SUFFIX(acc);                                                               \
    }                                                                                             \
    __attribute__((target(TARGET))) static float dot_q4_0_##SUFFIX(const void *w, const cv_xq_block *x, \
                                                                  int64_t nb) {                   \
        const cv_block_q4_0 *b = w;                                                               \
        __m256 acc = _mm256_setzero_ps();                                                         \
        for (int64_t i = 0; i < nb; i++) {                                                        \
            const __m256i q = _mm256_sub_epi8(nibbles_##SUFFIX(b[i].qs), _mm256_set1_epi8(8));     \
            const __m256i v = _mm256_loadu_si256((const __m256i *)x[i].q);                         \
            const __m256i p = DPBUSD(_mm256_setzero_si256(), _mm256_sign_epi8(q, q), _mm256_sign_epi8(v, q)); \
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(_cvtsh_ss(b[i].d) * x[i].d), acc); \
        }                                                                                         \
        return hsum8_##SUFFIX(acc);                                                               \
    }                                                                                             \
    __attribute__((target(TARGET))) static float dot_q4_1_##SUFFIX(const void *w, const cv_xq_block *x, \
                                                                  int64_t nb) {                   \
        const cv_block_q4_1 *b = w;                                                               \
        __m256 acc = _mm256_setzero_ps();                                                         \
        float mins = 0.0f;                                                                        \
        for (int64_t i = 0; i < nb; i++) {                                                        \
            const __m256i v = _mm256_loadu_si256((const __m256i *)x[i].q);                         \
            const __m256i p = DPBUSD(_mm256_setzero_si256(), nibbles_##SUFFIX(b[i].qs), v);        \
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(_cvtsh_ss(b[i].d) * x[i].d), acc); \
            mins += _cvtsh_ss(b[i].m) * x[i].s;                                                    \
        }                                                                                         \
        return hsum8_##SUFFIX(acc) + mins;                                                        \
    }

VNNI_DOTS(evex, "avx2,fma,f16c,avx512f,avx512vl,avx512vnni", _mm256_dpbusd_epi32)
VNNI_DOTS(vex, "avx2,fma,f16c,avxvnni", _mm256_dpbusd_avx_epi32)

cv_qdot_fn cv_qdot_vnni(cv_dtype t, int avx512) {
    if (avx512) return t == CV_Q8_0 ? dot_q8_0_evex : t == CV_Q4_0 ? dot_q4_0_evex : t == CV_Q4_1 ? dot_q4_1_evex : NULL;
    return t == CV_Q8_0 ? dot_q8_0_vex : t == CV_Q4_0 ? dot_q4_0_vex : t == CV_Q4_1 ? dot_q4_1_vex : NULL;
}

#else
cv_qdot_fn cv_qdot_vnni(cv_dtype t, int avx512) {
    (void)t;
    (void)avx512;
    return NULL;
}
#endif
