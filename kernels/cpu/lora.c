/* LoRA's low-rank pair over the rows of one adapter (one segment of a batch
 * grouped by adapter, as Punica's SGMV): shrink t = x . A^T to the rank, then
 * expand y += scale * (t . B^T). Each row is computed alone, in a fixed order,
 * so a row's result does not depend on the other rows of the step. */
#include <stdlib.h>
#include <string.h>

#include "cpu_internal.h"
#include "lora.h"

/* Rows per chunk a thread claims. */
#define LORA_GRAIN 4096.0

float cv_lora_dot_plain(const float *x, const void *w, int bf16, size_t off, int64_t n) {
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) s += x[i] * cv_lora_w_at(w, bf16, off + (size_t)i);
    return s;
}

/* y[o] += scale * sum_j t[j] * bt[j][o] for o in [0, out) */
void cv_lora_expand_plain(float *y, const float *t, const void *bt, int bf16, int64_t rank, int64_t out,
                          float scale) {
    for (int64_t o = 0; o < out; o++) {
        float acc = 0.0f;
        for (int64_t j = 0; j < rank; j++) acc += t[j] * cv_lora_w_at(bt, bf16, (size_t)(j * out + o));
        y[o] += scale * acc;
    }
}

/* t[rank] = x . A^T for one row */
static void shrink_row(const cv_cpu_kernels *k, float *t, const float *x, const void *a, int bf16, int64_t rank,
                       int64_t in) {
    for (int64_t r = 0; r < rank; r++) t[r] = k->lora_dot(x, a, bf16, (size_t)r * (size_t)in, in);
}

typedef struct lora_job {
    float *y;
    const float *x;
    int64_t y_stride, x_stride, in, out;
    const cv_lora_segment *segs;
    int64_t n_segs;
    const int64_t *seg_end; /* [n_segs] cumulative rows: the job's row i is in the first segment ending past i */
    const cv_cpu_kernels *kern;
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
            shrink_row(j->kern, t, j->x + (size_t)r * (size_t)j->x_stride, g->a, bf16, g->rank, j->in);
            j->kern->lora_expand(j->y + (size_t)r * (size_t)j->y_stride, t, g->bt, bf16, g->rank, j->out, g->scale);
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
                shrink_row(&c->kern, t, x + (size_t)r * (size_t)x_stride, segs[s].a, bf16, segs[s].rank, in);
                c->kern.lora_expand(y + (size_t)r * (size_t)y_stride, t, segs[s].bt, bf16, segs[s].rank, out,
                                    segs[s].scale);
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
                      .segs = segs, .n_segs = n_segs, .seg_end = seg_end, .kern = &c->kern, .rows = &rows};
        int nth = cv_threads_for(c, 2.0 * (double)work * (double)(in + out), LORA_GRAIN);
        if (nth > total) nth = (int)total;
        cv_cpu_run_rows(c, nth, &rows, total, sgmv_fn, &j);
    }
    if (seg_end != seg_end_small) free(seg_end);
}
