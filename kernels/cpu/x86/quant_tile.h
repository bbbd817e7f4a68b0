/* The register-blocked quantized micro-kernel (quant_ukr.h: cv_qtile_fn), written
 * once for every SIMD level whose block dot is an int8 product into eight
 * int32 lanes. Not a normal header: avx2_quant.c and avxvnni_quant.c include it
 * once per level after defining
 *   QT_TARGET        the target string of the level's functions,
 *   QT_NAME(name)    the level's name for one of its functions (a suffix),
 *   QT_DOT(u8, s8)   the block dot: eight int32 lanes, lane l summing the
 *                    products of bytes 4l..4l+3 of the u8 and s8 vectors,
 * and it defines `const cv_qtiles *QT_NAME(qtiles_for)(cv_dtype t)` (NULL for
 * a type that is not quantized).
 *
 * A tile is R weight rows x T tokens. Per block of 32 columns it unpacks each
 * row's weights once (shared by the T tokens) and loads each token's int8
 * block once (shared by the R rows); R x T float accumulators of eight lanes
 * take each block's int32 lanes times the two scales. The lanes' integers are
 * exact, and every (row, token) pair runs the same float operations in the
 * same order whatever R and T are: acc = fma(float(lanes_i), dw_i * dx_i, acc)
 * over the blocks i, then hsum8(acc) (+ the Q4 min terms, summed over the
 * blocks in order, each dm_i * sx_i, no FMA in C11; Q4_F and Q8_F (the
 * exact float32-scale repackings of GGUF's Q5 and K formats) take the
 * same path with their float scales, Q8_F one per half block (lanes 0..3
 * and 4..7); Q4_0 is taken as Q4_1
 * with dm = -8 dw, exact, so no token needs the sign trick). So a token's outputs are
 * the same bits alone or in any batch (the contract of quant_ukr.h). */

#include <stddef.h>
#include <string.h>

#ifdef CV_EMULATE_AVX512 /* portable intrinsics (tools/avx512_emulated.sh): no target; they lack _cvtsh_ss */
#define QT_ATTR
#define QT_H2F(h) cv_qh_to_f32(h) /* exact, as the instruction */
#else
#define QT_ATTR __attribute__((target(QT_TARGET)))
#define QT_H2F(h) _cvtsh_ss(h)
#endif
#define QT_INLINE QT_ATTR static inline __attribute__((always_inline))
#define QT_BLOCK_BYTES(type)                                                                      \
    ((type) == CV_Q8_0 ? sizeof(cv_block_q8_0) : (type) == CV_Q4_0 ? sizeof(cv_block_q4_0)         \
     : (type) == CV_Q4_1 ? sizeof(cv_block_q4_1) : (type) == CV_Q4_F ? sizeof(cv_block_q4_f)        \
     : sizeof(cv_block_q8_f))
/* Signed weights take the sign trick; the others have a min term. */
#define QT_SIGNED(type) ((type) == CV_Q8_0 || (type) == CV_Q8_F)
#define QT_HAS_MIN(type) ((type) != CV_Q8_0)
/* Weight blocks each row prefetches ahead: with several rows interleaved the
 * hardware prefetcher alone falls behind on weights streamed from memory (a
 * prefetch past the row's end only touches the next row; it never faults). */
#define QT_PREFETCH_BLOCKS 8

QT_INLINE float QT_NAME(hsum8)(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 32 nibbles (element j low, j + 16 high) as bytes 0..31 in element order:
 * the 16 bytes in both halves (one broadcast load), the upper half shifted
 * right by 4 (bits shifted in from the next byte land above the mask), masked:
 * 3 instructions where two halves built apart and joined took 5. */
QT_INLINE __m256i QT_NAME(nibbles)(const uint8_t *qs) {
    const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs));
    return _mm256_and_si256(_mm256_srlv_epi64(b, _mm256_setr_epi64x(0, 0, 4, 4)), _mm256_set1_epi8(0x0f));
}

/* Decode's 4 x 1 tile for the Q4 types (Q4_0, Q4_1 and Q4_F): every scale of
 * a block in one register and one product. Q4_1 and Q4_F lead each block
 * with a (d, m) pair: the four rows' pairs make [d0 m0 d1 m1 d2 m2 d3 m3],
 * and one product with the token's [dx sx dx sx ...] gives the FMA scales
 * dw * dx in the even lanes (each broadcast by one permute) and the min terms
 * m * sx in the odd lanes, summed there in place. Q4_0's four d make
 * [d0 d1 d2 d3], times dx for the FMA scales and, as -8 d, times sx for the
 * min terms. Each value takes the operations of the general tile below in the
 * same order, so the bits are the same; the scales take 7-10 vector
 * operations a block where the general tile takes 24, which is what decode
 * on AVX2 is bound by (the vector pipes, not the memory). */
QT_INLINE void QT_NAME(tile_q4_4x1)(cv_dtype type, const void *w, size_t w_stride, const cv_xq_block *x, int64_t nb,
                                    float *out) {
    const size_t bb = QT_BLOCK_BYTES(type);
    const unsigned char *r0 = w, *r1 = r0 + w_stride, *r2 = r1 + w_stride, *r3 = r2 + w_stride;
    const size_t qoff = type == CV_Q4_0   ? offsetof(cv_block_q4_0, qs)
                        : type == CV_Q4_1 ? offsetof(cv_block_q4_1, qs)
                                          : offsetof(cv_block_q4_f, qs);
    const int pair = type != CV_Q4_0; /* row r's scale in lane 2r (its min in 2r + 1), else lane r */
    const __m256i lane0 = _mm256_set1_epi32(0), lane1 = _mm256_set1_epi32(pair ? 2 : 1),
                  lane2 = _mm256_set1_epi32(pair ? 4 : 2), lane3 = _mm256_set1_epi32(pair ? 6 : 3);
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, mins = a0;
    for (int64_t i = 0; i < nb; i++, r0 += bb, r1 += bb, r2 += bb, r3 += bb) {
        _mm_prefetch((const char *)r0 + QT_PREFETCH_BLOCKS * bb, _MM_HINT_T0);
        _mm_prefetch((const char *)r1 + QT_PREFETCH_BLOCKS * bb, _MM_HINT_T0);
        _mm_prefetch((const char *)r2 + QT_PREFETCH_BLOCKS * bb, _MM_HINT_T0);
        _mm_prefetch((const char *)r3 + QT_PREFETCH_BLOCKS * bb, _MM_HINT_T0);
        const cv_xq_block *xi = x + i;
        __m256 sc;
        if (type == CV_Q4_0) {
            uint16_t h0, h1, h2, h3;
            memcpy(&h0, r0, 2);
            memcpy(&h1, r1, 2);
            memcpy(&h2, r2, 2);
            memcpy(&h3, r3, 2);
            const __m128 d = _mm_cvtph_ps(_mm_setr_epi16((short)h0, (short)h1, (short)h2, (short)h3, 0, 0, 0, 0));
            sc = _mm256_castps128_ps256(_mm_mul_ps(d, _mm_set1_ps(xi->d)));
            const __m128 m = _mm_mul_ps(_mm_mul_ps(d, _mm_set1_ps(-8.0f)), _mm_set1_ps(xi->s));
            mins = _mm256_castps128_ps256(_mm_add_ps(_mm256_castps256_ps128(mins), m));
        } else {
            __m256 dm;
            if (type == CV_Q4_1) {
                uint32_t h0, h1, h2, h3; /* d and m, adjacent float16 */
                memcpy(&h0, r0, 4);
                memcpy(&h1, r1, 4);
                memcpy(&h2, r2, 4);
                memcpy(&h3, r3, 4);
                dm = _mm256_cvtph_ps(_mm_setr_epi32((int)h0, (int)h1, (int)h2, (int)h3));
            } else {
                const __m128 p01 = _mm_loadh_pi(_mm_castpd_ps(_mm_load_sd((const double *)(const void *)r0)),
                                                (const __m64 *)(const void *)r1);
                const __m128 p23 = _mm_loadh_pi(_mm_castpd_ps(_mm_load_sd((const double *)(const void *)r2)),
                                                (const __m64 *)(const void *)r3);
                dm = _mm256_set_m128(p23, p01);
            } /* the token's d and s are adjacent too: [dx sx dx sx ...] */
            sc = _mm256_mul_ps(dm, _mm256_castpd_ps(_mm256_broadcast_sd((const double *)(const void *)&xi->d)));
            mins = _mm256_add_ps(mins, sc);
        }
        const __m256i v = _mm256_loadu_si256((const __m256i *)xi->q);
        a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(QT_DOT(QT_NAME(nibbles)(r0 + qoff), v)),
                             _mm256_permutevar8x32_ps(sc, lane0), a0);
        a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(QT_DOT(QT_NAME(nibbles)(r1 + qoff), v)),
                             _mm256_permutevar8x32_ps(sc, lane1), a1);
        a2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(QT_DOT(QT_NAME(nibbles)(r2 + qoff), v)),
                             _mm256_permutevar8x32_ps(sc, lane2), a2);
        a3 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(QT_DOT(QT_NAME(nibbles)(r3 + qoff), v)),
                             _mm256_permutevar8x32_ps(sc, lane3), a3);
    }
    float m[8];
    _mm256_storeu_ps(m, mins);
    out[0] = QT_NAME(hsum8)(a0) + m[pair ? 1 : 0];
    out[1] = QT_NAME(hsum8)(a1) + m[pair ? 3 : 1];
    out[2] = QT_NAME(hsum8)(a2) + m[pair ? 5 : 2];
    out[3] = QT_NAME(hsum8)(a3) + m[pair ? 7 : 3];
}

/* R rows (w_stride bytes apart) x T tokens (x_stride blocks apart) of type
 * `type`; out[r * T + t]. R, T and type are constants at every call. */
QT_INLINE void QT_NAME(tile)(cv_dtype type, int R, int T, const void *w, size_t w_stride, const cv_xq_block *x,
                             int64_t x_stride, int64_t nb, float *out) {
    if (R == 4 && T == 1 && (type == CV_Q4_0 || type == CV_Q4_1 || type == CV_Q4_F)) {
        QT_NAME(tile_q4_4x1)(type, w, w_stride, x, nb, out);
        return;
    }
    __m256 acc[CV_QTILE_MAX_ROWS][CV_QTILE_MAX_TOKENS];
    __m128 mins[CV_QTILE_MAX_ROWS]; /* Q4: lane t, token t's min terms */
    for (int r = 0; r < R; r++) {
        mins[r] = _mm_setzero_ps();
        for (int t = 0; t < T; t++) acc[r][t] = _mm256_setzero_ps();
    }
    for (int64_t i = 0; i < nb; i++) {
        __m256i wu[CV_QTILE_MAX_ROWS], wsg[CV_QTILE_MAX_ROWS]; /* u8 operand; the sign source (signed types) */
        __m256 dw[CV_QTILE_MAX_ROWS];
        __m128 sx = _mm_setzero_ps(); /* Q4: the tokens' block sums s, lane t */
        if (QT_HAS_MIN(type))
            sx = _mm_setr_ps(x[i].s, T > 1 ? x[x_stride + i].s : 0.0f, T > 2 ? x[2 * x_stride + i].s : 0.0f,
                             T > 3 ? x[3 * x_stride + i].s : 0.0f);
        for (int r = 0; r < R; r++) {
            const char *row = (const char *)w + (size_t)r * w_stride;
            _mm_prefetch(row + (size_t)(i + QT_PREFETCH_BLOCKS) * QT_BLOCK_BYTES(type), _MM_HINT_T0);
            if (type == CV_Q8_0) {
                const cv_block_q8_0 *b = (const cv_block_q8_0 *)row + i;
                wsg[r] = _mm256_loadu_si256((const __m256i *)b->qs);
                wu[r] = _mm256_sign_epi8(wsg[r], wsg[r]);
                dw[r] = _mm256_set1_ps(QT_H2F(b->d));
            } else if (type == CV_Q4_0) { /* d * (n - 8) = d * n + (-8 d): Q4_1's form, no sign per token */
                const cv_block_q4_0 *b = (const cv_block_q4_0 *)row + i;
                const float d = QT_H2F(b->d);
                wu[r] = QT_NAME(nibbles)(b->qs);
                dw[r] = _mm256_set1_ps(d);
                mins[r] = _mm_add_ps(mins[r], _mm_mul_ps(_mm_set1_ps(-8.0f * d), sx));
            } else if (type == CV_Q4_F) { /* Q4_1 with float32 d and m */
                const cv_block_q4_f *b = (const cv_block_q4_f *)row + i;
                wu[r] = QT_NAME(nibbles)(b->qs);
                dw[r] = _mm256_set1_ps(b->d);
                mins[r] = _mm_add_ps(mins[r], _mm_mul_ps(_mm_set1_ps(b->m), sx));
            } else if (type == CV_Q8_F) { /* lanes 0..3 are elements 0..15: scale d[0]; lanes 4..7 d[1] */
                const cv_block_q8_f *b = (const cv_block_q8_f *)row + i;
                wsg[r] = _mm256_loadu_si256((const __m256i *)b->qs);
                wu[r] = _mm256_sign_epi8(wsg[r], wsg[r]);
                dw[r] = _mm256_set_m128(_mm_set1_ps(b->d[1]), _mm_set1_ps(b->d[0]));
                mins[r] = _mm_add_ps(mins[r], _mm_mul_ps(_mm_set1_ps(b->m), sx));
            } else {
                const cv_block_q4_1 *b = (const cv_block_q4_1 *)row + i;
                uint32_t dm_h; /* d and m, adjacent: converted together */
                memcpy(&dm_h, &b->d, sizeof dm_h);
                const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dm_h));
                wu[r] = QT_NAME(nibbles)(b->qs);
                dw[r] = _mm256_broadcastss_ps(dm);
                mins[r] = _mm_add_ps(mins[r], _mm_mul_ps(_mm_permute_ps(dm, 0x55), sx));
            }
        }
        for (int t = 0; t < T; t++) {
            const cv_xq_block *xt = x + t * x_stride + i;
            const __m256i v = _mm256_loadu_si256((const __m256i *)xt->q);
            const __m256 dx = _mm256_broadcast_ss(&xt->d);
            for (int r = 0; r < R; r++) {
                const __m256i p = !QT_SIGNED(type) ? QT_DOT(wu[r], v) : QT_DOT(wu[r], _mm256_sign_epi8(v, wsg[r]));
                acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(dw[r], dx), acc[r][t]);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        float m[4];
        _mm_storeu_ps(m, mins[r]);
        for (int t = 0; t < T; t++) {
            const float h = QT_NAME(hsum8)(acc[r][t]);
            out[r * T + t] = QT_HAS_MIN(type) ? h + m[t] : h;
        }
    }
}

/* One function per (type, R, T) the driver may use; the tile above, inlined
 * with constants. */
#define QT_FN(TY, R, T) QT_NAME(tile_##TY##_##R##x##T)
#define QT_ONE(TY, TYPE, R, T)                                                                                 \
    QT_ATTR static __attribute__((unused)) void QT_FN(TY, R, T)(const void *w, size_t w_stride,                \
                                                                const cv_xq_block *x, int64_t x_stride,        \
                                                                int64_t nb, float *out) {                      \
        QT_NAME(tile)(TYPE, R, T, w, w_stride, x, x_stride, nb, out);                                           \
    }
/* Rows of a full tile for T tokens: as many accumulators as fit. At 1 and 2
 * tokens (decode: the weights stream from memory) Q4 takes 4 rows (four
 * independent chains); Q8_0's 34-byte blocks stream faster one row at a
 * time (measured on the AVX2 machine), so it keeps 1 row there. */
#define QT_TYPE(TY, TYPE, R12)                                                                                 \
    QT_ONE(TY, TYPE, 4, 1) QT_ONE(TY, TYPE, 1, 1) QT_ONE(TY, TYPE, 4, 2) QT_ONE(TY, TYPE, 1, 2)                 \
    QT_ONE(TY, TYPE, 2, 3) QT_ONE(TY, TYPE, 1, 3) QT_ONE(TY, TYPE, 2, 4) QT_ONE(TY, TYPE, 1, 4)                 \
    static const cv_qtiles QT_NAME(tiles_##TY) = {                                                             \
        .max_tokens = 4,                                                                                       \
        .rows = {0, R12, R12, 2, 2},                                                                           \
        .tile = {NULL, R12 == 4 ? QT_FN(TY, 4, 1) : QT_FN(TY, 1, 1), R12 == 4 ? QT_FN(TY, 4, 2) : QT_FN(TY, 1, 2), \
                 QT_FN(TY, 2, 3), QT_FN(TY, 2, 4)},                                                            \
        .row = {NULL, QT_FN(TY, 1, 1), QT_FN(TY, 1, 2), QT_FN(TY, 1, 3), QT_FN(TY, 1, 4)},                     \
    };

QT_TYPE(q8_0, CV_Q8_0, 1)
QT_TYPE(q4_0, CV_Q4_0, 4)
QT_TYPE(q4_1, CV_Q4_1, 4)
QT_TYPE(q4_f, CV_Q4_F, 4)
QT_TYPE(q8_f, CV_Q8_F, 1)

static const cv_qtiles *QT_NAME(qtiles_for)(cv_dtype t) {
    switch (t) {
    case CV_Q8_0: return &QT_NAME(tiles_q8_0);
    case CV_Q4_0: return &QT_NAME(tiles_q4_0);
    case CV_Q4_1: return &QT_NAME(tiles_q4_1);
    case CV_Q4_F: return &QT_NAME(tiles_q4_f);
    case CV_Q8_F: return &QT_NAME(tiles_q8_f);
    default: return NULL;
    }
}

#undef QT_ATTR
#undef QT_INLINE
#undef QT_H2F
#undef QT_FN
#undef QT_ONE
#undef QT_TYPE
#undef QT_BLOCK_BYTES
#undef QT_SIGNED
#undef QT_HAS_MIN
#undef QT_PREFETCH_BLOCKS
