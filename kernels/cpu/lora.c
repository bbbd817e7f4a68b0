/* LoRA's low-rank pair over the rows of one adapter (one segment of a batch
 * grouped by adapter, as Punica's SGMV): shrink t = x . A^T to the rank, then
 * expand y += scale * (t . B^T). Each row is computed alone, in a fixed order,
 * so a row's result does not depend on the other rows of the step. */
#include <stdlib.h>
#include <string.h>

#include "cpu_internal.h"
#include "vec_math.h"
#include "lora.h"

/* Rows per chunk a thread claims. */
#define LORA_GRAIN 4096.0

/* Adapter weights are float32 or bf16 (the top half of a float32). */
static inline float w_at(const void *w, int bf16, size_t i) {
    if (!bf16) return ((const float *)w)[i];
    uint32_t u = (uint32_t)((const uint16_t *)w)[i] << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static float dot_scalar(const float *x, const void *w, int bf16, size_t off, int64_t n) {
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) s += x[i] * w_at(w, bf16, off + (size_t)i);
    return s;
}

/* y[o] += scale * sum_j t[j] * bt[j][o] for o in [o0, out) */
static void expand_scalar(float *y, const float *t, const void *bt, int bf16, int64_t rank, int64_t o0, int64_t out,
                          float scale) {
    for (int64_t o = o0; o < out; o++) {
        float acc = 0.0f;
        for (int64_t j = 0; j < rank; j++) acc += t[j] * w_at(bt, bf16, (size_t)(j * out + o));
        y[o] += scale * acc;
    }
}

#if CV_HAVE_AVX2
CV_TARGET_AVX2_BEGIN
static inline __m256 load8_avx2(const void *w, int bf16, size_t i) {
    if (!bf16) return _mm256_loadu_ps((const float *)w + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static float dot_avx2(const float *x, const void *w, int bf16, size_t off, int64_t n) {
    __m256 s = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) s = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), load8_avx2(w, bf16, off + (size_t)i), s);
    float r = cv_hsum256(s);
    for (; i < n; i++) r += x[i] * w_at(w, bf16, off + (size_t)i);
    return r;
}

static void expand_avx2(float *y, const float *t, const void *bt, int bf16, int64_t rank, int64_t out, float scale) {
    const __m256 vs = _mm256_set1_ps(scale);
    int64_t o = 0;
    for (; o + 8 <= out; o += 8) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t j = 0; j < rank; j++)
            acc = _mm256_fmadd_ps(_mm256_set1_ps(t[j]), load8_avx2(bt, bf16, (size_t)(j * out + o)), acc);
        _mm256_storeu_ps(y + o, _mm256_fmadd_ps(vs, acc, _mm256_loadu_ps(y + o)));
    }
    expand_scalar(y, t, bt, bf16, rank, o, out, scale);
}
CV_TARGET_END
#endif

#if CV_HAVE_AVX512
CV_TARGET_AVX512_BEGIN
static inline __m512 load16_avx512(const void *w, int bf16, size_t i, __mmask16 m) {
    if (!bf16) return _mm512_maskz_loadu_ps(m, (const float *)w + i);
    const __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)w + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static float dot_avx512(const float *x, const void *w, int bf16, size_t off, int64_t n) {
    __m512 s = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = cv_tail_mask16(n - i);
        s = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x + i), load16_avx512(w, bf16, off + (size_t)i, m), s);
    }
    return _mm512_reduce_add_ps(s);
}

static void expand_avx512(float *y, const float *t, const void *bt, int bf16, int64_t rank, int64_t out,
                          float scale) {
    const __m512 vs = _mm512_set1_ps(scale);
    for (int64_t o = 0; o < out; o += 16) {
        const __mmask16 m = cv_tail_mask16(out - o);
        __m512 acc = _mm512_setzero_ps();
        for (int64_t j = 0; j < rank; j++)
            acc = _mm512_fmadd_ps(_mm512_set1_ps(t[j]), load16_avx512(bt, bf16, (size_t)(j * out + o), m), acc);
        _mm512_mask_storeu_ps(y + o, m, _mm512_fmadd_ps(vs, acc, _mm512_maskz_loadu_ps(m, y + o)));
    }
}
CV_TARGET_END
#endif

/* t[rank] = x . A^T for one row */
static void shrink_row(float *t, const float *x, const void *a, int bf16, int64_t rank, int64_t in, int simd) {
    for (int64_t k = 0; k < rank; k++) {
        const size_t off = (size_t)k * (size_t)in;
#if CV_HAVE_AVX512
        if (simd >= CV_SIMD_AVX512) { t[k] = dot_avx512(x, a, bf16, off, in); continue; }
#endif
#if CV_HAVE_AVX2
        if (simd >= CV_SIMD_AVX2) { t[k] = dot_avx2(x, a, bf16, off, in); continue; }
#endif
        t[k] = dot_scalar(x, a, bf16, off, in);
    }
}

static void expand_row(float *y, const float *t, const void *bt, int bf16, int64_t rank, int64_t out, float scale,
                       int simd) {
#if CV_HAVE_AVX512
    if (simd >= CV_SIMD_AVX512) { expand_avx512(y, t, bt, bf16, rank, out, scale); return; }
#endif
#if CV_HAVE_AVX2
    if (simd >= CV_SIMD_AVX2) { expand_avx2(y, t, bt, bf16, rank, out, scale); return; }
#endif
    (void)simd;
    expand_scalar(y, t, bt, bf16, rank, 0, out, scale);
}

typedef struct lora_job {
    float *y;
    const float *x;
    int64_t y_stride, x_stride, in, out;
    const cv_lora_segment *segs;
    int64_t n_segs;
    const int64_t *seg_end; /* [n_segs] cumulative rows: the job's row i is in the first segment ending past i */
    int simd;
    cv_rows *rows;
} lora_job;

static void sgmv_fn(void *arg, int tid, int nth) {
    const lora_job *j = arg;
    float t[CV_CPU_LORA_MAX_RANK];
    (void)tid;
    (void)nth;
    for (int64_t t0, t1; cv_rows_claim(j->rows, &t0, &t1);) {
        int64_t s = 0;
        while (j->seg_end[s] <= t0) s++;
        for (int64_t i = t0; i < t1; i++) {
            while (j->seg_end[s] <= i) s++;
            const cv_lora_segment *g = &j->segs[s];
            const int64_t r = g->row0 + (i - (j->seg_end[s] - g->n_rows));
            const int bf16 = g->dtype == CV_BF16;
            shrink_row(t, j->x + (size_t)r * (size_t)j->x_stride, g->a, bf16, g->rank, j->in, j->simd);
            expand_row(j->y + (size_t)r * (size_t)j->y_stride, t, g->bt, bf16, g->rank, j->out, g->scale, j->simd);
        }
    }
}

void cv_cpu_lora_sgmv(cv_backend *b, float *y, int64_t y_stride, const float *x, int64_t x_stride,
                      const cv_lora_segment *segs, int64_t n_segs, int64_t in, int64_t out, float *tmp) {
    (void)tmp; /* each row's rank vector lives on its thread's stack */
    cv_cpu *c = cv_cpu_of(b);
    int64_t seg_end_small[64], *seg_end = seg_end_small, total = 0, work = 0;
    if (n_segs <= 0) return;
    if (n_segs > 64 && !(seg_end = malloc((size_t)n_segs * sizeof *seg_end))) {
        /* no memory for the row index: run the segments one by one on this thread */
        float t[CV_CPU_LORA_MAX_RANK];
        for (int64_t s = 0; s < n_segs; s++)
            for (int64_t i = 0; i < segs[s].n_rows; i++) {
                const int64_t r = segs[s].row0 + i;
                const int bf16 = segs[s].dtype == CV_BF16;
                shrink_row(t, x + (size_t)r * (size_t)x_stride, segs[s].a, bf16, segs[s].rank, in, c->simd);
                expand_row(y + (size_t)r * (size_t)y_stride, t, segs[s].bt, bf16, segs[s].rank, out, segs[s].scale,
                           c->simd);
            }
        return;
    }
    for (int64_t s = 0; s < n_segs; s++) {
        total += segs[s].n_rows;
        seg_end[s] = total;
        work += segs[s].n_rows * segs[s].rank;
    }
    if (total > 0) {
        cv_rows rows;
        lora_job j = {.y = y, .x = x, .y_stride = y_stride, .x_stride = x_stride, .in = in, .out = out,
                      .segs = segs, .n_segs = n_segs, .seg_end = seg_end, .simd = c->simd, .rows = &rows};
        int nth = cv_threads_for(c, 2.0 * (double)work * (double)(in + out), LORA_GRAIN);
        if (nth > total) nth = (int)total;
        cv_cpu_run_rows(c, nth, &rows, total, sgmv_fn, &j);
    }
    if (seg_end != seg_end_small) free(seg_end);
}
