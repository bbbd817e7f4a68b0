/* The pieces the AVX-512 attention kernels share (avx512_attention.c for the
 * fp32 and bf16 paths, avx512_attention_i8.c for the int8 dot path).
 * Include it inside a target region: its functions take the includer's
 * target, and an AVX-512 one inlines into every AVX-512 level above it. */
#ifndef CV_X86_AVX512_ATTENTION_PARTS_H
#define CV_X86_AVX512_ATTENTION_PARTS_H

#include "kernels.h"

#ifdef CV_EMULATE_AVX512
#define CV_KEEP512(v) ((void)0)
#else
/* Keeps v in a register: stops the compiler from folding a reused load into
 * every FMA (a load per FMA). */
#define CV_KEEP512(v) __asm__("" : "+v"(v))
#endif

static CV_ALWAYS_INLINE __mmask16 att_mask(int64_t left) {
    return left >= 16 ? (__mmask16)0xffff : left <= 0 ? 0 : (__mmask16)((1u << left) - 1u);
}

static CV_ALWAYS_INLINE __mmask32 att_mask32(int64_t left) {
    return left >= 32 ? (__mmask32)0xffffffffu : left <= 0 ? 0 : (__mmask32)((1u << left) - 1u);
}

/* Vector groups of the P.V kernels: groups of 4 when nv is a multiple of 4,
 * else groups of 3 (a tile of t tokens x 3 heads splits evenly), then the
 * rest. Returns the size of the group starting at v0. */
static inline int group_size(int nv, int v0) {
    const int g = (nv % 4 == 0) ? 4 : 3;
    return nv - v0 < g ? nv - v0 : g;
}

/* Share j of n of the rows of pf (row_bytes each) asked for: rows
 * [npf j / n, npf (j + 1) / n), the slice of the next chunk's rows that one
 * step of a kernel's loop takes, so the stream spreads over the chunk. */
static CV_ALWAYS_INLINE void prefetch_share(const void *const *pf, int npf, int j, int n, size_t row_bytes) {
    for (int r = (int)((int64_t)npf * j / n), e = (int)((int64_t)npf * (j + 1) / n); r < e; r++)
        cv_prefetch_bytes(pf[r], row_bytes);
}

/* Transposes 16 rows of 16 dwords (r[i][c] -> r[c][i]): pairs within 128-bit
 * lanes, then 4 x 4 blocks of lanes. */
static CV_ALWAYS_INLINE void transpose16(__m512i *r) {
    __m512i t[16];
#pragma GCC unroll 8
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    /* u[4g + j], lane L: column 4L + j of rows 4g .. 4g + 3 */
    __m512i u[16];
#pragma GCC unroll 4
    for (int g = 0; g < 16; g += 4) {
        u[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
        u[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
        u[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
        u[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
    }
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
        const __m512i x = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x44), y = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xee);
        const __m512i z = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x44),
                      w = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xee);
        r[j] = _mm512_shuffle_i32x4(x, z, 0x88);
        r[4 + j] = _mm512_shuffle_i32x4(x, z, 0xdd);
        r[8 + j] = _mm512_shuffle_i32x4(y, w, 0x88);
        r[12 + j] = _mm512_shuffle_i32x4(y, w, 0xdd);
    }
}

/* Keys 16 b .. 16 b + 15 of a chunk into kt by 32-bit groups of dims:
 * r[i] holds key 16 b + i's slab, and kt[g][16 b + i] gets its group g. */
static CV_ALWAYS_INLINE void store_keys_by_group(uint32_t (*kt)[CV_ATT_KCHUNK], __m512i *r, int b) {
    transpose16(r);
#pragma GCC unroll 16
    for (int g = 0; g < 16; g++) _mm512_store_si512((void *)&kt[g][16 * b], r[g]);
}

/* The word permutes of P.V by pairs of keys: word 2j of a pair register from
 * row a, word 2j + 1 from row b (ilo: words 0-15 of each, ihi: 16-31). */
static CV_ALWAYS_INLINE void pair_interleave_index(__m512i *ilo, __m512i *ihi) {
    static const uint16_t interleave[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                            8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    *ilo = _mm512_loadu_si512((const void *)interleave);
    *ihi = _mm512_add_epi16(*ilo, _mm512_set1_epi16(16));
}

/* 32 words of rows a and b as 16 (a[d], b[d]) pairs in pr[0] and 16 in
 * pr[1], kept in registers when NV > 1 vectors reuse them. */
static CV_ALWAYS_INLINE void interleave_pair(__m512i *pr, __m512i a, __m512i b, const int NV, __m512i ilo,
                                             __m512i ihi) {
    pr[0] = _mm512_permutex2var_epi16(a, ilo, b);
    pr[1] = _mm512_permutex2var_epi16(a, ihi, b);
    if (NV > 1) {
        CV_KEEP512(pr[0]);
        CV_KEEP512(pr[1]);
    }
}

#endif /* CV_X86_AVX512_ATTENTION_PARTS_H */
