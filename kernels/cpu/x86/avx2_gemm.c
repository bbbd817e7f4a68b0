/* AVX2 GEMM micro-kernels (contract and reduction-order rule in gemm_ukr.h):
 * two ymm hold the 16 outputs of a panel row; a tile is mr rows x
 * UKR_NP_AVX2(mr) panels, each output one FMA chain in k order. */
#include "../gemm_ukr.h"

#if CV_HAVE_AVX2
CV_TARGET_AVX2_BEGIN
/* Widens the 16 weights of panel row k into w0 (outputs 0..7) and w1 (8..15). */
static CV_ALWAYS_INLINE void load_w16(const cv_dtype dt, const void *w, int64_t k, __m256 *w0,
                                      __m256 *w1) {
    if (dt == CV_F32) {
        const float *p = (const float *)w + k * CV_NR;
        *w0 = _mm256_loadu_ps(p);
        *w1 = _mm256_loadu_ps(p + 8);
    } else if (dt == CV_BF16) {
        /* lane i holds (out i, out i+8): the low half shifted up, the high half masked */
        __m256i v = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + k * CV_NR));
        *w0 = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        *w1 = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));
    } else {
        const uint16_t *p = (const uint16_t *)w + k * CV_NR;
        *w0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
        *w1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8)));
    }
}

/* 16 values at p, of which the first nv (0..16) are read; the rest zero. */
static CV_ALWAYS_INLINE void load16_part(const float *p, int nv, __m256 *v0, __m256 *v1) {
    if (nv == CV_NR) {
        *v0 = _mm256_loadu_ps(p);
        *v1 = _mm256_loadu_ps(p + 8);
        return;
    }
    float t[CV_NR] = {0};
    for (int j = 0; j < nv; j++) t[j] = p[j];
    *v0 = _mm256_loadu_ps(t);
    *v1 = _mm256_loadu_ps(t + 8);
}

/* mr rows x np panels, one accumulator chain per output (gemm_ukr.h). With
 * pf (the _pf kernels), the lines pf .. pf + 64 (pf_lines - 1) are asked for
 * into L2, spread over the k steps (cv_prefetch_spread). */
static CV_ALWAYS_INLINE void ukr_avx2(const int mr, const int np, const cv_dtype dt, const int packed,
                                      int64_t kc, const float *x, int64_t ldx, const void *w,
                                      size_t wstride, float *c, int64_t ldc, int nvalid,
                                      const float *bias, int load_c, const char *pf, int64_t pf_lines) {
    __m256 acc[CV_MR][CV_GROUP][2];
#pragma GCC unroll 4
    for (int q = 0; q < np; q++) {
        const int nv = panel_valid(nvalid, q);
        __m256 b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps();
        if (bias) load16_part(bias + q * CV_NR, nv, &b0, &b1);
#pragma GCC unroll 6
        for (int i = 0; i < mr; i++) {
            if (load_c) {
                __m256 c0, c1;
                load16_part(c + i * ldc + q * CV_NR, nv, &c0, &c1);
                acc[i][q][0] = _mm256_add_ps(c0, b0);
                acc[i][q][1] = _mm256_add_ps(c1, b1);
            } else {
                acc[i][q][0] = b0;
                acc[i][q][1] = b1;
            }
        }
    }
    cv_prefetch_spread ps = cv_prefetch_spread_of(pf, pf_lines, kc);
    for (int64_t k = 0; k < kc; k++) {
        cv_prefetch_step(&ps);
        __m256 w0[CV_GROUP], w1[CV_GROUP];
#pragma GCC unroll 4
        for (int q = 0; q < np; q++) load_w16(dt, (const char *)w + (size_t)q * wstride, k, &w0[q], &w1[q]);
#pragma GCC unroll 6
        for (int i = 0; i < mr; i++) {
            const __m256 xb = _mm256_broadcast_ss(packed ? x + k * mr + i : x + i * ldx + k);
#pragma GCC unroll 4
            for (int q = 0; q < np; q++) {
                acc[i][q][0] = _mm256_fmadd_ps(xb, w0[q], acc[i][q][0]);
                acc[i][q][1] = _mm256_fmadd_ps(xb, w1[q], acc[i][q][1]);
            }
        }
    }
#pragma GCC unroll 4
    for (int q = 0; q < np; q++) {
        const int nv = panel_valid(nvalid, q);
#pragma GCC unroll 6
        for (int i = 0; i < mr; i++) {
            float *ci = c + i * ldc + q * CV_NR;
            if (nv == CV_NR) {
                _mm256_storeu_ps(ci, acc[i][q][0]);
                _mm256_storeu_ps(ci + 8, acc[i][q][1]);
            } else {
                float t[CV_NR];
                _mm256_storeu_ps(t, acc[i][q][0]);
                _mm256_storeu_ps(t + 8, acc[i][q][1]);
                for (int j = 0; j < nv; j++) ci[j] = t[j];
            }
        }
    }
}

#define AVX_UKR(MR, DT, NAME)                                                                   \
    static void NAME##_pf(int64_t kc, const float *x, int64_t ldx, const void *w, size_t wstride, \
                          float *c, int64_t ldc, int nvalid, const float *bias, int load_c,     \
                          const char *pf, int64_t pf_lines) {                                   \
        if (ldx)                                                                                \
            ukr_avx2(MR, UKR_NP_AVX2(MR), DT, 0, kc, x, ldx, w, wstride, c, ldc, nvalid, bias, load_c, pf, \
                     pf_lines);                                                                 \
        else                                                                                    \
            ukr_avx2(MR, UKR_NP_AVX2(MR), DT, 1, kc, x, ldx, w, wstride, c, ldc, nvalid, bias, load_c, pf, \
                     pf_lines);                                                                 \
    }                                                                                           \
    static void NAME(int64_t kc, const float *x, int64_t ldx, const void *w, size_t wstride,   \
                     float *c, int64_t ldc, int nvalid, const float *bias, int load_c) {        \
        if (ldx)                                                                                \
            ukr_avx2(MR, UKR_NP_AVX2(MR), DT, 0, kc, x, ldx, w, wstride, c, ldc, nvalid, bias, load_c, NULL, 0); \
        else                                                                                    \
            ukr_avx2(MR, UKR_NP_AVX2(MR), DT, 1, kc, x, ldx, w, wstride, c, ldc, nvalid, bias, load_c, NULL, 0); \
    }
UKR_TABLE(AVX_UKR, avx_, , cv_gemm_avx2_table)
const cv_ukr_pf_fn cv_gemm_avx2_pf_table[3][CV_MR + 1] = {UKR_PF_LIST(avx_f32_), UKR_PF_LIST(avx_bf16_),
                                                          UKR_PF_LIST(avx_f16_)};
CV_TARGET_END
#endif
