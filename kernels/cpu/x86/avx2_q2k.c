/* GGUF's Q2_K computed as stored, and Q8_M (quant_format.h has the layouts;
 * quant_ukr.h the tile contract), on AVX2: every SIMD level takes these tiles.
 *
 * Per 32-element activation block of a super-block, the weights are bits
 * 2k, 2k+1 of 32 qs bytes (u8 0..3); vpmaddubsw with the int8 activations
 * gives pair sums (at most 3 * 127 * 2), vpmaddwd with the sub-blocks'
 * 4-bit scales as int16 (eight lanes of sc0, then eight of sc1) gives eight
 * int32 lanes of sc * dot (lanes 0..3 the first 16 elements, 4..7 the
 * others); vpmaddubsw of ones and the activations, then vpmaddwd with the
 * mins, gives mn * sum(x) the same way. Both integers are exact (< 2^24), so
 * the float work per (row, token) is, over the blocks i in order,
 *   v = float(A_i) * d - float(M_i) * dmin  (fmsub),  acc = fma(v, dx_i, acc)
 * then hsum8(acc): the same operations whatever the tile, so a token's
 * outputs are the same bits alone or in any batch. Tiles: 4 rows x 1 token
 * (decode: four rows' weights streamed at once, the token's activation work
 * shared), 2 x 2, and 1 x 1..4; a row's bytes are unpacked once per block
 * for its tokens. */
#include "../quant_ukr.h"

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

/* vpshufb controls: for block b of a super-block, int16 lanes 0..7 take byte
 * 2b of the (broadcast) scale bytes and lanes 8..15 byte 2b + 1. */
static const uint8_t Q2K_PICK[8][32] __attribute__((aligned(32))) = {
#define Q2K_P(j) j, 0x80, j, 0x80, j, 0x80, j, 0x80, j, 0x80, j, 0x80, j, 0x80, j, 0x80
    {Q2K_P(0), Q2K_P(1)},   {Q2K_P(2), Q2K_P(3)},   {Q2K_P(4), Q2K_P(5)},   {Q2K_P(6), Q2K_P(7)},
    {Q2K_P(8), Q2K_P(9)},   {Q2K_P(10), Q2K_P(11)}, {Q2K_P(12), Q2K_P(13)}, {Q2K_P(14), Q2K_P(15)},
#undef Q2K_P
};

/* R rows (w_stride bytes apart) x T tokens (x_stride blocks apart). Per block
 * i and pair: v = float(A_i) * d - float(M_i) * dmin (one rounding: fmsub of
 * the product float(M_i) * dmin), then acc = fma(v, dx_i, acc); at the end
 * hsum8(acc). The same operations for a pair whatever R and T. */
Q2_ATTR static inline __attribute__((always_inline)) void q2k_tile(const void *w, size_t w_stride,
                                                                   const cv_xq_block *x, int64_t x_stride,
                                                                   int64_t nb, int R, int T, float *out) {
    const __m256i three = _mm256_set1_epi8(3), ones = _mm256_set1_epi8(1), low4 = _mm256_set1_epi8(0x0f);
    __m256 acc[4][CV_QTILE_MAX_TOKENS];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) acc[r][t] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < nb / 8; sb++) {
        const cv_block_q2_k *s[4];
        __m256i sc[4], mn[4];
        __m256 dv[4], dminv[4];
        for (int r = 0; r < R; r++) {
            s[r] = (const cv_block_q2_k *)((const char *)w + (size_t)r * w_stride) + sb;
            _mm_prefetch((const char *)(s[r] + 2), _MM_HINT_T0);
            uint16_t dh, dminh;
            memcpy(&dh, &s[r]->d, 2);
            memcpy(&dminh, &s[r]->dmin, 2);
            dv[r] = _mm256_set1_ps(cv_qh_to_f32(dh));
            dminv[r] = _mm256_set1_ps(cv_qh_to_f32(dminh));
            const __m256i sv = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)s[r]->scales));
            sc[r] = _mm256_and_si256(sv, low4);
            mn[r] = _mm256_and_si256(_mm256_srli_epi16(sv, 4), low4);
        }
        for (int h = 0; h < 2; h++) {
            __m256i qv[4];
            for (int r = 0; r < R; r++) qv[r] = _mm256_loadu_si256((const __m256i *)(s[r]->qs + 32 * h));
            for (int k = 0; k < 4; k++) {
                const int64_t i = sb * 8 + 4 * h + k;
                const __m256i pick = _mm256_load_si256((const __m256i *)Q2K_PICK[4 * h + k]);
                __m256i xv[CV_QTILE_MAX_TOKENS], xs[CV_QTILE_MAX_TOKENS];
                __m256 dx[CV_QTILE_MAX_TOKENS];
                for (int t = 0; t < T; t++) {
                    const cv_xq_block *xb = x + (int64_t)t * x_stride + i;
                    xv[t] = _mm256_loadu_si256((const __m256i *)xb->q);
                    xs[t] = _mm256_maddubs_epi16(ones, xv[t]); /* pair sums of the activations */
                    dx[t] = _mm256_set1_ps(xb->d);
                }
                for (int r = 0; r < R; r++) {
                    const __m256i wq = _mm256_and_si256(_mm256_srli_epi16(qv[r], 2 * k), three);
                    const __m256i sc16 = _mm256_shuffle_epi8(sc[r], pick), mn16 = _mm256_shuffle_epi8(mn[r], pick);
                    for (int t = 0; t < T; t++) {
                        const __m256i a = _mm256_madd_epi16(_mm256_maddubs_epi16(wq, xv[t]), sc16);
                        const __m256i m = _mm256_madd_epi16(xs[t], mn16);
                        const __m256 v = _mm256_fmsub_ps(_mm256_cvtepi32_ps(a), dv[r],
                                                         _mm256_mul_ps(_mm256_cvtepi32_ps(m), dminv[r]));
                        acc[r][t] = _mm256_fmadd_ps(v, dx[t], acc[r][t]);
                    }
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) out[r * T + t] = q2k_hsum8(acc[r][t]);
}

#define Q2K_TILE(R, T)                                                                                         \
    Q2_ATTR static void q2k_tile_##R##x##T(const void *w, size_t w_stride, const cv_xq_block *x,              \
                                           int64_t x_stride, int64_t nb, float *out) {                        \
        q2k_tile(w, w_stride, x, x_stride, nb, R, T, out);                                                     \
    }
Q2K_TILE(4, 1)
Q2K_TILE(2, 2)
Q2K_TILE(1, 1)
Q2K_TILE(1, 2)
Q2K_TILE(1, 3)
Q2K_TILE(1, 4)

/* Q8_M (quant_format.h: a float scale and min per 16, int8 weights): per
 * block and pair, the sign trick (|w| x sign(x, w), |w| <= 128) into pair
 * sums, vpmaddwd with ones into eight int32 lanes of 4-element dots (lanes
 * 0..3 the first 16 elements); the token's sums the same way (shared by the
 * rows). v = fma(float(dot), d, float(sum) * m) with d, m the lanes' scale
 * and min, then acc = fma(v, dx_i, acc): the same operations for a pair in
 * every tile. */
Q2_ATTR static inline __attribute__((always_inline)) void q8m_tile(const void *w, size_t w_stride,
                                                                   const cv_xq_block *x, int64_t x_stride,
                                                                   int64_t nb, int R, int T, float *out) {
    const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
    const __m256i lo = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), hi = _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3);
    __m256 acc[4][CV_QTILE_MAX_TOKENS];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) acc[r][t] = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        __m256i xv[CV_QTILE_MAX_TOKENS];
        __m256 xs[CV_QTILE_MAX_TOKENS], dx[CV_QTILE_MAX_TOKENS];
        for (int t = 0; t < T; t++) {
            const cv_xq_block *xb = x + (int64_t)t * x_stride + i;
            xv[t] = _mm256_loadu_si256((const __m256i *)xb->q);
            xs[t] = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(ones8, xv[t]), ones16));
            dx[t] = _mm256_set1_ps(xb->d);
        }
        for (int r = 0; r < R; r++) {
            const cv_block_q8_m *b = (const cv_block_q8_m *)((const char *)w + (size_t)r * w_stride) + i;
            _mm_prefetch((const char *)(b + 4), _MM_HINT_T0);
            const __m256 dm = _mm256_castps128_ps256(_mm_loadu_ps(b->d)); /* d0 d1 m0 m1 */
            const __m256 dv = _mm256_permutevar8x32_ps(dm, lo), mv = _mm256_permutevar8x32_ps(dm, hi);
            const __m256i wv = _mm256_loadu_si256((const __m256i *)b->qs), aw = _mm256_abs_epi8(wv);
            for (int t = 0; t < T; t++) {
                const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv[t], wv)), ones16);
                const __m256 v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), dv, _mm256_mul_ps(xs[t], mv));
                acc[r][t] = _mm256_fmadd_ps(v, dx[t], acc[r][t]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) out[r * T + t] = q2k_hsum8(acc[r][t]);
}

#define Q8M_TILE(R, T)                                                                                         \
    Q2_ATTR static void q8m_tile_##R##x##T(const void *w, size_t w_stride, const cv_xq_block *x,              \
                                           int64_t x_stride, int64_t nb, float *out) {                        \
        q8m_tile(w, w_stride, x, x_stride, nb, R, T, out);                                                     \
    }
Q8M_TILE(4, 1)
Q8M_TILE(2, 2)
Q8M_TILE(1, 1)
Q8M_TILE(1, 2)
Q8M_TILE(1, 3)
Q8M_TILE(1, 4)

int cv_qtiles_q2k(cv_dtype t, cv_qtiles *out) {
    const cv_cpu_features *f = cv_cpu_features_get();
#ifndef CV_EMULATE_AVX512
    if (!(f->avx2 && f->fma && f->f16c)) return 0;
#else
    (void)f;
#endif
    if (t == CV_Q2_K)
        *out = (cv_qtiles){.max_tokens = 4,
                           .rows = {0, 4, 2, 1, 1},
                           .tile = {NULL, q2k_tile_4x1, q2k_tile_2x2, q2k_tile_1x3, q2k_tile_1x4},
                           .row = {NULL, q2k_tile_1x1, q2k_tile_1x2, q2k_tile_1x3, q2k_tile_1x4}};
    else if (t == CV_Q8_M)
        *out = (cv_qtiles){.max_tokens = 4,
                           .rows = {0, 4, 2, 1, 1},
                           .tile = {NULL, q8m_tile_4x1, q8m_tile_2x2, q8m_tile_1x3, q8m_tile_1x4},
                           .row = {NULL, q8m_tile_1x1, q8m_tile_1x2, q8m_tile_1x3, q8m_tile_1x4}};
    else
        return 0;
    return 1;
}

#else
int cv_qtiles_q2k(cv_dtype t, cv_qtiles *out) {
    (void)t;
    (void)out;
    return 0;
}
#endif
