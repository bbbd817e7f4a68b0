/* LoRA's low-rank pair over the rows of one adapter (one segment of a batch
 * grouped by adapter, as Punica's SGMV): shrink t = x . A^T to the rank, then
 * expand y += scale * (t . B^T). Each row is computed alone, in a fixed order,
 * so a row's result does not depend on the other rows of the step. */
#include <string.h>

#include "cpu_internal.h"
#include "vec_math.h"
#include "lora.h"

/* Rows per chunk a thread claims. */
#define LORA_GRAIN 4096.0

static float dot_scalar(const float *a, const float *b, int64_t n) {
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* y[o] += scale * sum_j t[j] * bt[j][o] for o in [o0, out) */
static void expand_scalar(float *y, const float *t, const float *bt, int64_t rank, int64_t o0, int64_t out,
                          float scale) {
    for (int64_t o = o0; o < out; o++) {
        float acc = 0.0f;
        for (int64_t j = 0; j < rank; j++) acc += t[j] * bt[j * out + o];
        y[o] += scale * acc;
    }
}

#if CV_HAVE_AVX2
CV_TARGET_AVX2_BEGIN
static float dot_avx2(const float *a, const float *b, int64_t n) {
    __m256 s = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) s = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s);
    float r = cv_hsum256(s);
    for (; i < n; i++) r += a[i] * b[i];
    return r;
}

static void expand_avx2(float *y, const float *t, const float *bt, int64_t rank, int64_t out, float scale) {
    const __m256 vs = _mm256_set1_ps(scale);
    int64_t o = 0;
    for (; o + 8 <= out; o += 8) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t j = 0; j < rank; j++)
            acc = _mm256_fmadd_ps(_mm256_set1_ps(t[j]), _mm256_loadu_ps(bt + j * out + o), acc);
        _mm256_storeu_ps(y + o, _mm256_fmadd_ps(vs, acc, _mm256_loadu_ps(y + o)));
    }
    expand_scalar(y, t, bt, rank, o, out, scale);
}
CV_TARGET_END
#endif

#if CV_HAVE_AVX512
CV_TARGET_AVX512_BEGIN
static float dot_avx512(const float *a, const float *b, int64_t n) {
    __m512 s = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = cv_tail_mask16(n - i);
        s = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), s);
    }
    return _mm512_reduce_add_ps(s);
}

static void expand_avx512(float *y, const float *t, const float *bt, int64_t rank, int64_t out, float scale) {
    const __m512 vs = _mm512_set1_ps(scale);
    for (int64_t o = 0; o < out; o += 16) {
        const __mmask16 m = cv_tail_mask16(out - o);
        __m512 acc = _mm512_setzero_ps();
        for (int64_t j = 0; j < rank; j++)
            acc = _mm512_fmadd_ps(_mm512_set1_ps(t[j]), _mm512_maskz_loadu_ps(m, bt + j * out + o), acc);
        _mm512_mask_storeu_ps(y + o, m, _mm512_fmadd_ps(vs, acc, _mm512_maskz_loadu_ps(m, y + o)));
    }
}
CV_TARGET_END
#endif

typedef struct lora_job {
    float *y;             /* expand: [n] rows of stride y_stride */
    float *t;             /* [n][rank] */
    const float *x;       /* shrink: [n] rows of stride x_stride */
    const float *w;       /* shrink: A [rank][in]; expand: B^T [rank][out] */
    int64_t stride, n, rank, cols;
    float scale;
    int simd;
    cv_rows *rows;
} lora_job;

static void shrink_fn(void *arg, int tid, int nth) {
    const lora_job *j = arg;
    (void)tid;
    (void)nth;
    for (int64_t t0, t1; cv_rows_claim(j->rows, &t0, &t1);)
        for (int64_t r = t0; r < t1; r++) {
            const float *x = j->x + (size_t)r * (size_t)j->stride;
            float *t = j->t + (size_t)r * (size_t)j->rank;
            for (int64_t k = 0; k < j->rank; k++) {
                const float *a = j->w + (size_t)k * (size_t)j->cols;
#if CV_HAVE_AVX512
                if (j->simd >= CV_SIMD_AVX512) { t[k] = dot_avx512(x, a, j->cols); continue; }
#endif
#if CV_HAVE_AVX2
                if (j->simd >= CV_SIMD_AVX2) { t[k] = dot_avx2(x, a, j->cols); continue; }
#endif
                t[k] = dot_scalar(x, a, j->cols);
            }
        }
}

static void expand_fn(void *arg, int tid, int nth) {
    const lora_job *j = arg;
    (void)tid;
    (void)nth;
    for (int64_t t0, t1; cv_rows_claim(j->rows, &t0, &t1);)
        for (int64_t r = t0; r < t1; r++) {
            float *y = j->y + (size_t)r * (size_t)j->stride;
            const float *t = j->t + (size_t)r * (size_t)j->rank;
#if CV_HAVE_AVX512
            if (j->simd >= CV_SIMD_AVX512) { expand_avx512(y, t, j->w, j->rank, j->cols, j->scale); continue; }
#endif
#if CV_HAVE_AVX2
            if (j->simd >= CV_SIMD_AVX2) { expand_avx2(y, t, j->w, j->rank, j->cols, j->scale); continue; }
#endif
            expand_scalar(y, t, j->w, j->rank, 0, j->cols, j->scale);
        }
}

static void run(cv_backend *b, lora_job *j, cv_pool_fn fn) {
    cv_cpu *c = cv_cpu_of(b);
    cv_rows rows;
    j->simd = c->simd;
    j->rows = &rows;
    int nth = cv_threads_for(c, 2.0 * (double)j->n * (double)j->rank * (double)j->cols, LORA_GRAIN);
    if (nth > j->n) nth = (int)j->n;
    cv_cpu_run_rows(c, nth, &rows, j->n, fn, j);
}

void cv_cpu_lora_shrink(cv_backend *b, float *t, const float *x, int64_t x_stride, int64_t n, const float *a,
                        int64_t rank, int64_t in) {
    if (n <= 0 || rank <= 0) return;
    lora_job j = {.t = t, .x = x, .w = a, .stride = x_stride, .n = n, .rank = rank, .cols = in};
    run(b, &j, shrink_fn);
}

void cv_cpu_lora_expand(cv_backend *b, float *y, int64_t y_stride, const float *t, int64_t n, const float *bt,
                        int64_t rank, int64_t out, float scale) {
    if (n <= 0 || rank <= 0) return;
    lora_job j = {.y = y, .t = (float *)t, .w = bt, .stride = y_stride, .n = n, .rank = rank, .cols = out,
                  .scale = scale};
    run(b, &j, expand_fn);
}
