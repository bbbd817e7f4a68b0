/* AVX-512 GEMM micro-kernels (contract and reduction-order rule in
 * gemm_ukr.h), the counterparts of the AVX2 ones (avx2_gemm.c): one zmm holds the
 * 16 outputs of a panel row, and a tile is mr rows x 4 panels (64 columns):
 * up to 24 accumulators, each one output chain in k order, so FMA latency is
 * covered by columns, never by splitting k. Each k step loads 4 weight
 * vectors and broadcasts one x value per row (mr + 4 loads for 4 mr FMAs).
 * The last group's missing outputs use masks.
 *
 * Weights widened in registers: f32 as is, f16 by vcvtph2ps, bf16 (slot
 * layout: a 32-bit lane holds outputs (j, j+8)) by a zero-extension and a
 * shift, which leaves the outputs in slot order; the accumulators stay in
 * slot order and are permuted once, at load and store of c.
 *
 * AVX512_BF16: bf16 weights packed as pairs along k ([kc/2][16][2]) and
 * activations rounded to bf16 once per GEMM call and row; vdpbf16ps adds
 * two exact products per lane into fp32 accumulators (two multiply-adds per
 * lane per instruction, twice the fp32 FMA rate, half the weight bytes). */
#include <string.h>

#include "../gemm_ukr.h"

#if CV_HAVE_AVX512
CV_TARGET_AVX512_BEGIN

/* Lane l of slot order holds output l/2 (l even) or l/2 + 8 (l odd). */
static CV_ALWAYS_INLINE __m512i out_to_slot(void) {
    return _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
}
static CV_ALWAYS_INLINE __m512i slot_to_out(void) {
    return _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
}

static CV_ALWAYS_INLINE __mmask16 panel_mask(int nvalid, int q) {
    return (__mmask16)((1u << panel_valid(nvalid, q)) - 1u);
}

/* The 16 weights of panel row k (bf16: in slot order). */
static CV_ALWAYS_INLINE __m512 load_w512(const cv_dtype dt, const void *w, int64_t k) {
    if (dt == CV_F32) return _mm512_loadu_ps((const float *)w + k * CV_NR);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + k * CV_NR));
    if (dt == CV_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

/* With pf (the _pf kernels): the lines pf .. pf + 64 (pf_lines - 1) are
 * asked for into L2 at even spacing over the k steps (cv_prefetch_spread),
 * so that the next group's weights stream in while this tile computes instead
 * of a burst between calls stalling the core on full miss buffers. */
static CV_ALWAYS_INLINE void ukr_512(const int mr, const cv_dtype dt, const int packed, int64_t kc,
                                     const float *x, int64_t ldx, const void *w, size_t wstride,
                                     float *c, int64_t ldc, int nvalid, const float *bias, int load_c,
                                     const char *pf, int64_t pf_lines) {
    enum { NP = UKR_NP_AVX512(mr) };
    __m512 acc[CV_MR][NP];
    const char *wq[NP];
#pragma GCC unroll 4
    for (int q = 0; q < NP; q++) {
        wq[q] = (const char *)w + (size_t)q * wstride;
        const __mmask16 m = panel_mask(nvalid, q);
        __m512 b = bias ? _mm512_maskz_loadu_ps(m, bias + q * CV_NR) : _mm512_setzero_ps();
        if (dt == CV_BF16) b = _mm512_permutexvar_ps(out_to_slot(), b);
#pragma GCC unroll 6
        for (int i = 0; i < mr; i++) {
            __m512 a = b;
            if (load_c) {
                __m512 ci = _mm512_maskz_loadu_ps(m, c + i * ldc + q * CV_NR);
                if (dt == CV_BF16) ci = _mm512_permutexvar_ps(out_to_slot(), ci);
                a = _mm512_add_ps(ci, b);
            }
            acc[i][q] = a;
        }
    }
    cv_prefetch_spread ps = cv_prefetch_spread_of(pf, pf_lines, kc);
    for (int64_t k = 0; k < kc; k++) {
        cv_prefetch_step(&ps);
        __m512 wv[NP];
#pragma GCC unroll 4
        for (int q = 0; q < NP; q++) wv[q] = load_w512(dt, wq[q], k);
#pragma GCC unroll 6
        for (int i = 0; i < mr; i++) {
            const __m512 xb = _mm512_set1_ps(packed ? x[k * mr + i] : x[i * ldx + k]);
#pragma GCC unroll 4
            for (int q = 0; q < NP; q++) acc[i][q] = _mm512_fmadd_ps(xb, wv[q], acc[i][q]);
        }
    }
#pragma GCC unroll 4
    for (int q = 0; q < NP; q++) {
        const __mmask16 m = panel_mask(nvalid, q);
#pragma GCC unroll 6
        for (int i = 0; i < mr; i++) {
            __m512 r = acc[i][q];
            if (dt == CV_BF16) r = _mm512_permutexvar_ps(slot_to_out(), r);
            _mm512_mask_storeu_ps(c + i * ldc + q * CV_NR, m, r);
        }
    }
}

#define AVX512_UKR(MR, DT, NAME)                                                                \
    static void NAME(int64_t kc, const float *x, int64_t ldx, const void *w, size_t wstride,   \
                     float *c, int64_t ldc, int nvalid, const float *bias, int load_c) {        \
        if (ldx)                                                                                \
            ukr_512(MR, DT, 0, kc, x, ldx, w, wstride, c, ldc, nvalid, bias, load_c, NULL, 0);  \
        else                                                                                    \
            ukr_512(MR, DT, 1, kc, x, ldx, w, wstride, c, ldc, nvalid, bias, load_c, NULL, 0);  \
    }                                                                                           \
    static void NAME##_pf(int64_t kc, const float *x, int64_t ldx, const void *w, size_t wstride, \
                          float *c, int64_t ldc, int nvalid, const float *bias, int load_c,     \
                          const char *pf, int64_t pf_lines) {                                   \
        if (ldx)                                                                                \
            ukr_512(MR, DT, 0, kc, x, ldx, w, wstride, c, ldc, nvalid, bias, load_c, pf, pf_lines); \
        else                                                                                    \
            ukr_512(MR, DT, 1, kc, x, ldx, w, wstride, c, ldc, nvalid, bias, load_c, pf, pf_lines); \
    }
UKR_TABLE(AVX512_UKR, avx512_, , cv_gemm_avx512_table)
const cv_ukr_pf_fn cv_gemm_avx512_pf_table[3][CV_MR + 1] = {UKR_PF_LIST(avx512_f32_), UKR_PF_LIST(avx512_bf16_),
                                                            UKR_PF_LIST(avx512_f16_)};
CV_TARGET_END

CV_TARGET_AVX512_BF16_BEGIN
/* Pair layout: x bf16 [mr][ldx], each panel [kc/2][16][2] bf16, kc even.
 * Per k pair: 4 weight loads, mr broadcasts of (x[k], x[k+1]), 4 mr dots.
 * With pf (the _pf kernels): the lines pf .. pf + 64 (pf_lines - 1) are
 * asked for into L2 at even spacing over the k pairs (cv_prefetch_spread). */
static CV_ALWAYS_INLINE void ukr_dot(const int mr, int64_t kc, const float *xf, int64_t ldx,
                                     const void *w, size_t wstride, float *c, int64_t ldc, int nvalid,
                                     const float *bias, int load_c, const char *pf, int64_t pf_lines) {
    enum { NP = UKR_NP_AVX512(mr) };
    const uint16_t *x = (const uint16_t *)(const void *)xf;
    const int64_t kp = kc / 2; /* pairs */
    __m512 acc[CV_MR][NP];
    const uint16_t *wq[NP];
#pragma GCC unroll 4
    for (int q = 0; q < NP; q++) {
        wq[q] = (const uint16_t *)(const void *)((const char *)w + (size_t)q * wstride);
        const __mmask16 m = panel_mask(nvalid, q);
        const __m512 b = bias ? _mm512_maskz_loadu_ps(m, bias + q * CV_NR) : _mm512_setzero_ps();
#pragma GCC unroll 6
        for (int i = 0; i < mr; i++)
            acc[i][q] = load_c ? _mm512_add_ps(_mm512_maskz_loadu_ps(m, c + i * ldc + q * CV_NR), b) : b;
    }
    cv_prefetch_spread ps = cv_prefetch_spread_of(pf, pf_lines, kp);
    for (int64_t p = 0; p < kp; p++) {
        cv_prefetch_step(&ps);
        __m512i wv[NP];
#pragma GCC unroll 4
        for (int q = 0; q < NP; q++) wv[q] = _mm512_loadu_si512((const void *)(wq[q] + p * 2 * CV_NR));
#pragma GCC unroll 6
        for (int i = 0; i < mr; i++) {
            uint32_t xv; /* (x[k], x[k+1]) */
            memcpy(&xv, x + i * ldx + 2 * p, sizeof xv);
            const __m512i xb = _mm512_set1_epi32((int)xv);
#pragma GCC unroll 4
            for (int q = 0; q < NP; q++)
                acc[i][q] = _mm512_dpbf16_ps(acc[i][q], (__m512bh)xb, (__m512bh)wv[q]);
        }
    }
#pragma GCC unroll 4
    for (int q = 0; q < NP; q++) {
        const __mmask16 m = panel_mask(nvalid, q);
#pragma GCC unroll 6
        for (int i = 0; i < mr; i++) _mm512_mask_storeu_ps(c + i * ldc + q * CV_NR, m, acc[i][q]);
    }
}

#define DOT_UKR(MR, NAME)                                                                       \
    static void NAME(int64_t kc, const float *x, int64_t ldx, const void *w, size_t wstride,   \
                     float *c, int64_t ldc, int nvalid, const float *bias, int load_c) {        \
        ukr_dot(MR, kc, x, ldx, w, wstride, c, ldc, nvalid, bias, load_c, NULL, 0);             \
    }                                                                                           \
    static void NAME##_pf(int64_t kc, const float *x, int64_t ldx, const void *w, size_t wstride, \
                          float *c, int64_t ldc, int nvalid, const float *bias, int load_c,     \
                          const char *pf, int64_t pf_lines) {                                   \
        ukr_dot(MR, kc, x, ldx, w, wstride, c, ldc, nvalid, bias, load_c, pf, pf_lines);        \
    }
DOT_UKR(1, dot_1) DOT_UKR(2, dot_2) DOT_UKR(3, dot_3) DOT_UKR(4, dot_4) DOT_UKR(5, dot_5)
DOT_UKR(6, dot_6)
const cv_ukr_fn cv_gemm_bf16dot_table[CV_MR + 1] = UKR_LIST(dot_);
const cv_ukr_pf_fn cv_gemm_bf16dot_pf_table[CV_MR + 1] = {NULL, dot_1_pf, dot_2_pf, dot_3_pf, dot_4_pf, dot_5_pf,
                                                       dot_6_pf};
CV_TARGET_END
#endif
