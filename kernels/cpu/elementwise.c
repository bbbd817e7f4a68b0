/* Row-wise operations of the CPU backend: rmsnorm (also per head and fused
 * with a residual add), rotary embedding (also fused with the KV write),
 * SwiGLU, GeGLU and the embedding lookup of a float table. The per-row code
 * they share with the fused GEMMs is in row_kernels.c, the level's kernels in
 * the backend's kernel table (kernel_table.h); rows are split across
 * the pool only when there is enough work to pay for waking it. */
#include <math.h>
#include <string.h>

#include "cpu_internal.h"

/* Elements per thread below which a row kernel stays on one thread. */
#define ROW_GRAIN 16384.0

/* ------------------------------------------------------------------------ */
/* RMSNorm                                                                   */

typedef struct norm_job {
    float *out;         /* [n][dim] */
    const float *x;     /* [n][dim] */
    const float *w;     /* [dim] */
    int64_t n, dim;
    float eps;
    const cv_cpu_kernels *kern;
    cv_rows *rows;      /* claimed in chunks (dynamic region) */
} norm_job;

static void norm_fn(void *arg, int tid, int nth) {
    const norm_job *j = arg;
    (void)tid;
    (void)nth;
    for (int64_t t0, t1; cv_rows_claim(j->rows, &t0, &t1);)
        for (int64_t t = t0; t < t1; t++)
            cv_cpu_rms_row(j->out + (size_t)t * (size_t)j->dim, j->x + (size_t)t * (size_t)j->dim, j->w, j->dim,
                    j->eps, j->kern);
}

void cv_cpu_rmsnorm(cv_backend *b, float *out, const float *x, const float *weight, int64_t n,
                    int64_t dim, float eps) {
    cv_cpu *c = cv_cpu_of(b);
    if (n <= 0 || dim <= 0) return;
    norm_job j = {.out = out, .x = x, .w = weight, .n = n, .dim = dim,
                  .eps = eps, .kern = &c->kern};
    int nth = cv_threads_for(c, (double)n * (double)dim, ROW_GRAIN);
    if (nth > n) nth = (int)n;
    cv_rows rows;
    j.rows = &rows;
    cv_cpu_run_rows(c, nth, &rows, n, norm_fn, &j);
}

/* ------------------------------------------------------------------------ */
/* RoPE                                                                      */

#define ROPE_CHUNK 128 /* frequencies per pass: cos/sin live on the stack */

typedef struct rope_job {
    float *q;           /* [n][q_stride], heads [n_heads][head_dim] at the start */
    float *k;           /* [n][k_stride], heads [n_kv_heads][head_dim] */
    int64_t q_stride, k_stride, n_heads, n_kv_heads, n;
    const int32_t *pos; /* [n] */
    const cv_rope *rope;
    const cv_cpu_kernels *kern;
    cv_rows *rows;      /* claimed in chunks (dynamic region) */
    /* rope_kv_write: each token's rotated k and its v go to the cache while
     * they are in L1 (cache NULL: rope alone) */
    cv_kv_layer *cache;
    const float *v;     /* [n][v_stride] */
    int64_t v_stride;
    const int64_t *slots; /* [n] */
    float *tab;         /* [n][2 * nf] cos and sin, or NULL: computed per chunk */
    int fill;           /* tab's rows are to be computed (and stored) by this call */
} rope_job;

/* Rotates frequencies [i0, i0 + m) of one head x[head_dim] with cs/sn[m]. */
void cv_rope_head_plain(float *x, int64_t hd, cv_rope_layout layout, int64_t i0, int64_t m, const float *cs,
                        const float *sn, const float *cs2, const float *sn2) {
    (void)cs2;
    (void)sn2;
    if (layout == CV_ROPE_HALVES) {
        const int64_t half = hd / 2;
        for (int64_t i = 0; i < m; i++) {
            const float a = x[i0 + i], bb = x[i0 + i + half];
            x[i0 + i] = a * cs[i] - bb * sn[i];
            x[i0 + i + half] = bb * cs[i] + a * sn[i];
        }
    } else {
        for (int64_t i = 0; i < m; i++) {
            const float a = x[2 * (i0 + i)], bb = x[2 * (i0 + i) + 1];
            x[2 * (i0 + i)] = a * cs[i] - bb * sn[i];
            x[2 * (i0 + i) + 1] = a * sn[i] + bb * cs[i];
        }
    }
}

static void rope_fn(void *arg, int tid, int nth) {
    const rope_job *j = arg;
    const int64_t hd = j->rope->head_dim, nf = hd / 2;
    const cv_rope_layout layout = j->rope->layout;
    (void)tid;
    (void)nth;
    float cs_buf[ROPE_CHUNK], sn_buf[ROPE_CHUNK];
    float cs2[2 * ROPE_CHUNK], sn2[2 * ROPE_CHUNK];
    void (*const head)(float *, int64_t, cv_rope_layout, int64_t, int64_t, const float *, const float *,
                       const float *, const float *) = j->kern->rope_head;
    for (int64_t t0, t1; cv_rows_claim(j->rows, &t0, &t1);)
    for (int64_t t = t0; t < t1; t++) {
        const double p = (double)j->pos[t];
        for (int64_t i0 = 0; i0 < nf; i0 += ROPE_CHUNK) {
            const int64_t m = nf - i0 < ROPE_CHUNK ? nf - i0 : ROPE_CHUNK;
            float *cs = cs_buf, *sn = sn_buf;
            if (j->tab) { /* this token's row of the step's table */
                cs = j->tab + (size_t)t * (size_t)(2 * nf) + (size_t)i0;
                sn = cs + nf;
            }
            /* angles once per token, in double: exact enough for long positions */
            if (!j->tab || j->fill)
                for (int64_t i = 0; i < m; i++) {
                    const double a = p * (double)j->rope->inv_freq[i0 + i];
                    cs[i] = (float)cos(a);
                    sn[i] = (float)sin(a);
                }
            if (layout == CV_ROPE_PAIRS) /* the vector heads' form of the angles */
                for (int64_t i = 0; i < m; i++) {
                    cs2[2 * i] = cs2[2 * i + 1] = cs[i];
                    sn2[2 * i] = -sn[i];
                    sn2[2 * i + 1] = sn[i];
                }
            for (int64_t h = 0; h < j->n_heads; h++)
                head(j->q + (size_t)t * (size_t)j->q_stride + (size_t)(h * hd), hd, layout, i0, m, cs, sn, cs2,
                     sn2);
            for (int64_t h = 0; h < j->n_kv_heads; h++)
                head(j->k + (size_t)t * (size_t)j->k_stride + (size_t)(h * hd), hd, layout, i0, m, cs, sn, cs2,
                     sn2);
        }
        if (j->cache)
            cv_cpu_kv_write_token(j->cache, j->k + (size_t)t * (size_t)j->k_stride,
                                  j->v + (size_t)t * (size_t)j->v_stride, j->slots[t], j->kern);
    }
}

/* The table of this call's angles: one whose key (positions and
 * frequencies) matches, with *fill 0; else the older of the two, keyed anew
 * for this call to fill (*fill 1). NULL when it cannot grow: the call then
 * computes its angles as it goes. Two tables, so that Gemma 3's local and
 * global frequencies both stay. */
static float *rope_table(cv_cpu *c, const int32_t *pos, int64_t n, const float *freq, int64_t nf, int *fill) {
    for (int i = 0; i < 2; i++) {
        cv_rope_table *t = &c->rope_tables[i];
        if (t->n == n && t->nf == nf && !memcmp(t->pos, pos, (size_t)n * sizeof *pos) &&
            !memcmp(t->freq, freq, (size_t)nf * sizeof *freq)) {
            *fill = 0;
            c->rope_next = !i;
            return t->cs;
        }
    }
    cv_rope_table *t = &c->rope_tables[c->rope_next];
    t->n = 0; /* empty until keyed below */
    if (!cv_grow((void **)&t->cs, &t->cap_cs, (size_t)n * (size_t)(2 * nf), sizeof *t->cs) ||
        !cv_grow((void **)&t->pos, &t->cap_pos, (size_t)n, sizeof *t->pos) ||
        !cv_grow((void **)&t->freq, &t->cap_freq, (size_t)nf, sizeof *t->freq))
        return NULL;
    memcpy(t->pos, pos, (size_t)n * sizeof *pos);
    memcpy(t->freq, freq, (size_t)nf * sizeof *freq);
    t->n = n;
    t->nf = nf;
    c->rope_next = !c->rope_next;
    *fill = 1;
    return t->cs;
}

/* Runs rope_fn over n tokens on enough threads for `work`. */
static void run_rope(cv_cpu *c, rope_job *j, double work) {
    j->tab = rope_table(c, j->pos, j->n, j->rope->inv_freq, j->rope->head_dim / 2, &j->fill);
    int nth = cv_threads_for(c, work, ROW_GRAIN);
    if (nth > j->n) nth = (int)j->n;
    cv_rows rows;
    j->rows = &rows;
    cv_cpu_run_rows(c, nth, &rows, j->n, rope_fn, j);
}

/* sin/cos cost about as much as rotating a few heads: count them in */
static double rope_work(int64_t n, int64_t hd, int64_t heads) { return (double)n * (double)hd * (double)(heads + 8); }

void cv_cpu_rope(cv_backend *b, float *q, int64_t q_stride, int64_t n_heads, float *k,
                 int64_t k_stride, int64_t n_kv_heads, const int32_t *pos, int64_t n,
                 const cv_rope *rope) {
    cv_cpu *c = cv_cpu_of(b);
    if (n <= 0 || rope->head_dim < 2) return;
    if (!q) n_heads = 0;
    if (!k) n_kv_heads = 0;
    rope_job j = {.q = q, .k = k, .q_stride = q_stride, .k_stride = k_stride, .n_heads = n_heads,
                  .n_kv_heads = n_kv_heads, .n = n, .pos = pos, .rope = rope, .kern = &c->kern};
    run_rope(c, &j, rope_work(n, rope->head_dim, n_heads + n_kv_heads));
}

void cv_cpu_rope_kv_write(cv_backend *b, float *q, int64_t q_stride, int64_t n_heads, float *k,
                          int64_t k_stride, int64_t n_kv_heads, const float *v, int64_t v_stride,
                          const int32_t *pos, int64_t n, const cv_rope *rope, cv_kv_layer *cache,
                          const int64_t *slot_mapping) {
    cv_cpu *c = cv_cpu_of(b);
    if (n <= 0) return;
    if (rope->head_dim < 2) { /* nothing to rotate */
        cv_cpu_kv_write(b, cache, k, k_stride, v, v_stride, slot_mapping, n);
        return;
    }
    if (!q) n_heads = 0;
    rope_job j = {.q = q, .k = k, .q_stride = q_stride, .k_stride = k_stride, .n_heads = n_heads,
                  .n_kv_heads = n_kv_heads, .n = n, .pos = pos, .rope = rope, .kern = &c->kern,
                  .cache = cache, .v = v, .v_stride = v_stride, .slots = slot_mapping};
    /* narrowing k and v into the cache costs about one rotation per kv head */
    run_rope(c, &j, rope_work(n, rope->head_dim, n_heads + 2 * n_kv_heads));
}

/* Per-head RMSNorm (Qwen3 and Gemma 3 q/k norms), in place; rows claimed as
 * tokens, each token's heads normed by the row code of cv_cpu_rmsnorm. */
typedef struct head_norm_job {
    float *x;           /* [n] rows, x_stride apart, of n_heads heads of hd */
    const float *w;     /* [hd] */
    int64_t x_stride, n_heads, hd;
    float eps;
    const cv_cpu_kernels *kern;
    cv_rows *rows;
} head_norm_job;

static void head_norm_fn(void *arg, int tid, int nth) {
    const head_norm_job *j = arg;
    (void)tid;
    (void)nth;
    for (int64_t t0, t1; cv_rows_claim(j->rows, &t0, &t1);)
        for (int64_t t = t0; t < t1; t++)
            for (int64_t h = 0; h < j->n_heads; h++) {
                float *v = j->x + (size_t)t * (size_t)j->x_stride + (size_t)(h * j->hd);
                cv_cpu_rms_row(v, v, j->w, j->hd, j->eps, j->kern);
            }
}

void cv_cpu_head_rmsnorm(cv_backend *b, float *x, int64_t x_stride, int64_t n_heads, int64_t n, int64_t head_dim,
                         const float *weight, float eps) {
    cv_cpu *c = cv_cpu_of(b);
    if (n <= 0 || n_heads <= 0 || head_dim <= 0) return;
    head_norm_job j = {.x = x, .w = weight, .x_stride = x_stride, .n_heads = n_heads, .hd = head_dim,
                       .eps = eps, .kern = &c->kern};
    int nth = cv_threads_for(c, (double)n * (double)(n_heads * head_dim), ROW_GRAIN);
    if (nth > n) nth = (int)n;
    cv_rows rows;
    j.rows = &rows;
    cv_cpu_run_rows(c, nth, &rows, n, head_norm_fn, &j);
}

/* x += rmsnorm(y) * w (Gemma's norms after attention and after the FFN). */
typedef struct add_norm_job {
    float *x, *y;       /* [n][dim] */
    const float *w;     /* [dim] */
    int64_t dim;
    float eps;
    const cv_cpu_kernels *kern;
    cv_rows *rows;
} add_norm_job;

static void add_norm_fn(void *arg, int tid, int nth) {
    const add_norm_job *j = arg;
    (void)tid;
    (void)nth;
    for (int64_t t0, t1; cv_rows_claim(j->rows, &t0, &t1);)
        for (int64_t t = t0; t < t1; t++) {
            float *y = j->y + (size_t)t * (size_t)j->dim, *x = j->x + (size_t)t * (size_t)j->dim;
            cv_cpu_rms_row(y, y, j->w, j->dim, j->eps, j->kern);
            for (int64_t i = 0; i < j->dim; i++) x[i] += y[i];
        }
}

void cv_cpu_add_rmsnorm(cv_backend *b, float *x, float *y, const float *weight, int64_t n, int64_t dim,
                        float eps) {
    cv_cpu *c = cv_cpu_of(b);
    if (n <= 0 || dim <= 0) return;
    add_norm_job j = {.x = x, .y = y, .w = weight, .dim = dim, .eps = eps, .kern = &c->kern};
    int nth = cv_threads_for(c, (double)n * (double)dim, ROW_GRAIN);
    if (nth > n) nth = (int)n;
    cv_rows rows;
    j.rows = &rows;
    cv_cpu_run_rows(c, nth, &rows, n, add_norm_fn, &j);
}

void cv_cpu_scale(cv_backend *b, float *x, int64_t n, float s) {
    (void)b;
    for (int64_t i = 0; i < n; i++) x[i] *= s;
}

/* ------------------------------------------------------------------------ */
/* SwiGLU                                                                    */

/* A gated activation (SwiGLU, GeGLU) over rows: out = act(gate) * up. */
typedef void (*gated_row_fn)(float *o, const float *g, const float *u, int64_t dim, const cv_cpu_kernels *k);
typedef struct gated_job {
    float *out;       /* [n][dim] */
    const float *gu;  /* [n][2*dim]: gate then up */
    int64_t n, dim;
    const cv_cpu_kernels *kern;
    gated_row_fn row;
    cv_rows *rows;      /* claimed in chunks (dynamic region) */
} gated_job;

static void gated_fn(void *arg, int tid, int nth) {
    const gated_job *j = arg;
    (void)tid;
    (void)nth;
    for (int64_t t0, t1; cv_rows_claim(j->rows, &t0, &t1);)
        for (int64_t t = t0; t < t1; t++) {
            const float *g = j->gu + (size_t)t * 2 * (size_t)j->dim;
            j->row(j->out + (size_t)t * (size_t)j->dim, g, g + j->dim, j->dim, j->kern);
        }
}

/* flops_per: rough cost of one output, for the thread count. */
static void run_gated(cv_backend *b, float *out, const float *gu, int64_t n, int64_t dim, gated_row_fn row,
                      double flops_per) {
    cv_cpu *c = cv_cpu_of(b);
    if (n <= 0 || dim <= 0) return;
    gated_job j = {.out = out, .gu = gu, .n = n, .dim = dim, .kern = &c->kern, .row = row};
    int nth = cv_threads_for(c, (double)n * (double)dim * flops_per, ROW_GRAIN);
    if (nth > n) nth = (int)n;
    cv_rows rows;
    j.rows = &rows;
    cv_cpu_run_rows(c, nth, &rows, n, gated_fn, &j);
}

void cv_cpu_swiglu(cv_backend *b, float *out, const float *gu, int64_t n, int64_t dim) {
    run_gated(b, out, gu, n, dim, cv_cpu_swiglu_row, 4.0);
}

void cv_cpu_geglu(cv_backend *b, float *out, const float *gu, int64_t n, int64_t dim) {
    run_gated(b, out, gu, n, dim, cv_cpu_geglu_row, 8.0);
}

/* ------------------------------------------------------------------------ */
/* Embedding                                                                 */

typedef struct embed_job {
    float *out;             /* [n][cols] */
    const int32_t *tokens;  /* [n] */
    int64_t n;
    const cv_table *t;
    const cv_cpu_kernels *kern;
    cv_rows *rows;      /* claimed in chunks (dynamic region) */
} embed_job;

static void embed_fn(void *arg, int tid, int nth) {
    const embed_job *j = arg;
    (void)tid;
    (void)nth;
    const int64_t cols = j->t->cols;
    const size_t esz = cv_dtype_size(j->t->dtype);
    for (int64_t t0, t1; cv_rows_claim(j->rows, &t0, &t1);)
    for (int64_t i = t0; i < t1; i++) {
        const char *row = (const char *)j->t->data + (size_t)j->tokens[i] * (size_t)cols * esz;
        cv_cpu_widen(j->out + (size_t)i * (size_t)cols, row, j->t->dtype, cols, j->kern);
    }
}

void cv_cpu_embedding(cv_backend *b, float *out, const int32_t *tokens, int64_t n,
                      const cv_table *table) {
    cv_cpu *c = cv_cpu_of(b);
    if (n <= 0 || table->cols <= 0) return;
    embed_job j = {.out = out, .tokens = tokens, .n = n, .t = table, .kern = &c->kern};
    int nth = cv_threads_for(c, (double)n * (double)table->cols, 4 * ROW_GRAIN);
    if (nth > n) nth = (int)n;
    cv_rows rows;
    j.rows = &rows;
    cv_cpu_run_rows(c, nth, &rows, n, embed_fn, &j);
}
