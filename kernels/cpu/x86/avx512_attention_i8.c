/* AVX512-VNNI chunk kernels of paged attention over an int8 cache: integer
 * dot products on the stored bytes (contract and error bound: x86/kernels.h).
 *
 * Scores on vpdpbusd: the chunk's keys transposed once to 4 bytes a key and
 * shared by the tile's vectors, as the bf16 kernels transpose to pairs of
 * dims (avx512_attention.c). P.V on vpdpwssd: the value rows widened to
 * int16 and interleaved by pairs of keys, as the bf16 kernels interleave
 * bf16 rows; the exact int32 sums turn into floats once per chunk. */
#include <string.h>

#include "kernels.h"

#if CV_HAVE_ATT_I8DOT
CV_TARGET_BEGIN("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vnni")

#include "avx512_attention_parts.h"

static CV_ALWAYS_INLINE __mmask64 att_mask64(int64_t left) {
    return left >= 64 ? ~(__mmask64)0 : left <= 0 ? 0 : (((__mmask64)1 << left) - 1u);
}

/* The scaled queries, per 32 dims, as 15-bit integers q = 128 h + l with h
 * in [-128, 127] and l in [0, 127], both int8 (so that each is vpdpbusd's
 * signed operand), and a float scale a block, max|x| / 16383. qp: the bytes
 * h [nv][st] and l [nv][st], then the scales [nv][st / 32] (float), then
 * the corrections -128 sum(h) and -128 sum(l) [nv][st / 32][2] (int32). */
typedef struct split_query {
    int8_t *h, *l;
    float *d;
    int32_t *c;
    int64_t st, nb; /* bytes a vector (head_dim rounded up to 64), blocks a vector */
} split_query;

/* The parts of qp; the score kernels only read them. */
static split_query split_query_at(const void *qp, int64_t hd, int nv) {
    const int64_t st = (hd + 63) & ~(int64_t)63, nb = st / 32;
    int8_t *h = (int8_t *)(uintptr_t)qp;
    float *d = (float *)(void *)(h + 2 * (size_t)nv * (size_t)st);
    const split_query q = {.h = h, .l = h + (size_t)nv * (size_t)st, .d = d,
                           .c = (int32_t *)(void *)(d + (size_t)nv * (size_t)nb), .st = st, .nb = nb};
    return q;
}

void cv_att_quantize_q_i8(void *qp, const float *qt, int64_t hd, int nv) {
    const split_query w = split_query_at(qp, hd, nv);
    const int64_t st = w.st, nb = w.nb;
    int8_t *h = w.h, *l = w.l;
    float *d = w.d;
    int32_t *c = w.c;
    const __m512 sign = _mm512_set1_ps(-0.0f);
    const __m512i low7 = _mm512_set1_epi32(127);
    for (int v = 0; v < nv; v++)
        for (int64_t b = 0; b < nb; b++) {
            const int64_t d0 = 32 * b;
            const __m512 lo = _mm512_maskz_loadu_ps(att_mask(hd - d0), qt + v * hd + d0);
            const __m512 hi = _mm512_maskz_loadu_ps(att_mask(hd - d0 - 16), qt + v * hd + d0 + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, lo), _mm512_andnot_ps(sign, hi)));
            const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 16383.0f / amax : 0.0f);
            /* nearest, ties to even: |q| <= 16383 (amax * (16383 / amax) rounds to 16383) */
            const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
            /* h = floor(q / 128): a logical shift of q + 16384 (>= 0), less 128 */
            const __m512i off = _mm512_set1_epi32(16384), m128 = _mm512_set1_epi32(128);
            const __m512i h0 = _mm512_sub_epi32(_mm512_srli_epi32(_mm512_add_epi32(q0, off), 7), m128);
            const __m512i h1 = _mm512_sub_epi32(_mm512_srli_epi32(_mm512_add_epi32(q1, off), 7), m128);
            const __m512i l0 = _mm512_and_si512(q0, low7), l1 = _mm512_and_si512(q1, low7);
            int8_t *hv = h + v * st + d0, *lv = l + v * st + d0;
            _mm_storeu_si128((__m128i *)(void *)hv, _mm512_cvtepi32_epi8(h0));
            _mm_storeu_si128((__m128i *)(void *)(hv + 16), _mm512_cvtepi32_epi8(h1));
            _mm_storeu_si128((__m128i *)(void *)lv, _mm512_cvtepi32_epi8(l0));
            _mm_storeu_si128((__m128i *)(void *)(lv + 16), _mm512_cvtepi32_epi8(l1));
            d[v * nb + b] = amax / 16383.0f;
            c[2 * (v * nb + b)] = -128 * _mm512_reduce_add_epi32(_mm512_add_epi32(h0, h1));
            c[2 * (v * nb + b) + 1] = -128 * _mm512_reduce_add_epi32(_mm512_add_epi32(l0, l1));
        }
}

/* Dims [d0, d0 + 64) of the chunk's keys, 4 bytes a key: kt[g][i] = K_i[d0 +
 * 4g .. d0 + 4g + 3], each byte plus 128 (unsigned), for g < 16 and i < 16
 * nkb. Dims past head_dim and keys past nk are 128: against a zero query byte
 * or the block's correction they add nothing (a key past nk scores 0). */
static CV_ALWAYS_INLINE void transpose_keys_i8(uint32_t (*kt)[CV_ATT_KCHUNK], const void *const *kp, int nk, int nkb,
                                               int64_t d0, int64_t hd) {
    const __mmask64 m = att_mask64(hd - d0);
    const __m512i bias = _mm512_set1_epi8((char)0x80);
    for (int b = 0; b < nkb; b++) {
        __m512i r[16];
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++)
            r[i] = _mm512_xor_si512(16 * b + i < nk ? _mm512_maskz_loadu_epi8(m, (const int8_t *)kp[16 * b + i] + d0)
                                                    : _mm512_setzero_si512(),
                                    bias);
        store_keys_by_group(kt, r, b);
    }
}

/* Dims [d0, d0 + 64) of the scores of NV vectors (from query row v0) against
 * 16 NKB keys: per 32-dim block two int32 lanes a key (the query's h and l
 * bytes), from the block's corrections through 8 vpdpbusd each, joined as
 * 128 h + l (the exact block dot), then one FMA with the block's scale into
 * the float score (its earlier blocks from sc; first: zero). */
static CV_ALWAYS_INLINE void scores_slab_i8(float *sc, const split_query *w, int v0, const int NV, const int NKB,
                                            const uint32_t (*kt)[CV_ATT_KCHUNK], int64_t d0, int64_t hd, int first) {
    __m512 f[4][2];
#pragma GCC unroll 4
    for (int v = 0; v < NV; v++)
#pragma GCC unroll 2
        for (int b = 0; b < NKB; b++)
            f[v][b] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(sc + v * CV_ATT_KCHUNK + 16 * b);
    const int nblk = d0 + 32 < hd ? 2 : 1;
    for (int x = 0; x < nblk; x++) {
        const int64_t blk = d0 / 32 + x;
        __m512i ah[4][2], al[4][2];
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++)
#pragma GCC unroll 2
            for (int b = 0; b < NKB; b++) {
                ah[v][b] = _mm512_set1_epi32(w->c[2 * ((v0 + v) * w->nb + blk)]);
                al[v][b] = _mm512_set1_epi32(w->c[2 * ((v0 + v) * w->nb + blk) + 1]);
            }
#pragma GCC unroll 8
        for (int g = 8 * x; g < 8 * x + 8; g++) {
            __m512i k[2];
#pragma GCC unroll 2
            for (int b = 0; b < NKB; b++) k[b] = _mm512_load_si512((const void *)&kt[g][16 * b]);
#pragma GCC unroll 4
            for (int v = 0; v < NV; v++) {
                int32_t fh, fl; /* query bytes d0 + 4g .. d0 + 4g + 3 */
                memcpy(&fh, w->h + (v0 + v) * w->st + d0 + 4 * g, sizeof fh);
                memcpy(&fl, w->l + (v0 + v) * w->st + d0 + 4 * g, sizeof fl);
                const __m512i qh = _mm512_set1_epi32(fh), ql = _mm512_set1_epi32(fl);
#pragma GCC unroll 2
                for (int b = 0; b < NKB; b++) {
                    ah[v][b] = _mm512_dpbusd_epi32(ah[v][b], k[b], qh);
                    al[v][b] = _mm512_dpbusd_epi32(al[v][b], k[b], ql);
                }
            }
        }
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++) {
            const __m512 s = _mm512_set1_ps(w->d[(v0 + v) * w->nb + blk]);
#pragma GCC unroll 2
            for (int b = 0; b < NKB; b++) {
                const __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(ah[v][b], 7), al[v][b]);
                f[v][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, f[v][b]);
            }
        }
    }
#pragma GCC unroll 4
    for (int v = 0; v < NV; v++)
#pragma GCC unroll 2
        for (int b = 0; b < NKB; b++) _mm512_storeu_ps(sc + v * CV_ATT_KCHUNK + 16 * b, f[v][b]);
}

#define SLAB_I8(NV)                                                                                 \
    do {                                                                                            \
        if (nkb == 2) scores_slab_i8(sc + v0 * CV_ATT_KCHUNK, &w, v0, NV, 2, kt, d0, hd, d0 == 0);   \
        else scores_slab_i8(sc + v0 * CV_ATT_KCHUNK, &w, v0, NV, 1, kt, d0, hd, d0 == 0);            \
    } while (0)

void cv_att_scores_i8(float *sc, const void *qp, int64_t hd, int nv, const int *nval, const void *const *kp,
                      const void *const *pf, int npf) {
    const split_query w = split_query_at(qp, hd, nv);
    const int nk = cv_att_max_valid(nval, 0, nv);
    const size_t row_bytes = (size_t)hd;
    if (nk <= 0) {
        if (pf) prefetch_share(pf, npf, 0, 1, row_bytes);
        return;
    }
    const int nkb = nk > 16 ? 2 : 1;
    _Alignas(64) uint32_t kt[16][CV_ATT_KCHUNK];
    const int64_t steps = (hd + 63) / 64; /* the next chunk's K rows, a share per 64 dims */
    for (int64_t d0 = 0, s = 0; d0 < hd; d0 += 64, s++) {
        if (pf) prefetch_share(pf, npf, (int)s, (int)steps, row_bytes);
        transpose_keys_i8(kt, kp, nk, nkb, d0, hd);
        for (int v0 = 0; v0 < nv;) {
            const int nvg = group_size(nv, v0);
            switch (nvg) {
            case 1: SLAB_I8(1); break;
            case 2: SLAB_I8(2); break;
            case 3: SLAB_I8(3); break;
            default: SLAB_I8(4); break;
            }
            v0 += nvg;
        }
    }
}
#undef SLAB_I8

/* One key pair into the NV x 2 DB int32 accumulators of dims [d0, d0 + 32 DB):
 * rows ra and rb (HAS_B 0: zero) widened to int16 and interleaved as (ra[d],
 * rb[d]) pairs, times each vector's pair of int16 weights pw[v * 16]. */
static CV_ALWAYS_INLINE void pv_pair_i8(__m512i *a, const uint32_t *pw, const int8_t *ra, const int8_t *rb,
                                        const int HAS_B, int64_t d0, const int NV, const int DB, const __mmask32 *mk,
                                        __m512i ilo, __m512i ihi) {
    __m512i pr[4];
#pragma GCC unroll 2
    for (int b = 0; b < DB; b++) {
        const __m512i va = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(mk[b], ra + d0 + 32 * b));
        const __m512i vb =
            HAS_B ? _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(mk[b], rb + d0 + 32 * b)) : _mm512_setzero_si512();
        interleave_pair(pr + 2 * b, va, vb, NV, ilo, ihi);
    }
#pragma GCC unroll 4
    for (int v = 0; v < NV; v++) {
        const __m512i p = _mm512_set1_epi32((int)pw[v * (CV_ATT_KCHUNK / 2)]);
#pragma GCC unroll 4
        for (int b = 0; b < 2 * DB; b++) a[v * 2 * DB + b] = _mm512_dpwssd_epi32(a[v * 2 * DB + b], pr[b], p);
    }
}

/* Dims [d0, d0 + 32 DB) of NV vectors: acc = acc * alpha + sw * sum over key
 * pairs of (w_2m, w_2m+1) . (V_2m[d], V_2m+1[d]) in int32; a missing V_2m+1
 * (odd nk) is zero. */
static CV_ALWAYS_INLINE void pv_blk_i8(float *acc, const uint32_t *pw, const float *sw, const float *alpha,
                                       int64_t hd, int64_t d0, const int NV, const int DB, int nk,
                                       const void *const *vp, const void *const *pf, int npf) {
    __m512i ilo, ihi;
    pair_interleave_index(&ilo, &ihi);
    const __mmask32 mk[2] = {att_mask32(hd - d0), att_mask32(hd - d0 - 32)};
    __m512i a[2 * 2 * 4];
#pragma GCC unroll 16
    for (int b = 0; b < 2 * DB * NV; b++) a[b] = _mm512_setzero_si512();
    const size_t row_bytes = (size_t)hd;
    const int pairs = (nk + 1) / 2;
    int i = 0;
    for (; i + 1 < nk; i += 2) {
        if (pf) prefetch_share(pf, npf, i / 2, pairs, row_bytes);
        pv_pair_i8(a, pw + i / 2, vp[i], vp[i + 1], 1, d0, NV, DB, mk, ilo, ihi);
    }
    if (i < nk) {
        if (pf) prefetch_share(pf, npf, i / 2, pairs, row_bytes);
        pv_pair_i8(a, pw + i / 2, vp[i], NULL, 0, d0, NV, DB, mk, ilo, ihi);
    }
#pragma GCC unroll 4
    for (int v = 0; v < NV; v++) {
        const __m512 al = _mm512_set1_ps(alpha[v]), s = _mm512_set1_ps(sw[v]);
#pragma GCC unroll 4
        for (int b = 0; b < 2 * DB; b++) {
            const __mmask16 m = att_mask(hd - d0 - 16 * b);
            float *o = acc + v * hd + d0 + 16 * b;
            const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, o), al);
            _mm512_mask_storeu_ps(o, m, _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[v * 2 * DB + b]), s, x));
        }
    }
}

static CV_ALWAYS_INLINE void pv_group_i8(float *acc, const uint32_t *pw, const float *sw, const float *alpha,
                                         int64_t hd, const int NV, int nk, const void *const *vp,
                                         const void *const *pf, int npf) {
    int64_t d = 0;
    for (; d + 64 <= hd; d += 64, pf = NULL) pv_blk_i8(acc, pw, sw, alpha, hd, d, NV, 2, nk, vp, pf, npf);
    for (; d < hd; d += 32, pf = NULL) pv_blk_i8(acc, pw, sw, alpha, hd, d, NV, 1, nk, vp, pf, npf);
}

void cv_att_pv_i8(float *acc, const float *sc, const float *alpha, int64_t hd, int nv, const int *nval,
                  const void *const *vp, const void *const *pf, int npf) {
    /* each vector's weights as int16 pairs of keys, one scale a vector; zero
     * past the chunk's valid keys (the softmax left zeros there) */
    uint32_t pw[CV_ATT_TILE * CV_ATT_KCHUNK / 2];
    float sw[CV_ATT_TILE];
    const int nk_all = cv_att_max_valid(nval, 0, nv);
    for (int v = 0; v < nv; v++) {
        const __m512 lo = _mm512_maskz_loadu_ps(att_mask(nk_all), sc + v * CV_ATT_KCHUNK);
        const __m512 hi = _mm512_maskz_loadu_ps(att_mask(nk_all - 16), sc + v * CV_ATT_KCHUNK + 16);
        const float mx = _mm512_reduce_max_ps(_mm512_max_ps(lo, hi)); /* weights are >= 0 */
        const __m512 inv = _mm512_set1_ps(mx > 0.0f ? 32767.0f / mx : 0.0f);
        const __m256i wl = _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(lo, inv)));
        const __m256i wh = _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(hi, inv)));
        _mm512_storeu_si512((void *)(pw + v * (CV_ATT_KCHUNK / 2)), _mm512_inserti64x4(_mm512_castsi256_si512(wl), wh, 1));
        sw[v] = mx / 32767.0f;
    }
    for (int v0 = 0; v0 < nv;) {
        const int nvg = group_size(nv, v0);
        const int nk = cv_att_max_valid(nval, v0, nvg);
        float *a = acc + v0 * hd;
        const uint32_t *p = pw + v0 * (CV_ATT_KCHUNK / 2);
        const void *const *gpf = nk > 0 ? pf : NULL;
        switch (nvg) {
        case 1: pv_group_i8(a, p, sw + v0, alpha + v0, hd, 1, nk, vp, gpf, npf); break;
        case 2: pv_group_i8(a, p, sw + v0, alpha + v0, hd, 2, nk, vp, gpf, npf); break;
        case 3: pv_group_i8(a, p, sw + v0, alpha + v0, hd, 3, nk, vp, gpf, npf); break;
        default: pv_group_i8(a, p, sw + v0, alpha + v0, hd, 4, nk, vp, gpf, npf); break;
        }
        if (gpf) pf = NULL;
        v0 += nvg;
    }
    if (pf) prefetch_share(pf, npf, 0, 1, (size_t)hd); /* no group had a valid key */
}
CV_TARGET_END
#endif /* CV_HAVE_ATT_I8DOT */
