/* LoRA's low-rank pair over the rows of each adapter (a batch's rows grouped
 * by adapter, as Punica's SGMV): shrink t = x . A^T to the rank, then expand
 * y += scale * (t . B^T). The rows of one adapter, from all the segments that
 * name it, go through in blocks of up to CV_LORA_ROWS, so each block reads the
 * adapter's matrices once. Within a block every row keeps its own
 * accumulators in a fixed order, so a row's result does not depend on the
 * block it falls in nor on the other rows of the step. */
#include <stdlib.h>
#include <string.h>

#include "cpu_internal.h"
#include "lora.h"

/* Floating-point operations a thread should get at least. */
#define LORA_GRAIN 4096.0

void cv_lora_shrink_plain(float *t, int64_t t_stride, const float *const *x, int nr, const void *a, int bf16,
                          int64_t rank, int64_t in, const void *next, int64_t next_bytes) {
    (void)next; /* the plain code asks for nothing ahead */
    (void)next_bytes;
    for (int64_t r = 0; r < rank; r++) {
        float s[CV_LORA_ROWS] = {0};
        const size_t off = (size_t)r * (size_t)in;
        for (int64_t e = 0; e < in; e++) {
            const float w = cv_lora_w_at(a, bf16, off + (size_t)e);
            for (int i = 0; i < nr; i++) s[i] += x[i][e] * w;
        }
        for (int i = 0; i < nr; i++) t[(size_t)i * (size_t)t_stride + (size_t)r] = s[i];
    }
}

void cv_lora_expand_plain(float *const *y, const float *t, int64_t t_stride, int nr, const void *bt, int bf16,
                          int64_t rank, int64_t out, float scale, const void *next, int64_t next_bytes) {
    (void)next;
    (void)next_bytes;
    for (int64_t o = 0; o < out; o++) {
        float acc[CV_LORA_ROWS] = {0};
        for (int64_t j = 0; j < rank; j++) {
            const float w = cv_lora_w_at(bt, bf16, (size_t)CV_LORA_BT_AT(rank, j, o));
            for (int i = 0; i < nr; i++) acc[i] += t[(size_t)i * (size_t)t_stride + (size_t)j] * w;
        }
        for (int i = 0; i < nr; i++) y[i][o] += scale * acc[i];
    }
}

/* Up to CV_LORA_ROWS batch rows of one adapter. */
typedef struct lora_block {
    const cv_lora_segment *g;
    int nr;
    int64_t rows[CV_LORA_ROWS];
} lora_block;

typedef struct lora_job {
    float *y;
    const float *x;
    int64_t y_stride, x_stride, in;
    const lora_block *blocks;
    const cv_cpu_kernels *kern;
    cv_rows *rows;
} lora_job;

/* bl, and what the block after it (NULL: none) reads, asked for while bl runs: its
 * adapter's A during bl's shrink, its B^T during bl's expand. A decode step's blocks
 * are one adapter each, and each adapter's short streams are read once; without this
 * the kernels waited for every block's first lines and computed while memory idled. */
static void run_block(const lora_job *j, const lora_block *bl, const lora_block *next) {
    float t[CV_LORA_ROWS * CV_CPU_LORA_MAX_RANK];
    const float *x[CV_LORA_ROWS];
    float *y[CV_LORA_ROWS];
    const cv_lora_segment *g = bl->g;
    const int bf16 = g->dtype == CV_BF16;
    for (int i = 0; i < bl->nr; i++) {
        x[i] = j->x + (size_t)bl->rows[i] * (size_t)j->x_stride;
        y[i] = j->y + (size_t)bl->rows[i] * (size_t)j->y_stride + (size_t)g->col0;
    }
    const void *next_a = NULL, *next_bt = NULL;
    int64_t a_bytes = 0, bt_bytes = 0;
    if (next && next->g->a != g->a) { /* the same adapter's matrices are in cache already */
        const int64_t elem = next->g->dtype == CV_BF16 ? 2 : 4, rank = next->g->rank;
        next_a = next->g->a;
        next_bt = next->g->bt;
        a_bytes = rank * j->in * elem;
        bt_bytes = (int64_t)CV_LORA_BT_SIZE(rank, next->g->out) * elem;
    }
    j->kern->lora_shrink(t, g->rank, x, bl->nr, g->a, bf16, g->rank, j->in, next_a, a_bytes);
    j->kern->lora_expand(y, t, g->rank, bl->nr, g->bt, bf16, g->rank, g->out, g->scale, next_bt, bt_bytes);
}

static void sgmv_fn(void *arg, int tid, int nth) {
    const lora_job *j = arg;
    (void)tid;
    (void)nth;
    /* The next chunk is claimed before the last block of this one runs, so that
     * every block but a thread's first knows the block after it (to prefetch). */
    int64_t b0, b1, n0 = 0, n1 = 0;
    for (int more = cv_rows_claim(j->rows, &b0, &b1); more; b0 = n0, b1 = n1) {
        more = 0;
        for (int64_t b = b0; b < b1; b++) {
            const lora_block *next = NULL;
            if (b + 1 < b1) next = &j->blocks[b + 1];
            else if ((more = cv_rows_claim(j->rows, &n0, &n1))) next = &j->blocks[n0];
            run_block(j, &j->blocks[b], next);
        }
    }
}

/* Segments of one adapter first (by its A), then by position. */
static int seg_order(const void *pa, const void *pb) {
    const cv_lora_segment *const *a = pa, *const *b = pb;
    const uintptr_t ua = (uintptr_t)(*a)->a, ub = (uintptr_t)(*b)->a;
    if (ua != ub) return ua < ub ? -1 : 1;
    return (*a)->row0 < (*b)->row0 ? -1 : (*a)->row0 > (*b)->row0;
}

void cv_cpu_lora_sgmv(cv_backend *b, float *y, int64_t y_stride, const float *x, int64_t x_stride,
                      const cv_lora_segment *segs, int64_t n_segs, int64_t in, float *tmp) {
    (void)tmp; /* each block's rank vectors live on its thread's stack */
    cv_cpu *c = cv_cpu_of(b);
    int64_t total = 0;
    double work = 0;
    lora_job j = {.y = y, .x = x, .y_stride = y_stride, .x_stride = x_stride, .in = in, .kern = &c->kern};
    for (int64_t s = 0; s < n_segs; s++) {
        total += segs[s].n_rows;
        work += (double)segs[s].n_rows * (double)segs[s].rank * (double)(in + segs[s].out);
    }
    if (total <= 0) return;
    const cv_lora_segment **order = malloc((size_t)n_segs * sizeof *order);
    lora_block *blocks = malloc((size_t)total * sizeof *blocks);
    if (!order || !blocks) {
        /* no memory to group the rows: each row alone on this thread (the same result) */
        for (int64_t s = 0; s < n_segs; s++)
            for (int64_t i = 0; i < segs[s].n_rows; i++) {
                const lora_block one = {.g = &segs[s], .nr = 1, .rows = {segs[s].row0 + i}};
                run_block(&j, &one, NULL);
            }
        free(order);
        free(blocks);
        return;
    }
    for (int64_t s = 0; s < n_segs; s++) order[s] = &segs[s];
    qsort(order, (size_t)n_segs, sizeof *order, seg_order);
    int64_t n_blocks = 0;
    lora_block *open = NULL; /* the block filling up, of the adapter of order[s - 1] */
    for (int64_t s = 0; s < n_segs; s++) {
        const cv_lora_segment *g = order[s];
        if (open && open->g->a != g->a) open = NULL;
        for (int64_t i = 0; i < g->n_rows; i++) {
            if (!open || open->nr == CV_LORA_ROWS) {
                open = &blocks[n_blocks++];
                open->g = g;
                open->nr = 0;
            }
            open->rows[open->nr++] = g->row0 + i;
        }
    }
    cv_rows rows;
    j.blocks = blocks;
    j.rows = &rows;
    int nth = cv_threads_for(c, 2.0 * work, LORA_GRAIN);
    if (nth > n_blocks) nth = (int)n_blocks;
    cv_cpu_run_rows(c, nth, &rows, n_blocks, sgmv_fn, &j);
    free(order);
    free(blocks);
}
