/* AVX-512 LoRA kernels (lora.c: the shrink and the expand of up to
 * CV_LORA_ROWS rows of one adapter). Each row has its own accumulators,
 * summed in the same order whatever the number of rows. */
#include "../lora.h"
#include "kernels.h"
#include "vec_math.h"

#if CV_HAVE_AVX512
CV_TARGET_AVX512_BEGIN
static CV_ALWAYS_INLINE __m512 load16_avx512(const void *w, const int bf16, size_t i, __mmask16 m) {
    if (!bf16) return _mm512_maskz_loadu_ps(m, (const float *)w + i);
    const __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)w + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Asks for the line at byte off from w, which may lie past w's end (the next
 * matrix's, or nothing: a prefetch never faults); the address is computed as
 * an integer, not as a pointer outside w. */
static CV_ALWAYS_INLINE void prefetch_at(const void *w, size_t off) {
    _mm_prefetch((const char *)(uintptr_t)((uintptr_t)w + off), _MM_HINT_T0);
}

/* Elements ahead of the one read that the shrink asks for (prefetch), as the
 * short streams of an adapter's rows are read from memory once per step. */
#define LORA_PF_AHEAD 256

/* Rank rows of A a shrink pass takes at once (each x chunk loaded once for them). */
#define SHRINK_RB 4

/* Elements [e, e + 16) of the shrink block below (m: the lanes in range). */
static CV_ALWAYS_INLINE void shrink_chunk_avx512(__m512 s[CV_LORA_ROWS][SHRINK_RB], const float *const *x,
                                                 const int nr, const void *a, const int bf16, int64_t r0,
                                                 const int nb, int64_t in, int64_t e, __mmask16 m,
                                                 cv_prefetch_spread *pf) {
    __m512 w[SHRINK_RB];
    for (int k = 0; k < nb; k++) {
        const size_t at = (size_t)(r0 + k) * (size_t)in + (size_t)e;
        w[k] = load16_avx512(a, bf16, at, m);
        prefetch_at(a, (at + LORA_PF_AHEAD) * (bf16 ? 2 : 4));
    }
    cv_prefetch_step(pf);
    for (int i = 0; i < nr; i++) {
        const __m512 xv = _mm512_maskz_loadu_ps(m, x[i] + e);
        for (int k = 0; k < nb; k++) s[i][k] = _mm512_fmadd_ps(xv, w[k], s[i][k]);
    }
}

/* t[i][r0 .. r0 + nb) for nr rows; nr, nb and bf16 are constants where it is inlined. */
static CV_ALWAYS_INLINE void shrink_block_avx512(float *t, int64_t ts, const float *const *x, const int nr,
                                                 const void *a, const int bf16, int64_t r0, const int nb,
                                                 int64_t in, cv_prefetch_spread *pf) {
    __m512 s[CV_LORA_ROWS][SHRINK_RB];
    for (int i = 0; i < nr; i++)
        for (int k = 0; k < nb; k++) s[i][k] = _mm512_setzero_ps();
    int64_t e = 0;
    /* whole chunks with a constant mask (plain loads), then the tail: the same sums */
    for (; e + 16 <= in; e += 16) shrink_chunk_avx512(s, x, nr, a, bf16, r0, nb, in, e, (__mmask16)0xffff, pf);
    if (e < in) shrink_chunk_avx512(s, x, nr, a, bf16, r0, nb, in, e, cv_tail_mask16(in - e), pf);
    for (int i = 0; i < nr; i++)
        for (int k = 0; k < nb; k++) t[i * ts + r0 + k] = _mm512_reduce_add_ps(s[i][k]);
}

static CV_ALWAYS_INLINE void shrink_avx512(float *t, int64_t ts, const float *const *x, const int nr, const void *a,
                                           const int bf16, int64_t rank, int64_t in, cv_prefetch_spread *pf) {
    int64_t r = 0;
    for (; r + SHRINK_RB <= rank; r += SHRINK_RB) shrink_block_avx512(t, ts, x, nr, a, bf16, r, SHRINK_RB, in, pf);
    switch (rank - r) {
    case 3: shrink_block_avx512(t, ts, x, nr, a, bf16, r, 3, in, pf); break;
    case 2: shrink_block_avx512(t, ts, x, nr, a, bf16, r, 2, in, pf); break;
    case 1: shrink_block_avx512(t, ts, x, nr, a, bf16, r, 1, in, pf); break;
    default: break;
    }
}

void cv_lora_shrink_avx512(float *t, int64_t t_stride, const float *const *x, int nr, const void *a, int bf16,
                           int64_t rank, int64_t in, const void *next, int64_t next_bytes) {
    /* one step per 16-value chunk of each pass over SHRINK_RB rank rows */
    cv_prefetch_spread pf = cv_prefetch_spread_of(next, (next_bytes + 63) / 64,
                                                  (rank + SHRINK_RB - 1) / SHRINK_RB * ((in + 15) / 16));
#define SHRINK(n)                                                                                                     \
    case n:                                                                                                           \
        if (bf16) shrink_avx512(t, t_stride, x, n, a, 1, rank, in, &pf);                                              \
        else shrink_avx512(t, t_stride, x, n, a, 0, rank, in, &pf);                                                   \
        return;
    switch (nr) { SHRINK(1) SHRINK(2) SHRINK(3) SHRINK(4) default: return; }
#undef SHRINK
}

/* Columns [o, o + 16 * nc) of nr rows, the last chunk masked by m. */
static CV_ALWAYS_INLINE void expand_cols_avx512(float *const *y, const float *t, int64_t ts, const int nr,
                                                const int nc, const void *bt, const int bf16, int64_t rank,
                                                int64_t o, __m512 vs, __mmask16 m, cv_prefetch_spread *pf) {
    __m512 acc[CV_LORA_ROWS][2];
    for (int i = 0; i < nr; i++)
        for (int c = 0; c < nc; c++) acc[i][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < rank; j++) {
        __m512 w[2];
        for (int c = 0; c < nc; c++) {
            const size_t at = (size_t)CV_LORA_BT_AT(rank, j, o + 16 * c);
            w[c] = load16_avx512(bt, bf16, at, 0xffff); /* padded panels */
            prefetch_at(bt, (at + (size_t)(nc * rank * 16)) * (bf16 ? 2 : 4));
        }
        cv_prefetch_step(pf);
        for (int i = 0; i < nr; i++) {
            const __m512 tj = _mm512_set1_ps(t[i * ts + j]);
            for (int c = 0; c < nc; c++) acc[i][c] = _mm512_fmadd_ps(tj, w[c], acc[i][c]);
        }
    }
    for (int i = 0; i < nr; i++)
        for (int c = 0; c < nc; c++) {
            float *yp = y[i] + o + 16 * c;
            const __mmask16 mc = c == nc - 1 ? m : (__mmask16)0xffff;
            _mm512_mask_storeu_ps(yp, mc, _mm512_fmadd_ps(vs, acc[i][c], _mm512_maskz_loadu_ps(mc, yp)));
        }
}

static CV_ALWAYS_INLINE void expand_avx512(float *const *y, const float *t, int64_t ts, const int nr, const void *bt,
                                           const int bf16, int64_t rank, int64_t out, float scale,
                                           cv_prefetch_spread *pf) {
    const __m512 vs = _mm512_set1_ps(scale);
    int64_t o = 0;
    for (; o + 32 <= out; o += 32) expand_cols_avx512(y, t, ts, nr, 2, bt, bf16, rank, o, vs, 0xffff, pf);
    for (; o < out; o += 16) expand_cols_avx512(y, t, ts, nr, 1, bt, bf16, rank, o, vs, cv_tail_mask16(out - o), pf);
}

void cv_lora_expand_avx512(float *const *y, const float *t, int64_t t_stride, int nr, const void *bt, int bf16,
                           int64_t rank, int64_t out, float scale, const void *next, int64_t next_bytes) {
    /* one step per rank row of each 32- (or 16-) column pass */
    cv_prefetch_spread pf = cv_prefetch_spread_of(next, (next_bytes + 63) / 64, rank * (out / 32 + (out % 32 + 15) / 16));
#define EXPAND(n)                                                                                                     \
    case n:                                                                                                           \
        if (bf16) expand_avx512(y, t, t_stride, n, bt, 1, rank, out, scale, &pf);                                     \
        else expand_avx512(y, t, t_stride, n, bt, 0, rank, out, scale, &pf);                                          \
        return;
    switch (nr) { EXPAND(1) EXPAND(2) EXPAND(3) EXPAND(4) default: return; }
#undef EXPAND
}
CV_TARGET_END
#endif
