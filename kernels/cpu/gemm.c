/* GEMM of the CPU backend: out[n][rows] = x[n][cols] . W^T (+ bias) (+= out).
 *
 * W is packed once (matrix_prepare) into panels of CV_NR = 16 output rows
 * interleaved along cols (see cpu_internal.h), kept in its 16-bit dtype when
 * it has one and widened in registers. The micro-kernel keeps an mr x 16 tile
 * of fp32 accumulators (mr <= 6 tokens) in registers, broadcasting x and
 * streaming one panel; the backend's kernel table (kernel_table.h) holds the
 * level's micro-kernels (plain C here, SIMD under x86/). Blocking: a block of
 * tokens whose x (mc x cols) stays in L2; for each panel, cols in chunks of about KC so the panel chunk stays
 * in L1 while all token tiles of the block pass over it (the C tiles of the
 * panel stay in cache across the chunks). A thread with many panels first
 * packs its x block tile by tile ([cols][mr]) so the broadcasts stream.
 * Threads claim work items (a chunk of panels over one token block) from a
 * shared counter in a dynamic pool region, so a worker that is asleep or
 * descheduled (2 cores shared with other processes) costs only its share of
 * speed-up, never a wait. With one token tile (decode) the whole panel is
 * streamed once, unblocked: every weight byte is read once. */
#include <sched.h>
#include <stdlib.h>
#include <string.h>

#include "gemm_ukr.h"
#include "quant.h"

/* Fewest panels in a thread's share for which packing x pays for itself. */
#define GEMM_PACK_MIN_PANELS 48

/* bf16 weights of a backend at AVX512_BF16 use the pair layout (vdpbf16ps):
 * panel p is [cols_pad/2][16][2], cols_pad = cols rounded up to even (the
 * pad column is zero). Other matrices: [cols][16] (bf16 in slot order). */
static inline int uses_pairs(const cv_cpu *c, cv_dtype dt) {
    return c->kern.gemm_pairs && dt == CV_BF16 && !c->exact_activations;
}
static inline int64_t panel_cols(const cv_cpu *c, cv_dtype dt, int64_t cols) {
    return uses_pairs(c, dt) ? (cols + 1) & ~(int64_t)1 : cols;
}
/* Groups of CV_GROUP panels of a matrix of `rows` outputs. */
static inline int64_t matrix_groups(int64_t rows) {
    return (rows + CV_GROUP * CV_NR - 1) / (CV_GROUP * CV_NR);
}

/* ------------------------------------------------------------------------ */
/* Packing                                                                   */

typedef struct pack_job {
    void *dst;          /* [n_panels][cols_pad][16] of dt */
    const void *src;    /* [rows][cols] of st */
    cv_dtype st, dt;
    int64_t rows, cols, cols_pad, n_panels;
    int pairs;          /* bf16 pair layout */
    float *tmp;         /* [nth][2 * cols]: a widened source row and its narrowed copy */
    const cv_cpu_kernels *kern;
} pack_job;

static void pack_fn(void *arg, int tid, int nth) {
    const pack_job *j = arg;
    const int64_t cols = j->cols;
    const int64_t p0 = j->n_panels * tid / nth, p1 = j->n_panels * (tid + 1) / nth;
    const size_t ssz = cv_dtype_size(j->st);
    float *row = j->tmp + (size_t)tid * 2 * (size_t)cols; /* [cols] */
    uint16_t *row16 = (uint16_t *)(row + cols);           /* [cols] */
    for (int64_t p = p0; p < p1; p++) {
        for (int jj = 0; jj < CV_NR; jj++) {
            const int64_t r = p * CV_NR + jj;
            if (r >= j->rows) {
                memset(row, 0, (size_t)cols * sizeof(float)); /* padding rows of the last panel */
            } else {
                const void *srow = (const char *)j->src + (size_t)r * (size_t)cols * ssz;
                if (j->st == CV_F64)
                    cv_convert_to_f32(row, srow, j->st, (size_t)cols);
                else
                    cv_cpu_widen(row, srow, j->st, cols, j->kern);
            }
            const size_t base = (size_t)p * (size_t)j->cols_pad * CV_NR;
            if (j->dt == CV_F32) {
                float *d = (float *)j->dst + base + (size_t)jj;
                for (int64_t k = 0; k < cols; k++) d[(size_t)k * CV_NR] = row[k];
                continue;
            }
            cv_cpu_narrow(row16, j->dt, row, cols, j->kern);
            if (j->pairs) { /* [k/2][16][2]: k even low, odd high */
                uint16_t *d = (uint16_t *)j->dst + base + 2 * (size_t)jj;
                for (int64_t k = 0; k < cols; k++) d[(size_t)(k / 2) * 2 * CV_NR + (size_t)(k & 1)] = row16[k];
                if (j->cols_pad > cols) d[(size_t)(cols / 2) * 2 * CV_NR + 1] = 0;
                continue;
            }
            uint16_t *d = (uint16_t *)j->dst + base + (size_t)(j->dt == CV_BF16 ? bf16_slot(jj) : jj);
            for (int64_t k = 0; k < cols; k++) d[(size_t)k * CV_NR] = row16[k];
        }
    }
}

int cv_cpu_matrix_prepare(cv_backend *b, cv_matrix *out, const void *src, cv_dtype src_dtype,
                          int64_t rows, int64_t cols, cv_dtype dtype, cv_err *err) {
    cv_cpu *c = cv_cpu_of(b);
    int rc = CV_OK;
    void *data = NULL;
    float *tmp = NULL;
    if (cv_dtype_is_quant(dtype)) {
        rc = cv_cpu_qmatrix_prepare(b, out, src, src_dtype, rows, cols, dtype, err);
        /* rows of a fused GEMM's prologue; Q5_0 panels: two panels as Q8_0 (quant.c) */
        if (rc == CV_OK && cv_cpu_gemm_reserve(c, out->layout == CV_QLAYOUT_P16_Q50 ? 2 * cols : cols) < 0) {
            cv_cpu_matrix_free(b, out);
            rc = cv_set_err(err, CV_ERR_NOMEM, "matrix_prepare: out of memory for activation scratch");
        }
        return rc;
    }
    memset(out, 0, sizeof *out);
    rc = cv_cpu_check_prepare("matrix_prepare", "weight dtype", src, src_dtype, rows, cols, dtype, err);
    if (rc) goto done;
    const int64_t n_panels = matrix_groups(rows) * CV_GROUP; /* zero panels pad the last group */
    const int64_t cols_pad = panel_cols(c, dtype, cols);
    size_t elems, bytes, tbytes;
    if (!cv_mul_size((size_t)n_panels * CV_NR, (size_t)cols_pad, &elems) ||
        !cv_mul_size(elems, cv_dtype_size(dtype), &bytes) || bytes > SIZE_MAX - 64) {
        rc = cv_set_err(err, CV_ERR_NOMEM, "matrix_prepare: [%lld][%lld] is too large",
                        (long long)rows, (long long)cols);
        goto done;
    }
    bytes = (bytes + 63) & ~(size_t)63; /* whole lines, as the arena hands them out */
    data = cv_weight_arena_alloc(&c->weights, bytes);
    int nth = cv_threads_for(c, (double)rows * (double)cols, 1 << 16);
    if (nth > n_panels) nth = (int)n_panels;
    if (!cv_mul_size((size_t)nth * 2 * sizeof(float), (size_t)cols, &tbytes)) tbytes = SIZE_MAX;
    tmp = tbytes == SIZE_MAX ? NULL : malloc(tbytes);
    if (!data || !tmp || cv_cpu_gemm_reserve(c, cols) < 0) {
        rc = cv_set_err(err, CV_ERR_NOMEM, "matrix_prepare: out of memory for [%lld][%lld] %s",
                        (long long)rows, (long long)cols, cv_dtype_name(dtype));
        goto done;
    }
    pack_job j = {.dst = data, .src = src, .st = src_dtype, .dt = dtype, .rows = rows,
                  .cols = cols, .cols_pad = cols_pad, .n_panels = n_panels, .tmp = tmp,
                  .kern = &c->kern, .pairs = uses_pairs(c, dtype)};
    cv_pool_run(c->pool, nth, pack_fn, &j);
    out->data = data;
    out->dtype = dtype;
    out->rows = rows;
    out->cols = cols;
    out->bytes = bytes;
    data = NULL;
done:
    cv_weight_arena_free(&c->weights, data);
    free(tmp);
    return rc;
}

int cv_cpu_gemm_reserve(cv_cpu *c, int64_t cols) {
    /* packed x blocks when packing is on (the bf16 pair kernels always need
     * them, for the rounded activations); the rows of a fused GEMM's prologue
     * always */
    const int pack = c->gemm_pack == 1 || uses_pairs(c, CV_BF16);
    size_t need = (size_t)c->gemm_xblock;
    if ((size_t)cols * CV_MR > need) need = (size_t)cols * CV_MR;
    need = (need + 15) & ~(size_t)15; /* keep each thread's buffer 64-byte aligned */
    if (c->gemm_xrows && (c->gemm_xpack || !pack) && need <= c->gemm_xpack_floats) return CV_OK;
    size_t bytes;
    if (!cv_mul_size(need * sizeof(float), (size_t)c->nthreads, &bytes)) return CV_ERR_NOMEM;
    float *r = aligned_alloc(64, bytes), *p = pack ? aligned_alloc(64, bytes) : NULL;
    if (!r || (pack && !p)) {
        free(r);
        free(p);
        return CV_ERR_NOMEM;
    }
    free(c->gemm_xpack);
    free(c->gemm_xrows);
    c->gemm_xpack = p;
    c->gemm_xrows = r;
    c->gemm_xpack_floats = need;
    return CV_OK;
}

void cv_cpu_matrix_free(cv_backend *b, cv_matrix *m) {
    if (!m) return;
    cv_weight_arena_free(&cv_cpu_of(b)->weights, m->data);
    memset(m, 0, sizeof *m);
}

/* ------------------------------------------------------------------------ */
/* Rows read back (a tied embedding read from its LM head)                   */

/* Bytes of thread scratch a quantized matrix's row needs: a P16 panel's rows
 * up to the wanted one, unpacked to row-major blocks. */
static size_t qrows_scratch_floats(const cv_matrix *m) {
    const size_t row_bytes = cv_dtype_bytes(m->dtype, (size_t)m->cols);
    return m->layout != CV_QLAYOUT_ROWS ? (CV_QP16_ROWS * row_bytes + sizeof(float) - 1) / sizeof(float) : 0;
}

static int rows_supported(const cv_cpu *c, const cv_matrix *m) {
    if (!m->data || m->rows <= 0 || m->cols <= 0) return 0;
    if (!cv_dtype_is_quant(m->dtype))
        return m->layout == 0 && (m->dtype == CV_F32 || m->dtype == CV_BF16 || m->dtype == CV_F16);
    if (m->layout == CV_QLAYOUT_ROWS) return 1;
    return cv_qp16_packs(cv_qp16_type(m->dtype, m->layout)) && m->cols % CV_QK == 0 &&
           cv_cpu_gemm_rows_buf(c, 0, qrows_scratch_floats(m)) != NULL;
}

typedef struct rows_job {
    float *out;            /* [n][cols] */
    const int32_t *rows;   /* [n] */
    const cv_matrix *m;
    const cv_cpu *cpu;
    cv_rows *claim;        /* claimed in chunks (dynamic region) */
} rows_job;

/* Row r of a float matrix packed by pack_fn: panel r / 16, lane r % 16. */
static void float_row(float *dst, const cv_cpu *c, const cv_matrix *m, int64_t r) {
    const int64_t cols = m->cols, cols_pad = panel_cols(c, m->dtype, cols);
    const int jj = (int)(r % CV_NR);
    const size_t base = (size_t)(r / CV_NR) * (size_t)cols_pad * CV_NR;
    if (m->dtype == CV_F32) {
        const float *p = (const float *)m->data + base + (size_t)jj;
        for (int64_t k = 0; k < cols; k++) dst[k] = p[(size_t)k * CV_NR];
        return;
    }
    const uint16_t *p = (const uint16_t *)m->data + base;
    if (uses_pairs(c, m->dtype)) { /* [k/2][16][2] */
        p += 2 * (size_t)jj;
        for (int64_t k = 0; k < cols; k++) dst[k] = cv_bf16_to_f32(p[(size_t)(k / 2) * 2 * CV_NR + (size_t)(k & 1)]);
    } else if (m->dtype == CV_BF16) {
        p += (size_t)bf16_slot(jj);
        for (int64_t k = 0; k < cols; k++) dst[k] = cv_bf16_to_f32(p[(size_t)k * CV_NR]);
    } else {
        p += (size_t)jj;
        for (int64_t k = 0; k < cols; k++) dst[k] = cv_f16_to_f32(p[(size_t)k * CV_NR]);
    }
}

/* Row r of a quantized matrix: its blocks (row-major, or unpacked from the
 * P16 panel into the thread's scratch), dequantized. */
static void quant_row(float *dst, const cv_matrix *m, int64_t r, void *scratch) {
    const size_t row_bytes = cv_dtype_bytes(m->dtype, (size_t)m->cols);
    const char *src = (const char *)m->data + (size_t)r * row_bytes;
    if (m->layout != CV_QLAYOUT_ROWS) {
        const int64_t nb = m->cols / CV_QK;
        const int lane = (int)(r % CV_QP16_ROWS);
        const cv_dtype pt = cv_qp16_type(m->dtype, m->layout);
        const char *panel = (const char *)m->data + (size_t)(r / CV_QP16_ROWS) * cv_qp16_stride(pt, nb);
        cv_qp16_unpack(scratch, row_bytes, panel, pt, lane + 1, nb);
        src = (const char *)scratch + (size_t)lane * row_bytes;
    }
    cv_dequantize(dst, src, m->dtype, (size_t)m->cols);
}

static void rows_fn(void *arg, int tid, int nth) {
    const rows_job *j = arg;
    (void)nth;
    const cv_matrix *m = j->m;
    void *scratch = cv_dtype_is_quant(m->dtype) ? cv_cpu_gemm_rows_buf(j->cpu, tid, qrows_scratch_floats(m)) : NULL;
    for (int64_t t0, t1; cv_rows_claim(j->claim, &t0, &t1);)
        for (int64_t i = t0; i < t1; i++) {
            float *dst = j->out + (size_t)i * (size_t)m->cols;
            if (cv_dtype_is_quant(m->dtype))
                quant_row(dst, m, j->rows[i], scratch);
            else
                float_row(dst, j->cpu, m, j->rows[i]);
        }
}

int cv_cpu_matrix_rows(cv_backend *b, float *out, const int32_t *rows, int64_t n, const cv_matrix *m) {
    cv_cpu *c = cv_cpu_of(b);
    if (!rows_supported(c, m)) return CV_ERR_UNSUPPORTED;
    if (n <= 0) return CV_OK;
    rows_job j = {.out = out, .rows = rows, .m = m, .cpu = c};
    int nth = cv_threads_for(c, (double)n * (double)m->cols, 1 << 16);
    if (nth > n) nth = (int)n;
    cv_rows claim;
    j.claim = &claim;
    cv_cpu_run_rows(c, nth, &claim, n, rows_fn, &j);
    return CV_OK;
}

/* ------------------------------------------------------------------------ */
/* Micro-kernels (contract in gemm_ukr.h) */

/* Plain C: the reference every SIMD kernel is held to (one panel per call:
 * the order of each output's sum is the same for any np). */
static void ukr_plain(int mr, cv_dtype dt, int64_t kc, const float *x, int64_t ldx, const void *w,
                      float *c, int64_t ldc, int nvalid, const float *bias, int load_c) {
    float acc[CV_MR][CV_NR];
    float wk[CV_NR];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < CV_NR; j++) {
            float v = 0.0f;
            if (j < nvalid) {
                if (load_c) v = c[i * ldc + j];
                if (bias) v += bias[j];
            }
            acc[i][j] = v;
        }
    for (int64_t k = 0; k < kc; k++) {
        if (dt == CV_F32) {
            const float *p = (const float *)w + k * CV_NR;
            for (int j = 0; j < CV_NR; j++) wk[j] = p[j];
        } else if (dt == CV_BF16) {
            const uint16_t *p = (const uint16_t *)w + k * CV_NR;
            for (int j = 0; j < CV_NR; j++) wk[j] = cv_bf16_to_f32(p[bf16_slot(j)]);
        } else {
            const uint16_t *p = (const uint16_t *)w + k * CV_NR;
            for (int j = 0; j < CV_NR; j++) wk[j] = cv_f16_to_f32(p[j]);
        }
        for (int i = 0; i < mr; i++) {
            const float xv = ldx ? x[i * ldx + k] : x[k * mr + i];
            for (int j = 0; j < CV_NR; j++) acc[i][j] += xv * wk[j];
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nvalid; j++) c[i * ldc + j] = acc[i][j];
}

#define PLAIN_UKR(MR, DT, NAME)                                                                 \
    static void NAME(int64_t kc, const float *x, int64_t ldx, const void *w, size_t wstride,   \
                     float *c, int64_t ldc, int nvalid, const float *bias, int load_c) {        \
        (void)wstride;                                                                          \
        ukr_plain(MR, DT, kc, x, ldx, w, c, ldc, nvalid, bias, load_c);                         \
    }
UKR_TABLE(PLAIN_UKR, plain_, , cv_gemm_plain_table)


/* ------------------------------------------------------------------------ */
/* Driver                                                                    */

typedef struct gemm_job {
    float *out;          /* [n][rows] */
    const float *x;      /* [n][cols] (in.kind == CV_IN_X) */
    cv_gemm_in in;       /* otherwise: each thread makes its block's rows */
    int64_t n;
    const cv_matrix *w;
    const float *bias;   /* [rows] or NULL */
    int accumulate;
    const cv_ukr_fn *table; /* [CV_MR + 1] kernels for w's dtype */
    const cv_ukr_pf_fn *table_pf; /* the same kernels that also prefetch, or NULL */
    int64_t kc;          /* cols per block (balanced chunks of about the configured KC) */
    int64_t mc;          /* tokens per block (x block of mc x cols stays in L2) */
    int64_t n_tblocks;   /* token blocks of mc tokens */
    int64_t pc;          /* panel groups per work item */
    int64_t n_pchunks;   /* chunks of pc panel groups */
    int64_t n_items;     /* work items: (token block, panel chunk), or panel chunks when panels_outer */
    float *xpack;        /* [nthreads][xpack_floats] packed x blocks, or NULL: x in place */
    size_t xpack_floats;
    int panels_outer;    /* loop over panels outermost (weights >> L2, x fits L3) */
    int pairs;           /* bf16 pair layout: xpack holds x rounded to bf16, [mlen][kcols] */
    int64_t kcols;       /* columns of a panel (cols, or cols_pad for pairs) */
    const cv_cpu_kernels *kern;
    const cv_cpu *cpu;   /* its per-thread rows buffers (prologue) */
    float *shared;       /* [n][cols]: the prologue's rows made once for all threads, or NULL */
    uint16_t *shared_bf16; /* pairs: [n][kcols] bf16 rows made once for all threads, or NULL */
    cv_rows shared_rows; /* rows of `shared` / `shared_bf16` still to make */
    _Alignas(64) atomic_llong shared_done; /* rows of `shared` / `shared_bf16` made */
    _Alignas(64) atomic_llong next; /* next work item to claim */
} gemm_job;

/* Copies a block's rows xb[0 .. mlen)[0 .. cols) into xp as the tiles the
 * driver walks, tile after tile (sizes as below), each tile [cols][mr]. */
static void pack_x(float *xp, const float *xb, int64_t cols, int64_t mlen, int64_t ntiles) {
    int64_t t = 0;
    for (int64_t ti = 0; ti < ntiles; ti++) {
        const int mr = (int)(mlen / ntiles + (ti < mlen % ntiles ? 1 : 0));
        float *dst = xp + t * cols;
        const float *src[CV_MR];
        for (int i = 0; i < mr; i++) src[i] = xb + (size_t)(t + i) * (size_t)cols;
        for (int64_t k = 0; k < cols; k++)
            for (int i = 0; i < mr; i++) dst[k * mr + i] = src[i][k];
        t += mr;
    }
}

/* Rounds a block's rows xb[0 .. mlen)[0 .. cols) to bf16 rows of kcols
 * (even; the pad column zero) at dst: the activations of the pair kernels,
 * rounded once per call and row. */
static void round_x_bf16(uint16_t *dst, const float *xb, int64_t cols, int64_t kcols, int64_t mlen,
                         const cv_cpu_kernels *kern) {
    for (int64_t t = 0; t < mlen; t++) {
        uint16_t *d = dst + t * kcols;
        cv_cpu_narrow(d, CV_BF16, xb + (size_t)t * (size_t)cols, cols, kern);
        for (int64_t k = cols; k < kcols; k++) d[k] = 0;
    }
}

/* The rows t0 .. t0 + m of the prologue (in) made and rounded to bf16 rows
 * of kcols at dst, one row at a time through the row buffer tmp (cols
 * floats): each row is rounded while it is still in L1, instead of a block
 * of fp32 rows written to L2 and read back. The same values as making all
 * the rows and then rounding them. */
static void make_rows_bf16(const cv_gemm_in *in, uint16_t *dst, float *tmp, int64_t t0, int64_t m, int64_t cols,
                           int64_t kcols, const cv_cpu_kernels *kern) {
    for (int64_t t = 0; t < m; t++) {
        cv_cpu_gemm_in_rows(in, tmp, t0 + t, 1, cols, kern);
        round_x_bf16(dst + t * kcols, tmp, cols, kcols, 1, kern);
    }
}

/* One group of CV_GROUP panels over one token block [m0, m0 + mlen): cols
 * in chunks of kc (the group's chunk stays in L1 while the block's tiles pass
 * over it), each tile's kernel taking np panels at a time. x comes from the
 * packed block xp, or from the block's rows xb ([mlen][cols]) when xp is NULL
 * (pair layout: xp holds the block's bf16 rows). */
static void group_pass(const gemm_job *j, int64_t g, int64_t m0, int64_t mlen, int64_t kc,
                       const float *xb, const float *xp, int64_t g_next) {
    const cv_matrix *w = j->w;
    const int64_t rows = w->rows, cols = j->kcols;
    const size_t esz = cv_dtype_size(w->dtype);
    const size_t pstride = (size_t)cols * CV_NR * esz; /* bytes from one panel to the next */
    const int64_t ntiles = (mlen + CV_MR - 1) / CV_MR;
    /* With several tiles the group's weights are reused (compute bound): the
     * next group's weights (g_next >= 0) are asked for a slice per kernel call,
     * so they arrive from memory while this group computes instead of
     * stalling its first tile. The levels' _pf kernels take their slice inside
     * their k loop, spread over its steps (a burst of prefetches between calls
     * fills the miss buffers and stalls the core: 20% of a 128-row f32 step);
     * levels without them ask for it between calls. */
    cv_prefetch_span pf = {0};
    if (g_next >= 0 && ntiles > 1) {
        const size_t gbytes = (size_t)CV_GROUP * pstride; /* groups are whole (zero panels pad the last) */
        pf = cv_prefetch_span_of((const char *)w->data + (size_t)g_next * gbytes, gbytes,
                                 (size_t)ntiles * (size_t)((cols + kc - 1) / kc));
    }
    for (int64_t k0 = 0; k0 < cols; k0 += kc) {
        const int64_t klen = k0 + kc < cols ? kc : cols - k0;
        const int first = k0 == 0;
        const int load_c = j->accumulate || !first;
        /* balanced tiles of at most CV_MR tokens */
        int64_t t = m0;
        for (int64_t ti = 0; ti < ntiles; ti++) {
            const int mr = (int)(mlen / ntiles + (ti < mlen % ntiles ? 1 : 0));
            const int np = j->kern->gemm_np[mr];
            /* this call's slice of the prefetch, spread over its k steps (k pairs) */
            int64_t pfl = 0;
            const char *pfp = j->table_pf ? cv_prefetch_take(&pf, j->pairs ? klen / 2 : klen, &pfl) : NULL;
            for (int q = 0; q < CV_GROUP; q += np) {
                const int64_t p = g * CV_GROUP + q, r0 = p * CV_NR;
                if (r0 >= rows) break;
                const int nvalid = rows - r0 < np * CV_NR ? (int)(rows - r0) : np * CV_NR;
                const char *wp = (const char *)w->data + (size_t)p * pstride + (size_t)k0 * CV_NR * esz;
                const float *bp = (first && j->bias) ? j->bias + r0 : NULL;
                float *o = j->out + (size_t)t * (size_t)rows + (size_t)r0;
                /* x: the block's bf16 rows (pairs), packed tiles (ldx 0), or in place */
                const int64_t ldx = j->pairs || !xp ? cols : 0;
                const float *xt =
                    j->pairs ? (const float *)(const void *)((const uint16_t *)(const void *)xp + (t - m0) * cols + k0)
                    : xp     ? xp + (t - m0) * cols + k0 * mr
                             : xb + (size_t)(t - m0) * (size_t)cols + (size_t)k0;
                if (pfp)
                    j->table_pf[mr](klen, xt, ldx, wp, pstride, o, rows, nvalid, bp, load_c, pfp, pfl);
                else
                    j->table[mr](klen, xt, ldx, wp, pstride, o, rows, nvalid, bp, load_c);
                pfp = NULL;
            }
            t += mr;
            if (!j->table_pf) cv_prefetch_slice(&pf);
        }
    }
}

/* The block's input rows made once for all threads of the region (claimed in
 * chunks) before any panel starts: the prologue's rows into j->shared, or
 * (pair layout, threads sharing token blocks) the rows made and rounded to
 * bf16 into j->shared_bf16, instead of once per thread that works on a block.
 * Same values either way: each row is made by the same functions. A thread
 * waits only for chunks that threads already running hold, so a late or
 * absent worker never stalls it. */
static void make_shared_rows(gemm_job *j, int tid) {
    const int64_t cols = j->w->cols, kcols = j->kcols;
    float *xr = j->shared_bf16 && j->in.kind != CV_IN_X
                    ? cv_cpu_gemm_rows_buf(j->cpu, tid, (size_t)(j->shared_rows.chunk * cols))
                    : NULL;
    for (int64_t t0, t1; cv_rows_claim(&j->shared_rows, &t0, &t1);) {
        if (!j->shared_bf16) {
            cv_cpu_gemm_in_rows(&j->in, j->shared + (size_t)(t0 * cols), t0, t1 - t0, cols, j->kern);
        } else {
            uint16_t *dst = j->shared_bf16 + (size_t)(t0 * kcols);
            if (xr)
                make_rows_bf16(&j->in, dst, xr, t0, t1 - t0, cols, kcols, j->kern);
            else
                round_x_bf16(dst, j->in.src + (size_t)(t0 * cols), cols, kcols, t1 - t0, j->kern);
        }
        atomic_fetch_add_explicit(&j->shared_done, t1 - t0, memory_order_release);
    }
    while (atomic_load_explicit(&j->shared_done, memory_order_acquire) < j->n) sched_yield();
}

/* Threads claim work items from a shared counter, so a thread that starts
 * late (asleep, or descheduled on a busy machine) only does less of the work
 * instead of holding the others up. An item is a chunk of pc panels over one
 * token block (loop order: token block > panel > cols chunk > tile, x block
 * in L2, packed by each thread that works on it when panels are many), or,
 * when weights are far larger than L2 and all of x fits L3 (panels_outer), a
 * chunk of panels over all tokens, so each weight byte comes from memory once
 * and x is re-read from L3. */
static inline int64_t claim_item(gemm_job *j) {
    return atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);
}

static void gemm_fn(void *arg, int tid, int nth) {
    gemm_job *j = arg;
    const int64_t np = matrix_groups(j->w->rows);
    const int64_t n = j->n, mc = j->mc, pc = j->pc;
    const int64_t cols = j->w->cols;
    float *xp = j->xpack ? j->xpack + (size_t)tid * j->xpack_floats : NULL;
    /* rows made by the prologue: once for all, or per thread and block (the
     * driver checked that a block fits) */
    if (j->shared || j->shared_bf16) make_shared_rows(j, tid);
    float *xr = j->in.kind != CV_IN_X && !j->shared && !j->shared_bf16
                    ? cv_cpu_gemm_rows_buf(j->cpu, tid, (size_t)(j->mc * cols))
                    : NULL;
    int64_t ready_block = -1;
    /* With one token block (a decode step) each weight comes from memory once:
     * the thread claims its items one ahead, so that the last group of an item
     * asks for the first group of the next one (claims stay in increasing
     * order per thread; which thread takes an item never changes a result). */
    const int ahead = j->n_tblocks == 1 && !j->panels_outer;
    int64_t next_it = -1;
    for (int64_t it = claim_item(j); it < j->n_items; it = ahead ? next_it : claim_item(j)) {
        if (ahead) next_it = claim_item(j);
        if (j->panels_outer) {
            const int64_t p0 = it * pc, p1 = p0 + pc < np ? p0 + pc : np;
            for (int64_t p = p0; p < p1; p++)
                for (int64_t m0 = 0; m0 < n; m0 += mc)
                    group_pass(j, p, m0, m0 + mc < n ? mc : n - m0, j->kc, j->x + (size_t)(m0 * cols), NULL,
                               m0 + mc >= n && p + 1 < p1 ? p + 1 : -1);
            continue;
        }
        const int64_t tb = it / j->n_pchunks, pi = it % j->n_pchunks;
        const int64_t m0 = tb * mc, mlen = m0 + mc < n ? mc : n - m0;
        const int64_t p0 = pi * pc, p1 = p0 + pc < np ? p0 + pc : np;
        const float *xb = xr ? xr : j->x + (size_t)(m0 * cols);
        if (j->shared_bf16) {
            xp = (float *)(void *)(j->shared_bf16 + (size_t)(m0 * j->kcols));
        } else if (ready_block != tb) { /* a thread's consecutive items mostly share a block */
            if (xp && j->pairs) { /* the block's bf16 rows (xb is not read) */
                uint16_t *xh = (uint16_t *)(void *)xp;
                if (xr)
                    make_rows_bf16(&j->in, xh, xr, m0, mlen, cols, j->kcols, j->kern);
                else
                    round_x_bf16(xh, xb, cols, j->kcols, mlen, j->kern);
            } else {
                if (xr) cv_cpu_gemm_in_rows(&j->in, xr, m0, mlen, cols, j->kern);
                if (xp) pack_x(xp, xb, cols, mlen, (mlen + CV_MR - 1) / CV_MR);
            }
            ready_block = tb;
        }
        /* rows of the block this thread likely takes next (items are whole
         * blocks, claimed in turn: about nth items on), asked for a slice per
         * panel so that they stream in while this block computes */
        const char *pf = NULL;
        size_t pf_bytes = 0;
        if (j->n_pchunks == 1 && !j->shared && !j->shared_bf16 && j->in.src) {
            const int64_t nb = tb + nth;
            if (nb < j->n_tblocks) {
                const int64_t row_floats = j->in.kind == CV_IN_SWIGLU ? 2 * cols : cols; /* gate and up */
                const int64_t nl = nb * mc + mc < n ? mc : n - nb * mc;
                pf = (const char *)(j->in.src + (size_t)(nb * mc * row_floats));
                pf_bytes = (size_t)(nl * row_floats) * sizeof(float);
            }
        }
        for (int64_t p = p0; p < p1; p++) {
            /* the next group's weights asked for when this call reads each
             * weight once (one token block: they come from memory); with
             * several blocks they are re-read from cache and it measured slower */
            int64_t g_next = -1;
            if (j->n_tblocks == 1 && p + 1 < p1)
                g_next = p + 1;
            else if (ahead && next_it < j->n_items)
                g_next = next_it % j->n_pchunks * pc; /* the next item's first group */
            group_pass(j, p, m0, mlen, j->kc, xb, xp, g_next);
            if (pf) {
                const size_t a = pf_bytes * (size_t)(p - p0) / (size_t)(p1 - p0) & ~(size_t)63;
                const size_t e = pf_bytes * (size_t)(p - p0 + 1) / (size_t)(p1 - p0);
                for (size_t o = a; o < e; o += 64) __builtin_prefetch(pf + o);
            }
        }
    }
}

void cv_cpu_gemm(cv_backend *b, float *out, const float *x, int64_t n, const cv_matrix *w,
                 const float *bias, int accumulate) {
    const cv_gemm_in in = {.kind = CV_IN_X, .src = x};
    cv_cpu_gemm_in(b, out, &in, n, w, bias, accumulate, NULL);
}

void cv_cpu_rmsnorm_gemm(cv_backend *b, float *out, const float *x, const float *norm_weight, float eps,
                         int64_t n, const cv_matrix *w, const float *bias, int accumulate, float *scratch) {
    const cv_gemm_in in = {.kind = CV_IN_RMSNORM, .src = x, .gain = norm_weight, .eps = eps};
    cv_cpu_gemm_in(b, out, &in, n, w, bias, accumulate, scratch);
}

void cv_cpu_swiglu_gemm(cv_backend *b, float *out, const float *gu, int64_t n, const cv_matrix *w,
                        const float *bias, int accumulate, float *scratch) {
    const cv_gemm_in in = {.kind = CV_IN_SWIGLU, .src = gu};
    cv_cpu_gemm_in(b, out, &in, n, w, bias, accumulate, scratch);
}

/* The GEMM plan (blocking, loop order, packing and threads) depends only on
 * the shapes, never on where the rows come from, so a fused call sums every
 * output in the same order as the unfused one: bit-identical results. */
void cv_cpu_gemm_in(cv_backend *b, float *out, const cv_gemm_in *in, int64_t n, const cv_matrix *w,
                    const float *bias, int accumulate, float *scratch) {
    cv_cpu *c = cv_cpu_of(b);
    if (n <= 0 || w->rows <= 0) return;
    if (cv_dtype_is_quant(w->dtype)) {
        cv_cpu_qgemm_in(b, out, in, n, w, bias, accumulate, c->qlevel, scratch);
        return;
    }
    gemm_job j = {.out = out, .x = in->src, .in = *in, .n = n, .w = w, .bias = bias, .accumulate = accumulate,
                  .kc = c->gemm_kc, .xpack = c->gemm_xpack, .xpack_floats = c->gemm_xpack_floats, .cpu = c};
    /* tokens per block: an x block of about gemm_xblock floats, whole tiles */
    j.mc = (c->gemm_xblock / w->cols) / CV_MR * CV_MR;
    if (j.mc < CV_MR) j.mc = CV_MR;
    if (j.xpack && (size_t)(j.mc * w->cols) > j.xpack_floats) j.xpack = NULL; /* not prepared here */
    j.pairs = uses_pairs(c, w->dtype);
    j.kcols = panel_cols(c, w->dtype, w->cols);
    j.kern = &c->kern;
    j.table = c->kern.gemm[dt_index(w->dtype)];
    j.table_pf = c->kern.gemm_pf[dt_index(w->dtype)];
    if (j.pairs) {
        j.table = c->kern.gemm_pairs;
        j.table_pf = c->kern.gemm_pairs_pf;
        /* the block's bf16 rows (kcols values each) fit the thread's buffer */
        j.xpack = c->gemm_xpack;
        const int64_t fit = (int64_t)(2 * j.xpack_floats) / j.kcols / CV_MR * CV_MR;
        if (j.mc > fit) j.mc = fit;
        /* bf16 rows take half the bytes of fp32 ones: twice the tokens fit the
         * same x block. Taken when it makes all tokens one block (a decode
         * step), so each weight byte comes from memory once, not per block. */
        const int64_t mc2 = (int64_t)(2 * c->gemm_xblock) / j.kcols;
        if (n > j.mc && n <= mc2 && n <= fit) j.mc = n;
    }
    if (j.pairs && (!j.xpack || j.mc < CV_MR)) return; /* not prepared by this backend */
    /* Threads: at least ~128K multiply-adds (a few microseconds) each, so that
     * waking a worker never costs more than it saves. */
    const int64_t np = matrix_groups(w->rows), cols = w->cols; /* work is divided in panel groups */
    const double macs = (double)n * (double)w->rows * (double)cols;
    const int nth = cv_threads_for(c, macs, 131072.0);
    if (n <= CV_MR) { /* one token tile (decode / GEMV): stream each panel whole, x in place */
        j.mc = n;
        j.kc = j.kcols;
        if (!j.pairs) j.xpack = NULL;
    } else {
        const int64_t nkb = (j.kcols + j.kc - 1) / j.kc;
        j.kc = (j.kcols + nkb - 1) / nkb;
        if (j.pairs) j.kc = (j.kc + 1) & ~(int64_t)1; /* whole pairs */
    }
    j.n_tblocks = (n + j.mc - 1) / j.mc;
    { /* blocks of equal size (whole tiles), not full ones and a short rest */
        const int64_t even = ((n + j.n_tblocks - 1) / j.n_tblocks + CV_MR - 1) / CV_MR * CV_MR;
        if (even < j.mc) j.mc = even;
        j.n_tblocks = (n + j.mc - 1) / j.mc;
    }
    const double w_share = (double)w->bytes / nth, x_bytes = (double)n * (double)cols * 4.0;
    j.panels_outer = !j.pairs && n > j.mc && (c->gemm_order >= 0 ? c->gemm_order
                                                     : (w_share > 2.0 * (double)c->l2_bytes &&
                                                        x_bytes <= 0.5 * (double)c->l3_bytes));
    /* packing x pays off only when each thread runs it over many panels */
    if (!j.pairs && (j.panels_outer || np * CV_GROUP < (int64_t)GEMM_PACK_MIN_PANELS * nth)) j.xpack = NULL;
    /* Items: at least ~64K multiply-adds each (the claim is ~0.1 us), and
     * about 6 per thread for balance when there is enough work. */
    const double item_tokens = j.panels_outer ? (double)n : (double)(n < j.mc ? n : j.mc);
    int64_t pc_min = (int64_t)(65536.0 / (item_tokens * CV_GROUP * CV_NR * (double)cols)) + 1;
    const int64_t blocks = j.panels_outer ? 1 : j.n_tblocks;
    const int64_t want_chunks = (6 * (int64_t)nth + blocks - 1) / blocks;
    int64_t pc = np / want_chunks;
    if (pc < pc_min) pc = pc_min;
    if (pc > np) pc = np;
    if (pc < 1) pc = 1;
    j.pc = pc;
    j.n_pchunks = (np + pc - 1) / pc;
    j.n_items = j.panels_outer ? j.n_pchunks : j.n_tblocks * j.n_pchunks;
    /* Panels outermost, every thread reads all of x (from L3): rows made per
     * thread would be made once per panel chunk, so the region first makes
     * them once into scratch (also when a block does not fit the rows
     * buffers: a matrix prepared by another backend). */
    /* Pair layout with threads sharing token blocks (several panel chunks
     * per block): each row made and rounded once for all threads, when all
     * of them fit the threads' packing buffers together (one allocation). */
    const int64_t chunk = n / (4 * (int64_t)nth) > 0 ? n / (4 * (int64_t)nth) : 1; /* rows per claim */
    if (j.pairs && nth > 1 && n > CV_MR && j.n_pchunks > 1 &&
        (size_t)(n * j.kcols) <= 2 * j.xpack_floats * (size_t)c->nthreads &&
        (j.in.kind == CV_IN_X || cv_cpu_gemm_rows_buf(c, 0, (size_t)(chunk * cols)))) {
        j.shared_bf16 = (uint16_t *)(void *)c->gemm_xpack;
    } else if (j.in.kind != CV_IN_X && (j.panels_outer || !cv_cpu_gemm_rows_buf(c, 0, (size_t)(j.mc * cols)))) {
        j.shared = scratch;
        j.x = scratch;
    }
    if (j.shared || j.shared_bf16) {
        j.shared_rows.n = n;
        j.shared_rows.chunk = chunk;
        atomic_init(&j.shared_rows.next, 0);
        atomic_init(&j.shared_done, 0);
    }
    atomic_init(&j.next, 0);
    /* Wake sleeping workers even for short calls: one that arrives too late
     * for this call finds it closed and then spins, ready for the next ones. */
    cv_pool_run_dynamic(c->pool, nth, gemm_fn, &j, 1);
}

