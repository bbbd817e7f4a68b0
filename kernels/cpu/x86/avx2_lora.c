/* AVX2 LoRA kernels (lora.c: the shrink and the expand of up to CV_LORA_ROWS
 * rows of one adapter). Each row has its own accumulators, summed in the same
 * order whatever the number of rows. */
#include "../lora.h"
#include "kernels.h"
#include "vec_math.h"

#if CV_HAVE_AVX2
CV_TARGET_AVX2_BEGIN
static CV_ALWAYS_INLINE __m256 load8_avx2(const void *w, const int bf16, size_t i) {
    if (!bf16) return _mm256_loadu_ps((const float *)w + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
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
#define SHRINK_RB 2

/* t[i][r0 .. r0 + nb) for nr rows; nr, nb and bf16 are constants where it is inlined. */
static CV_ALWAYS_INLINE void shrink_block_avx2(float *t, int64_t ts, const float *const *x, const int nr, const void *a,
                                               const int bf16, int64_t r0, const int nb, int64_t in,
                                               cv_prefetch_spread *pf) {
    __m256 s[CV_LORA_ROWS][SHRINK_RB];
    for (int i = 0; i < nr; i++)
        for (int k = 0; k < nb; k++) s[i][k] = _mm256_setzero_ps();
    int64_t e = 0;
    for (; e + 8 <= in; e += 8) {
        __m256 w[SHRINK_RB];
        for (int k = 0; k < nb; k++) {
            const size_t at = (size_t)(r0 + k) * (size_t)in + (size_t)e;
            w[k] = load8_avx2(a, bf16, at);
            prefetch_at(a, (at + LORA_PF_AHEAD) * (bf16 ? 2 : 4));
        }
        cv_prefetch_step(pf);
        for (int i = 0; i < nr; i++) {
            const __m256 xv = _mm256_loadu_ps(x[i] + e);
            for (int k = 0; k < nb; k++) s[i][k] = _mm256_fmadd_ps(xv, w[k], s[i][k]);
        }
    }
    for (int i = 0; i < nr; i++)
        for (int k = 0; k < nb; k++) {
            const size_t off = (size_t)(r0 + k) * (size_t)in;
            float v = cv_hsum256(s[i][k]);
            for (int64_t q = e; q < in; q++) v += x[i][q] * cv_lora_w_at(a, bf16, off + (size_t)q);
            t[i * ts + r0 + k] = v;
        }
}

static CV_ALWAYS_INLINE void shrink_avx2(float *t, int64_t ts, const float *const *x, const int nr, const void *a,
                                         const int bf16, int64_t rank, int64_t in, cv_prefetch_spread *pf) {
    int64_t r = 0;
    for (; r + SHRINK_RB <= rank; r += SHRINK_RB) shrink_block_avx2(t, ts, x, nr, a, bf16, r, SHRINK_RB, in, pf);
    if (r < rank) shrink_block_avx2(t, ts, x, nr, a, bf16, r, 1, in, pf);
}

void cv_lora_shrink_avx2(float *t, int64_t t_stride, const float *const *x, int nr, const void *a, int bf16,
                         int64_t rank, int64_t in, const void *next, int64_t next_bytes) {
    /* one step per 8-value chunk of each pass over SHRINK_RB rank rows */
    cv_prefetch_spread pf = cv_prefetch_spread_of(next, (next_bytes + 63) / 64,
                                                  (rank + SHRINK_RB - 1) / SHRINK_RB * (in / 8));
#define SHRINK(n)                                                                                                     \
    case n:                                                                                                           \
        if (bf16) shrink_avx2(t, t_stride, x, n, a, 1, rank, in, &pf);                                                \
        else shrink_avx2(t, t_stride, x, n, a, 0, rank, in, &pf);                                                     \
        return;
    switch (nr) { SHRINK(1) SHRINK(2) SHRINK(3) SHRINK(4) default: return; }
#undef SHRINK
}

/* Columns [o, o + 8 * nc) of nr rows. */
static CV_ALWAYS_INLINE void expand_cols_avx2(float *const *y, const float *t, int64_t ts, const int nr, const int nc,
                                              const void *bt, const int bf16, int64_t rank, int64_t o, __m256 vs,
                                              cv_prefetch_spread *pf) {
    __m256 acc[CV_LORA_ROWS][2];
    for (int i = 0; i < nr; i++)
        for (int c = 0; c < nc; c++) acc[i][c] = _mm256_setzero_ps();
    for (int64_t j = 0; j < rank; j++) {
        __m256 w[2];
        for (int c = 0; c < nc; c++) w[c] = load8_avx2(bt, bf16, (size_t)CV_LORA_BT_AT(rank, j, o + 8 * c));
        prefetch_at(bt, ((size_t)CV_LORA_BT_AT(rank, j, o) + (size_t)(rank * 16)) * (bf16 ? 2 : 4)); /* next panel */
        cv_prefetch_step(pf);
        for (int i = 0; i < nr; i++) {
            const __m256 tj = _mm256_set1_ps(t[i * ts + j]);
            for (int c = 0; c < nc; c++) acc[i][c] = _mm256_fmadd_ps(tj, w[c], acc[i][c]);
        }
    }
    for (int i = 0; i < nr; i++)
        for (int c = 0; c < nc; c++) {
            float *yp = y[i] + o + 8 * c;
            _mm256_storeu_ps(yp, _mm256_fmadd_ps(vs, acc[i][c], _mm256_loadu_ps(yp)));
        }
}

static CV_ALWAYS_INLINE void expand_avx2(float *const *y, const float *t, int64_t ts, const int nr, const void *bt,
                                         const int bf16, int64_t rank, int64_t out, float scale,
                                         cv_prefetch_spread *pf) {
    const __m256 vs = _mm256_set1_ps(scale);
    int64_t o = 0;
    for (; o + 16 <= out; o += 16) expand_cols_avx2(y, t, ts, nr, 2, bt, bf16, rank, o, vs, pf);
    for (; o + 8 <= out; o += 8) expand_cols_avx2(y, t, ts, nr, 1, bt, bf16, rank, o, vs, pf);
    for (; o < out; o++) /* the tail as the plain code computes it */
        for (int i = 0; i < nr; i++) {
            float acc = 0.0f;
            for (int64_t j = 0; j < rank; j++) acc += t[i * ts + j] * cv_lora_w_at(bt, bf16, (size_t)CV_LORA_BT_AT(rank, j, o));
            y[i][o] += scale * acc;
        }
}

void cv_lora_expand_avx2(float *const *y, const float *t, int64_t t_stride, int nr, const void *bt, int bf16,
                         int64_t rank, int64_t out, float scale, const void *next, int64_t next_bytes) {
    /* one step per rank row of each 16- (or 8-) column pass */
    cv_prefetch_spread pf = cv_prefetch_spread_of(next, (next_bytes + 63) / 64, rank * (out / 16 + (out % 16) / 8));
#define EXPAND(n)                                                                                                     \
    case n:                                                                                                           \
        if (bf16) expand_avx2(y, t, t_stride, n, bt, 1, rank, out, scale, &pf);                                       \
        else expand_avx2(y, t, t_stride, n, bt, 0, rank, out, scale, &pf);                                            \
        return;
    switch (nr) { EXPAND(1) EXPAND(2) EXPAND(3) EXPAND(4) default: return; }
#undef EXPAND
}
CV_TARGET_END
#endif
