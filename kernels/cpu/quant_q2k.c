/* GGUF's Q2_K computed as stored (quant_format.h has the layout; quant.h the
 * tile contract), on AVX2: every SIMD level takes these tiles for Q2_K.
 *
 * Per 32-element activation block of a super-block, the weights are bits
 * 2k, 2k+1 of 32 qs bytes (u8 0..3); vpmaddubsw with the int8 activations
 * gives pair sums (at most 3 * 127 * 2), vpmaddwd with the sub-blocks'
 * 4-bit scales as int16 (eight lanes of sc0, then eight of sc1) gives eight
 * int32 lanes of sc * dot (lanes 0..3 the first 16 elements, 4..7 the
 * others); the same with a vector of ones for the activations and the mins
 * gives mn * sum(x). Both integers are exact (< 2^24), so the float work per
 * (row, token) is, over the blocks i in order,
 *   acc = fma(float(A_i), d * dx_i, acc),  accm = fma(float(M_i), dmin * dx_i, accm)
 * then hsum8(acc) - hsum8(accm): the same operations whatever the tile, so a
 * token's outputs are the same bits alone or in any batch. A tile is one row
 * and 1..4 tokens (the row's bytes are unpacked once per block for them). */
#include "quant.h"

#if CV_HAVE_AVX2

#ifdef CV_EMULATE_AVX512 /* portable intrinsics (tools/avx512_emulated.sh): no target */
#define Q2_ATTR
#else
#define Q2_ATTR __attribute__((target("avx2,fma,f16c")))
#endif

Q2_ATTR static inline __attribute__((always_inline)) float q2k_hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

Q2_ATTR static inline __attribute__((always_inline)) void q2k_tile(const void *w, const cv_xq_block *x,
                                                                   int64_t x_stride, int64_t nb, int T,
                                                                   float *out) {
    const cv_block_q2_k *b = w;
    const __m256i three = _mm256_set1_epi8(3), ones = _mm256_set1_epi8(1);
    __m256 acc[CV_QTILE_MAX_TOKENS], accm[CV_QTILE_MAX_TOKENS];
    for (int t = 0; t < T; t++) acc[t] = accm[t] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < nb / 8; sb++) {
        const cv_block_q2_k *s = b + sb;
        uint16_t dh, dminh;
        memcpy(&dh, &s->d, 2);
        memcpy(&dminh, &s->dmin, 2);
        const float d = cv_qh_to_f32(dh), dmin = cv_qh_to_f32(dminh);
        const __m128i sv = _mm_loadu_si128((const __m128i *)s->scales);
        const __m128i sc = _mm_and_si128(sv, _mm_set1_epi8(0x0f));
        const __m128i mn = _mm_and_si128(_mm_srli_epi16(sv, 4), _mm_set1_epi8(0x0f));
        for (int h = 0; h < 2; h++) {
            const __m256i qv = _mm256_loadu_si256((const __m256i *)(s->qs + 32 * h));
            for (int k = 0; k < 4; k++) {
                const int64_t i = sb * 8 + 4 * h + k;
                const int j = 8 * h + 2 * k; /* the block's two sub-blocks: j and j + 1 */
                const __m256i wq = _mm256_and_si256(_mm256_srli_epi16(qv, 2 * k), three);
                const __m128i sel = _mm_setr_epi8((char)j, (char)j, (char)j, (char)j, (char)j, (char)j, (char)j,
                                                  (char)j, (char)(j + 1), (char)(j + 1), (char)(j + 1),
                                                  (char)(j + 1), (char)(j + 1), (char)(j + 1), (char)(j + 1),
                                                  (char)(j + 1));
                const __m256i sc16 = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(sc, sel));
                const __m256i mn16 = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(mn, sel));
                for (int t = 0; t < T; t++) {
                    const cv_xq_block *xb = x + (int64_t)t * x_stride + i;
                    const __m256i xv = _mm256_loadu_si256((const __m256i *)xb->q);
                    const __m256i a = _mm256_madd_epi16(_mm256_maddubs_epi16(wq, xv), sc16);
                    const __m256i m = _mm256_madd_epi16(_mm256_maddubs_epi16(ones, xv), mn16);
                    acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_set1_ps(d * xb->d), acc[t]);
                    accm[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(m), _mm256_set1_ps(dmin * xb->d), accm[t]);
                }
            }
        }
    }
    for (int t = 0; t < T; t++) out[t] = q2k_hsum8(acc[t]) - q2k_hsum8(accm[t]);
}

#define Q2K_TILE(T)                                                                                          \
    Q2_ATTR static void q2k_tile_##T(const void *w, size_t w_stride, const cv_xq_block *x, int64_t x_stride, \
                                     int64_t nb, float *out) {                                               \
        (void)w_stride;                                                                                      \
        q2k_tile(w, x, x_stride, nb, T, out);                                                                \
    }
Q2K_TILE(1)
Q2K_TILE(2)
Q2K_TILE(3)
Q2K_TILE(4)

int cv_qtiles_q2k(cv_qtiles *out) {
    const cv_cpu_features *f = cv_cpu_features_get();
#ifndef CV_EMULATE_AVX512
    if (!(f->avx2 && f->fma && f->f16c)) return 0;
#else
    (void)f;
#endif
    *out = (cv_qtiles){.max_tokens = 4,
                       .rows = {0, 1, 1, 1, 1},
                       .tile = {NULL, q2k_tile_1, q2k_tile_2, q2k_tile_3, q2k_tile_4},
                       .row = {NULL, q2k_tile_1, q2k_tile_2, q2k_tile_3, q2k_tile_4}};
    return 1;
}

#else
int cv_qtiles_q2k(cv_qtiles *out) {
    (void)out;
    return 0;
}
#endif
