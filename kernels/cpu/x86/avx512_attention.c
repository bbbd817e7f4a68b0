/* AVX-512 chunk kernels of paged attention (contract: x86/kernels.h).
 *
 * Scores. A dot product of head_dim 64 is only 4 FMAs (2 vdpbf16ps) per
 * (vector, key); reducing each 16-lane accumulator on its own costs more than
 * the FMAs. Instead a block of 16 (vector, key) accumulators is summed by one
 * transpose-add tree: each level adds the lanes at distance h (8, 4, 2, 1) of
 * two registers into one, so 15 folds (a shuffle, a blend and an add each)
 * give 16 scores in one register. Every lane goes through the same tree
 * whatever the block holds, so a score depends only on its own q and k.
 * On vdpbf16ps (a bf16 cache) the tree cost three times the dots; there the
 * chunk's keys are transposed once to pairs of dims by key (64 shuffles per
 * 16 keys x 32 dims, shared by the tile's vectors), and the scores are a
 * small GEMM with a lane per key: no sums across lanes.
 *
 * P.V on vdpbf16ps. The pair in a 32-bit lane is two keys at one dim:
 * (V_i[d], V_i+1[d]) comes from two rows by one word permute per 16 dims,
 * shared by the vectors of the group; (p_i, p_i+1) is one broadcast.
 *
 * The int8 cache's integer-dot kernels are in avx512_attention_i8.c. */
#include <math.h>
#include <string.h>

#include "kernels.h"
#include "vec_math.h"

#if CV_HAVE_AVX512
CV_TARGET_AVX512_BEGIN

#include "avx512_attention_parts.h"

/* 16 values of a K or V row from d, lanes outside m zero. */
static CV_ALWAYS_INLINE __m512 kv_load16(const void *p, cv_dtype dt, int64_t d, __mmask16 m) {
    if (dt == CV_F32) return _mm512_maskz_loadu_ps(m, (const float *)p + d);
    if (dt == CV_I8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, (const int8_t *)p + d)));
    const __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)p + d);
    if (dt == CV_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* One level of the tree: lanes of a block of 2h are x's pair sums
 * x[j] + x[j+h] (MAX: pair maxima) in its first h lanes and y's in its last h. */
static CV_ALWAYS_INLINE __m512 fold(__m512 x, __m512 y, const int h, const int MAX) {
    __m512 u; /* the partner of each lane of blend(x, y) */
    if (h == 8) {
        u = _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(1, 0, 3, 2));
    } else if (h == 2) {
        u = _mm512_shuffle_ps(x, y, _MM_SHUFFLE(1, 0, 3, 2));
    } else if (h == 4) {
        const __m512i i4 = _mm512_setr_epi32(4, 5, 6, 7, 16, 17, 18, 19, 12, 13, 14, 15, 24, 25, 26, 27);
        u = _mm512_permutex2var_ps(x, i4, y);
    } else {
        const __m512i i1 = _mm512_setr_epi32(1, 16, 3, 18, 5, 20, 7, 22, 9, 24, 11, 26, 13, 28, 15, 30);
        u = _mm512_permutex2var_ps(x, i1, y);
    }
    const __mmask16 from_y = h == 8 ? 0xff00 : h == 4 ? 0xf0f0 : h == 2 ? 0xcccc : 0xaaaa;
    const __m512 b = _mm512_mask_blend_ps(from_y, x, y);
    return MAX ? _mm512_max_ps(b, u) : _mm512_add_ps(b, u);
}

/* The lane sums (MAX: maxima) of a[0..15]: lane j holds the sum of
 * a[rev4(j)] (rev4 reverses the 4 bits of j). a is clobbered. A register's
 * lanes are added at distance 8, then 4, 2 and 1 wherever it sits, the
 * order of _mm512_reduce_add_ps. */
static CV_ALWAYS_INLINE __m512 tree16(__m512 *a, const int MAX) {
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++) a[i] = fold(a[2 * i], a[2 * i + 1], 8, MAX);
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) a[i] = fold(a[2 * i], a[2 * i + 1], 4, MAX);
#pragma GCC unroll 2
    for (int i = 0; i < 2; i++) a[i] = fold(a[2 * i], a[2 * i + 1], 2, MAX);
    return fold(a[0], a[1], 1, MAX);
}

static CV_ALWAYS_INLINE int rev4(int j) {
    return ((j & 1) << 3) | ((j & 2) << 1) | ((j & 4) >> 1) | ((j & 8) >> 3);
}

/* Stores the 16 scores r of NV vectors x KB keys (lane v * KB + k) at
 * sc[v][i0 + k]. */
static CV_ALWAYS_INLINE void store_scores(float *sc, __m512 r, const int NV, int i0) {
    const int KB = 16 / NV;
#pragma GCC unroll 4
    for (int v = 0; v < NV; v++)
        _mm512_mask_storeu_ps(sc + v * CV_ATT_KCHUNK + i0 - v * KB,
                              (__mmask16)(((1u << KB) - 1u) << (v * KB)), r);
}

/* Scores of NV (1, 2 or 4) vectors against the KB = 16 / NV keys from i0
 * (keys past nkb repeat key i0: their scores land past the chunk's valid
 * keys, which nothing reads). Accumulator x holds the pair rev4(x), so the
 * tree leaves pair (v, k) in lane v * KB + k. */
static CV_ALWAYS_INLINE void scores_blk(float *sc, const float *qt, int64_t hd, const int NV, int i0,
                                        int nkb, const void *const *kp, const cv_dtype dt) {
    const int KB = 16 / NV;
    const void *rows[16];
#pragma GCC unroll 16
    for (int k = 0; k < KB; k++) rows[k] = kp[i0 + (k < nkb ? k : 0)];
    __m512 a[16];
#pragma GCC unroll 16
    for (int x = 0; x < 16; x++) a[x] = _mm512_setzero_ps();
    for (int64_t d = 0; d < hd; d += 16) {
        const __mmask16 m = att_mask(hd - d);
        __m512 q[4];
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++) {
            q[v] = _mm512_maskz_loadu_ps(m, qt + v * hd + d);
            CV_KEEP512(q[v]);
        }
#pragma GCC unroll 16
        for (int k = 0; k < KB; k++) {
            const __m512 kv = kv_load16(rows[k], dt, d, m);
#pragma GCC unroll 4
            for (int v = 0; v < NV; v++) {
                const int x = rev4(v * KB + k);
                a[x] = _mm512_fmadd_ps(q[v], kv, a[x]);
            }
        }
    }
    store_scores(sc, tree16(a, 0), NV, i0);
}

/* Vector groups of the score kernels: 4, then 2, then 1. */
static inline int pow2_group(int left) { return left >= 4 ? 4 : left >= 2 ? 2 : 1; }

#define SCORES_GROUP(BLK, NV)                                                                   \
    do {                                                                                        \
        for (int i0 = 0; i0 < nk; i0 += 16 / (NV)) BLK(NV);                                     \
    } while (0)

#define SC_F32_BLK(NV)                                                                          \
    do {                                                                                        \
        const int nkb = nk - i0;                                                                \
        if (dt == CV_F32) scores_blk(s, q, hd, NV, i0, nkb, kp, CV_F32);                        \
        else if (dt == CV_F16) scores_blk(s, q, hd, NV, i0, nkb, kp, CV_F16);                   \
        else if (dt == CV_I8) scores_blk(s, q, hd, NV, i0, nkb, kp, CV_I8);                     \
        else scores_blk(s, q, hd, NV, i0, nkb, kp, CV_BF16);                                    \
    } while (0)

void cv_att_scores_avx512(float *sc, const float *qt, int64_t hd, int nv, const int *nval,
                          const void *const *kp, cv_dtype dt, float *row) {
    (void)row; /* scratch of the plain kernels */
    for (int v0 = 0; v0 < nv;) {
        const int nvg = pow2_group(nv - v0);
        const int nk = cv_att_max_valid(nval, v0, nvg);
        float *s = sc + v0 * CV_ATT_KCHUNK;
        const float *q = qt + v0 * hd;
        if (nvg == 4) SCORES_GROUP(SC_F32_BLK, 4);
        else if (nvg == 2) SCORES_GROUP(SC_F32_BLK, 2);
        else SCORES_GROUP(SC_F32_BLK, 1);
        v0 += nvg;
    }
}
#undef SC_F32_BLK

/* acc[v][d0 .. d0 + 16 DB) = acc * alpha[v] + sum_i p[v][i] V_i for NV
 * vectors, lanes outside m untouched: NV x DB accumulators, each V row chunk
 * loaded once for all NV vectors. */
static CV_ALWAYS_INLINE void pv_blk(float *acc, const float *sc, const float *alpha, int64_t hd,
                                    int64_t d0, const int NV, const int DB, int nk,
                                    const void *const *vp, const cv_dtype dt, __mmask16 m) {
    __m512 a[12];
#pragma GCC unroll 4
    for (int v = 0; v < NV; v++) {
        const __m512 al = _mm512_set1_ps(alpha[v]);
#pragma GCC unroll 4
        for (int b = 0; b < DB; b++)
            a[v * DB + b] = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, acc + v * hd + d0 + 16 * b), al);
    }
    for (int i = 0; i < nk; i++) {
        __m512 vv[4];
#pragma GCC unroll 4
        for (int b = 0; b < DB; b++) {
            vv[b] = kv_load16(vp[i], dt, d0 + 16 * b, m);
            if (NV > 1) CV_KEEP512(vv[b]);
        }
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++) {
            const __m512 p = _mm512_set1_ps(sc[v * CV_ATT_KCHUNK + i]);
#pragma GCC unroll 4
            for (int b = 0; b < DB; b++) a[v * DB + b] = _mm512_fmadd_ps(p, vv[b], a[v * DB + b]);
        }
    }
#pragma GCC unroll 4
    for (int v = 0; v < NV; v++)
#pragma GCC unroll 4
        for (int b = 0; b < DB; b++) _mm512_mask_storeu_ps(acc + v * hd + d0 + 16 * b, m, a[v * DB + b]);
}

/* All of head_dim for one group: blocks of 16 * DB dims, then masked 16-dim blocks. */
static CV_ALWAYS_INLINE void pv_group(float *acc, const float *sc, const float *alpha, int64_t hd,
                                      const int NV, int nk, const void *const *vp, const cv_dtype dt) {
    const int DB = NV == 4 ? 3 : 4;
    int64_t d = 0;
    for (; d + 16 * DB <= hd; d += 16 * DB)
        pv_blk(acc, sc, alpha, hd, d, NV, DB, nk, vp, dt, (__mmask16)0xffff);
    for (; d < hd; d += 16) pv_blk(acc, sc, alpha, hd, d, NV, 1, nk, vp, dt, att_mask(hd - d));
}

#define PV_DT(NV)                                                                               \
    do {                                                                                        \
        if (dt == CV_F32) pv_group(a, s, al, hd, NV, nk, vp, CV_F32);                           \
        else if (dt == CV_F16) pv_group(a, s, al, hd, NV, nk, vp, CV_F16);                      \
        else if (dt == CV_I8) pv_group(a, s, al, hd, NV, nk, vp, CV_I8);                        \
        else pv_group(a, s, al, hd, NV, nk, vp, CV_BF16);                                       \
    } while (0)

void cv_att_pv_avx512(float *acc, const float *sc, const float *alpha, int64_t hd, int nv,
                      const int *nval, const void *const *vp, cv_dtype dt, float *row) {
    (void)row; /* scratch of the plain kernels */
    for (int v0 = 0; v0 < nv;) {
        const int nvg = group_size(nv, v0);
        const int nk = cv_att_max_valid(nval, v0, nvg);
        float *a = acc + v0 * hd;
        const float *s = sc + v0 * CV_ATT_KCHUNK;
        const float *al = alpha + v0;
        switch (nvg) {
        case 1: PV_DT(1); break;
        case 2: PV_DT(2); break;
        case 3: PV_DT(3); break;
        default: PV_DT(4); break;
        }
        v0 += nvg;
    }
}
#undef PV_DT

void cv_att_scale_avx512(float *sc, int nv, const int *nval, const float *s) {
    const int nk = cv_att_max_valid(nval, 0, nv);
    __m512 sv[CV_ATT_KCHUNK / 16];
#pragma GCC unroll 4
    for (int b = 0; b < CV_ATT_KCHUNK / 16; b++) sv[b] = _mm512_maskz_loadu_ps(att_mask(nk - 16 * b), s + 16 * b);
    for (int v = 0; v < nv; v++) {
        float *r = sc + v * CV_ATT_KCHUNK;
#pragma GCC unroll 4
        for (int b = 0; b < CV_ATT_KCHUNK / 16; b++) {
            const __mmask16 m = att_mask(nval[v] - 16 * b);
            _mm512_mask_storeu_ps(r + 16 * b, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, r + 16 * b), sv[b]));
        }
    }
}

/* All vectors of the chunk in one pass, so that their chains overlap: one
 * vector's step is a latency chain (max, its reduction, exp, the sum's
 * reduction) that alone left the core idle. The maxima and sums of up to 16
 * vectors are reduced together by one transpose tree each, and the rescale
 * factors take one vector exp. Each lane and each vector's reductions run
 * as in a step of that vector alone (the tree adds a register's lanes in
 * the order of _mm512_reduce_add_ps). */
_Static_assert(CV_ATT_TILE <= 16, "a tile's vectors fit one register of the softmax");

void cv_att_softmax_avx512(float *sc, int nk, int nv, const int *nval, float *m, float *l, float *alpha) {
    /* lane v of a tree's result is in lane rev4(v) */
    const __m512i natural = _mm512_setr_epi32(0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15);
    const __mmask16 k = att_mask(nv);
    __mmask16 has = 0; /* vectors with keys in the chunk */
    for (int v = 0; v < nv; v++) has |= (__mmask16)((nval[v] > 0 ? 1u : 0u) << v);
    /* A few vectors (a decode tile) are reduced one by one into lanes of t,
     * more by the trees over r: the same values. */
    const int tree = nv > 4;
    __m512 r[16], t = _mm512_setzero_ps(); /* t: lane v set one by one, kept in a register */
    if (tree)
#pragma GCC unroll 16
        for (int v = nv; v < 16; v++) r[v] = _mm512_set1_ps(-INFINITY);
    for (int v = 0; v < nv; v++) {
        __m512 x = _mm512_set1_ps(-INFINITY);
        for (int i = 0; i < nval[v]; i += 16) {
            const __mmask16 ki = att_mask(nval[v] - i);
            x = _mm512_mask_max_ps(x, ki, x, _mm512_maskz_loadu_ps(ki, sc + v * CV_ATT_KCHUNK + i));
        }
        if (tree) r[v] = x;
        else t = _mm512_mask_mov_ps(t, (__mmask16)(1u << v), _mm512_set1_ps(_mm512_reduce_max_ps(x)));
    }
    const __m512 mx = tree ? _mm512_permutexvar_ps(natural, tree16(r, 1)) : t;
    const __m512 mo = _mm512_maskz_loadu_ps(k, m);
    /* a vector's new max: its chunk's if it has keys and that is larger */
    const __m512 mn = _mm512_mask_blend_ps((__mmask16)(has & _mm512_cmp_ps_mask(mx, mo, _CMP_GT_OQ)), mo, mx);
    /* exp(m - mn); 0 for a vector's first keys (m = -inf), 1 for one without keys */
    const __mmask16 first = _mm512_cmp_ps_mask(mo, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ);
    __m512 a = _mm512_maskz_mov_ps((__mmask16)~first, cv_exp512(_mm512_sub_ps(mo, mn)));
    a = _mm512_mask_blend_ps(has, _mm512_set1_ps(1.0f), a);
    _mm512_mask_storeu_ps(alpha, k, a);
    float mnv[16];
    _mm512_storeu_ps(mnv, mn);
    if (tree)
#pragma GCC unroll 16
        for (int v = nv; v < 16; v++) r[v] = _mm512_setzero_ps();
    for (int v = 0; v < nv; v++) {
        float *row = sc + v * CV_ATT_KCHUNK;
        __m512 x = _mm512_setzero_ps();
        if (nval[v] <= 0) {
            for (int i = 0; i < nk; i++) row[i] = 0.0f;
        } else {
            const __m512 vm = _mm512_set1_ps(mnv[v]);
            for (int i = 0; i < nk; i += 16) { /* past nval: 0 */
                const __mmask16 ki = att_mask(nval[v] - i);
                const __m512 e =
                    _mm512_maskz_mov_ps(ki, cv_exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(ki, row + i), vm)));
                _mm512_mask_storeu_ps(row + i, att_mask(nk - i), e);
                x = _mm512_add_ps(x, e);
            }
        }
        if (tree) r[v] = x;
        else t = _mm512_mask_mov_ps(t, (__mmask16)(1u << v), _mm512_set1_ps(_mm512_reduce_add_ps(x)));
    }
    const __m512 sum = tree ? _mm512_permutexvar_ps(natural, tree16(r, 0)) : t;
    const __m512 lo = _mm512_maskz_loadu_ps(k, l);
    _mm512_mask_storeu_ps(l, k, _mm512_mask_blend_ps(has, lo, _mm512_add_ps(_mm512_mul_ps(lo, a), sum)));
    _mm512_mask_storeu_ps(m, k, mn);
}
CV_TARGET_END

/* ------------------------------------------------------------------------ */
/* AVX512_BF16 over a bf16 cache                                             */

CV_TARGET_AVX512_BF16_BEGIN

int64_t cv_att_qb_stride(int64_t hd) { return (hd + 31) & ~(int64_t)31; }

void cv_att_round_q_bf16(uint16_t *qb, const float *qt, int64_t hd, int nv) {
    const int64_t st = cv_att_qb_stride(hd);
    for (int v = 0; v < nv; v++)
        for (int64_t d = 0; d < st; d += 32) {
            const __m512 lo = _mm512_maskz_loadu_ps(att_mask(hd - d), qt + v * hd + d);
            const __m512 hi = _mm512_maskz_loadu_ps(att_mask(hd - d - 16), qt + v * hd + d + 16);
            _mm512_storeu_si512((void *)(qb + v * st + d), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
}

/* Dims [d0, d0 + 32) of the chunk's keys as pairs by key: kt[p][i] =
 * (K_i[d0 + 2p], K_i[d0 + 2p + 1]) for p < 16 and i < 16 nkb; dims past
 * head_dim and keys past nk are zero. */
static CV_ALWAYS_INLINE void transpose_keys(uint32_t (*kt)[CV_ATT_KCHUNK], const void *const *kp, int nk, int nkb,
                                            int64_t d0, int64_t hd) {
    const __mmask32 m = att_mask32(hd - d0);
    for (int b = 0; b < nkb; b++) {
        __m512i r[16];
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++)
            r[i] = 16 * b + i < nk ? _mm512_maskz_loadu_epi16(m, (const uint16_t *)kp[16 * b + i] + d0)
                                   : _mm512_setzero_si512();
        store_keys_by_group(kt, r, b);
    }
}

/* Dims [d0, d0 + 32) of the scores of NV vectors (qb rows from q) against
 * 16 NKB keys: lane i of an accumulator is key i, and each step adds one
 * pair of dims, in order; the sums so far come from sc (first: zero). */
static CV_ALWAYS_INLINE void scores_slab(float *sc, const uint16_t *q, int64_t st, const int NV, const int NKB,
                                         const uint32_t (*kt)[CV_ATT_KCHUNK], int64_t d0, int first) {
    __m512 a[8][2];
#pragma GCC unroll 8
    for (int v = 0; v < NV; v++)
#pragma GCC unroll 2
        for (int b = 0; b < NKB; b++)
            a[v][b] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(sc + v * CV_ATT_KCHUNK + 16 * b);
#pragma GCC unroll 4
    for (int p = 0; p < 16; p++) {
        __m512i k[2];
#pragma GCC unroll 2
        for (int b = 0; b < NKB; b++) k[b] = _mm512_load_si512((const void *)&kt[p][16 * b]);
#pragma GCC unroll 8
        for (int v = 0; v < NV; v++) {
            uint32_t pair; /* (q[d0 + 2p], q[d0 + 2p + 1]) */
            memcpy(&pair, q + v * st + d0 + 2 * p, sizeof pair);
            const __m512i qv = _mm512_set1_epi32((int)pair);
#pragma GCC unroll 2
            for (int b = 0; b < NKB; b++) a[v][b] = _mm512_dpbf16_ps(a[v][b], (__m512bh)qv, (__m512bh)k[b]);
        }
    }
#pragma GCC unroll 8
    for (int v = 0; v < NV; v++)
#pragma GCC unroll 2
        for (int b = 0; b < NKB; b++) _mm512_storeu_ps(sc + v * CV_ATT_KCHUNK + 16 * b, a[v][b]);
}

#define SLAB_NKB(NV)                                                                            \
    do {                                                                                        \
        if (nkb == 2) scores_slab(s, q, st, NV, 2, kt, d0, d0 == 0);                            \
        else scores_slab(s, q, st, NV, 1, kt, d0, d0 == 0);                                     \
    } while (0)

/* Scores as a small GEMM of the queries by the chunk's keys transposed to
 * pairs of dims (32 dims at a time), so no lane sums are needed. A score is
 * the sum over head_dim's pairs in increasing order, whatever the tile. */
void cv_att_scores_bf16(float *sc, const uint16_t *qb, int64_t hd, int nv, const int *nval,
                        const void *const *kp, const void *const *pf, int npf) {
    const int64_t st = cv_att_qb_stride(hd);
    const int nk = cv_att_max_valid(nval, 0, nv);
    const size_t row_bytes = (size_t)hd * sizeof(uint16_t);
    if (nk <= 0) {
        if (pf) prefetch_share(pf, npf, 0, 1, row_bytes);
        return;
    }
    const int nkb = nk > 16 ? 2 : 1;
    _Alignas(64) uint32_t kt[16][CV_ATT_KCHUNK];
    const int64_t steps = (hd + 31) / 32; /* the next chunk's K rows, a share per 32 dims */
    for (int64_t d0 = 0, s = 0; d0 < hd; d0 += 32, s++) {
        if (pf) prefetch_share(pf, npf, (int)s, (int)steps, row_bytes);
        transpose_keys(kt, kp, nk, nkb, d0, hd);
        for (int v0 = 0; v0 < nv;) {
            const int left = nv - v0, nvg = left <= 8 ? left : (left + 1) / 2 < 8 ? (left + 1) / 2 : 8;
            float *s = sc + v0 * CV_ATT_KCHUNK;
            const uint16_t *q = qb + v0 * st;
            switch (nvg) {
            case 1: SLAB_NKB(1); break;
            case 2: SLAB_NKB(2); break;
            case 3: SLAB_NKB(3); break;
            case 4: SLAB_NKB(4); break;
            case 5: SLAB_NKB(5); break;
            case 6: SLAB_NKB(6); break;
            case 7: SLAB_NKB(7); break;
            default: SLAB_NKB(8); break;
            }
            v0 += nvg;
        }
    }
}
#undef SLAB_NKB

/* One key pair into the NV x 2 DB accumulators of dims [d0, d0 + 32 DB):
 * rows ra and rb (HAS_B 0: zero) interleaved as (ra[d], rb[d]) pairs, times
 * each vector's pair of probabilities pb[v * 16]. */
static CV_ALWAYS_INLINE void pv_pair_bf16(__m512 *a, const uint32_t *pb, const uint16_t *ra, const uint16_t *rb, const int HAS_B,
                                          int64_t d0, const int NV, const int DB, const __mmask32 *mk,
                                          __m512i ilo, __m512i ihi) {
    __m512i pr[4];
#pragma GCC unroll 2
    for (int b = 0; b < DB; b++) {
        const __m512i va = _mm512_maskz_loadu_epi16(mk[b], ra + d0 + 32 * b);
        const __m512i vb = HAS_B ? _mm512_maskz_loadu_epi16(mk[b], rb + d0 + 32 * b) : _mm512_setzero_si512();
        interleave_pair(pr + 2 * b, va, vb, NV, ilo, ihi);
    }
#pragma GCC unroll 4
    for (int v = 0; v < NV; v++) {
        const __m512i p = _mm512_set1_epi32((int)pb[v * (CV_ATT_KCHUNK / 2)]);
#pragma GCC unroll 4
        for (int b = 0; b < 2 * DB; b++)
            a[v * 2 * DB + b] = _mm512_dpbf16_ps(a[v * 2 * DB + b], (__m512bh)p, (__m512bh)pr[b]);
    }
}

/* dims [d0, d0 + 32 DB) of NV vectors: acc = acc * alpha + sum over key
 * pairs of (p_2m, p_2m+1) . (V_2m[d], V_2m+1[d]). pb[v][m] is the pair m of
 * vector v; a missing V_2m+1 (odd nk) is zero. */
static CV_ALWAYS_INLINE void pv_blk_bf16(float *acc, const uint32_t *pb, const float *alpha, int64_t hd,
                                         int64_t d0, const int NV, const int DB, int nk,
                                         const void *const *vp, const void *const *pf, int npf) {
    __m512i ilo, ihi;
    pair_interleave_index(&ilo, &ihi);
    const __mmask32 mk[2] = {att_mask32(hd - d0), att_mask32(hd - d0 - 32)};
    __m512 a[2 * 2 * 4];
#pragma GCC unroll 4
    for (int v = 0; v < NV; v++) {
        const __m512 al = _mm512_set1_ps(alpha[v]);
#pragma GCC unroll 4
        for (int b = 0; b < 2 * DB; b++)
            a[v * 2 * DB + b] = _mm512_mul_ps(
                _mm512_maskz_loadu_ps(att_mask(hd - d0 - 16 * b), acc + v * hd + d0 + 16 * b), al);
    }
    /* the next chunk's V rows (pf, the first pass over dims only): a share per key pair */
    const size_t row_bytes = (size_t)hd * sizeof(uint16_t);
    const int pairs = (nk + 1) / 2;
    int i = 0;
    for (; i + 1 < nk; i += 2) {
        if (pf) prefetch_share(pf, npf, i / 2, pairs, row_bytes);
        pv_pair_bf16(a, pb + i / 2, vp[i], vp[i + 1], 1, d0, NV, DB, mk, ilo, ihi);
    }
    if (i < nk) {
        if (pf) prefetch_share(pf, npf, i / 2, pairs, row_bytes);
        pv_pair_bf16(a, pb + i / 2, vp[i], NULL, 0, d0, NV, DB, mk, ilo, ihi);
    }
#pragma GCC unroll 4
    for (int v = 0; v < NV; v++)
#pragma GCC unroll 4
        for (int b = 0; b < 2 * DB; b++)
            _mm512_mask_storeu_ps(acc + v * hd + d0 + 16 * b, att_mask(hd - d0 - 16 * b), a[v * 2 * DB + b]);
}

static CV_ALWAYS_INLINE void pv_group_bf16(float *acc, const uint32_t *pb, const float *alpha, int64_t hd,
                                           const int NV, int nk, const void *const *vp, const void *const *pf,
                                           int npf) {
    int64_t d = 0;
    for (; d + 64 <= hd; d += 64, pf = NULL) pv_blk_bf16(acc, pb, alpha, hd, d, NV, 2, nk, vp, pf, npf);
    for (; d < hd; d += 32, pf = NULL) pv_blk_bf16(acc, pb, alpha, hd, d, NV, 1, nk, vp, pf, npf);
}

void cv_att_pv_bf16(float *acc, const float *sc, const float *alpha, int64_t hd, int nv,
                    const int *nval, const void *const *vp, const void *const *pf, int npf) {
    /* probabilities as bf16 pairs of keys; zero past the chunk's valid keys */
    uint32_t pb[CV_ATT_TILE * CV_ATT_KCHUNK / 2];
    const int nk_all = cv_att_max_valid(nval, 0, nv);
    for (int v = 0; v < nv; v++) {
        const __m512 lo = _mm512_maskz_loadu_ps(att_mask(nk_all), sc + v * CV_ATT_KCHUNK);
        const __m512 hi = _mm512_maskz_loadu_ps(att_mask(nk_all - 16), sc + v * CV_ATT_KCHUNK + 16);
        _mm512_storeu_si512((void *)(pb + v * (CV_ATT_KCHUNK / 2)), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
    for (int v0 = 0; v0 < nv;) {
        const int nvg = group_size(nv, v0);
        const int nk = cv_att_max_valid(nval, v0, nvg);
        float *a = acc + v0 * hd;
        const uint32_t *p = pb + v0 * (CV_ATT_KCHUNK / 2);
        const float *al = alpha + v0;
        /* the next chunk's V rows, spread over the first group's pass (nk > 0) */
        const void *const *gpf = nk > 0 ? pf : NULL;
        switch (nvg) {
        case 1: pv_group_bf16(a, p, al, hd, 1, nk, vp, gpf, npf); break;
        case 2: pv_group_bf16(a, p, al, hd, 2, nk, vp, gpf, npf); break;
        case 3: pv_group_bf16(a, p, al, hd, 3, nk, vp, gpf, npf); break;
        default: pv_group_bf16(a, p, al, hd, 4, nk, vp, gpf, npf); break;
        }
        if (gpf) pf = NULL;
        v0 += nvg;
    }
    if (pf) prefetch_share(pf, npf, 0, 1, (size_t)hd * sizeof(uint16_t)); /* no group had a valid key */
}
CV_TARGET_END

#endif
