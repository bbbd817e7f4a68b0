/* Quantized GEMM/GEMV on the CPU: preparation, activation quantization, the
 * plain-C dot products, the threaded driver and quantized embedding rows.
 * See quant.h; the SIMD dots are in x86/avx2_quant.c and x86/avxvnni_quant.c. */
#include "quant.h"

#include <stdlib.h>
#include <string.h>

/* Tokens whose activations are quantized at once (bounds the scratch). */
#define QX_TOKENS 64
/* The same for the P16 path: fewer, longer regions (a chunk of 4 panels
 * stays in L2 while the block's tokens meet it). */
#define QP_TOKENS 256
/* Output rows a thread takes at a time: their weights stay in L1/L2 while
 * every token of the block reads them. */
#define Q_ROW_CHUNK 16
_Static_assert(Q_ROW_CHUNK == CV_QP16_ROWS, "a chunk of rows is one P16 panel");

/* ---- plain C -------------------------------------------------------------- */

static float dot_q8_0(const void *w, const cv_xq_block *x, int64_t nb) {
    const cv_block_q8_0 *b = w;
    float sum = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        int32_t s = 0;
        for (int j = 0; j < CV_QK; j++) s += (int32_t)b[i].qs[j] * x[i].q[j];
        sum += cv_qh_to_f32(b[i].d) * x[i].d * (float)s;
    }
    return sum;
}

static float dot_q4_0(const void *w, const cv_xq_block *x, int64_t nb) {
    const cv_block_q4_0 *b = w;
    float sum = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        int32_t s = 0;
        for (int j = 0; j < CV_QK / 2; j++) {
            s += ((b[i].qs[j] & 0xf) - 8) * x[i].q[j];
            s += ((b[i].qs[j] >> 4) - 8) * x[i].q[j + CV_QK / 2];
        }
        sum += cv_qh_to_f32(b[i].d) * x[i].d * (float)s;
    }
    return sum;
}

static float dot_q4_1(const void *w, const cv_xq_block *x, int64_t nb) {
    const cv_block_q4_1 *b = w;
    float sum = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        int32_t s = 0;
        for (int j = 0; j < CV_QK / 2; j++) {
            s += (b[i].qs[j] & 0xf) * x[i].q[j];
            s += (b[i].qs[j] >> 4) * x[i].q[j + CV_QK / 2];
        }
        sum += cv_qh_to_f32(b[i].d) * x[i].d * (float)s + cv_qh_to_f32(b[i].m) * x[i].s;
    }
    return sum;
}

static float dot_q4_f(const void *w, const cv_xq_block *x, int64_t nb) {
    const cv_block_q4_f *b = w;
    float sum = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        int32_t s = 0;
        for (int j = 0; j < CV_QK / 2; j++) {
            s += (b[i].qs[j] & 0xf) * x[i].q[j];
            s += (b[i].qs[j] >> 4) * x[i].q[j + CV_QK / 2];
        }
        sum += b[i].d * x[i].d * (float)s + b[i].m * x[i].s;
    }
    return sum;
}

static float dot_q8_f(const void *w, const cv_xq_block *x, int64_t nb) {
    const cv_block_q8_f *b = w;
    float sum = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        int32_t s0 = 0, s1 = 0; /* the two halves have their own scales */
        for (int j = 0; j < CV_QK / 2; j++) {
            s0 += (int32_t)b[i].qs[j] * x[i].q[j];
            s1 += (int32_t)b[i].qs[j + CV_QK / 2] * x[i].q[j + CV_QK / 2];
        }
        sum += (b[i].d[0] * (float)s0 + b[i].d[1] * (float)s1) * x[i].d + b[i].m * x[i].s;
    }
    return sum;
}

/* Q2_K as stored (quant_format.h): per 32-element activation block i of a
 * super-block, the exact integers A = sc0 * dot0 + sc1 * dot1 (weights 0..3
 * times the int8 activations, per 16) and B = mn0 * sum0 + mn1 * sum1 (the
 * activations' sums per 16); the block adds x.d * (d * A - dmin * B). */
float cv_q2k_dot_scalar(const void *w, const cv_xq_block *x, int64_t nb) {
    const cv_block_q2_k *b = w;
    float sum = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        const cv_block_q2_k *s = b + i / 8;
        const int h = (int)(i % 8) / 4, k = (int)(i % 4);
        uint16_t dh, dminh;
        memcpy(&dh, &s->d, 2);
        memcpy(&dminh, &s->dmin, 2);
        int32_t a = 0, m = 0;
        for (int half = 0; half < 2; half++) {
            int32_t dot = 0, xs = 0;
            for (int l = 16 * half; l < 16 * half + 16; l++) {
                dot += ((s->qs[32 * h + l] >> (2 * k)) & 3) * x[i].q[l];
                xs += x[i].q[l];
            }
            const uint8_t sc = s->scales[8 * h + 2 * k + half];
            a += (sc & 0xf) * dot;
            m += (sc >> 4) * xs;
        }
        sum += x[i].d * (cv_qh_to_f32(dh) * (float)a - cv_qh_to_f32(dminh) * (float)m);
    }
    return sum;
}

/* Q8_M: per half h, the exact integers dot_h (weights times activations)
 * and sum_h (the activations); the block adds
 * x.d * ((d0 * dot0 + d1 * dot1) + (m0 * sum0 + m1 * sum1)). */
float cv_q8m_dot_scalar(const void *w, const cv_xq_block *x, int64_t nb) {
    const cv_block_q8_m *b = w;
    float sum = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        int32_t dot[2] = {0, 0}, xs[2] = {0, 0};
        for (int j = 0; j < CV_QK; j++) {
            dot[j / 16] += (int32_t)b[i].qs[j] * x[i].q[j];
            xs[j / 16] += x[i].q[j];
        }
        sum += x[i].d * ((b[i].d[0] * (float)dot[0] + b[i].d[1] * (float)dot[1]) +
                         (b[i].m[0] * (float)xs[0] + b[i].m[1] * (float)xs[1]));
    }
    return sum;
}

cv_qdot_fn cv_qdot_scalar(cv_dtype t) {
    switch (t) {
    case CV_Q2_K: return cv_q2k_dot_scalar;
    case CV_Q8_M: return cv_q8m_dot_scalar;
    case CV_Q8_0: return dot_q8_0;
    case CV_Q4_0: return dot_q4_0;
    case CV_Q4_1: return dot_q4_1;
    case CV_Q4_F: return dot_q4_f;
    case CV_Q8_F: return dot_q8_f;
    default: return NULL;
    }
}

/* The plain-C level as 1 x 1 tiles (the driver has one shape for every level). */
#define SCALAR_TILE(TY)                                                                                      \
    static void tile_##TY(const void *w, size_t w_stride, const cv_xq_block *x, int64_t x_stride, int64_t nb, \
                          float *out) {                                                                      \
        (void)w_stride;                                                                                      \
        (void)x_stride;                                                                                      \
        out[0] = dot_##TY(w, x, nb);                                                                         \
    }
SCALAR_TILE(q8_0)
SCALAR_TILE(q4_0)
SCALAR_TILE(q4_1)
SCALAR_TILE(q4_f)
SCALAR_TILE(q8_f)

static void tile_q2_k(const void *w, size_t w_stride, const cv_xq_block *x, int64_t x_stride, int64_t nb,
                      float *out) {
    (void)w_stride;
    (void)x_stride;
    out[0] = cv_q2k_dot_scalar(w, x, nb);
}

static void tile_q8_m(const void *w, size_t w_stride, const cv_xq_block *x, int64_t x_stride, int64_t nb,
                      float *out) {
    (void)w_stride;
    (void)x_stride;
    out[0] = cv_q8m_dot_scalar(w, x, nb);
}

static int qtiles_scalar(cv_dtype t, cv_qtiles *out) {
    const cv_qtile_fn f = t == CV_Q8_0 ? tile_q8_0 : t == CV_Q4_0 ? tile_q4_0 : t == CV_Q4_1 ? tile_q4_1
                        : t == CV_Q4_F ? tile_q4_f : t == CV_Q8_F ? tile_q8_f : t == CV_Q2_K ? tile_q2_k
                        : t == CV_Q8_M ? tile_q8_m : NULL;
    if (!f) return 0;
    *out = (cv_qtiles){.max_tokens = 1, .rows = {0, 1}, .tile = {NULL, f}, .row = {NULL, f}};
    return 1;
}

void cv_quantize_x(cv_xq_block *out, const float *x, int64_t n) {
    for (int64_t i = 0; i < n / CV_QK; i++) {
        const float *v = x + i * CV_QK;
        float amax = 0.0f;
        for (int j = 0; j < CV_QK; j++) {
            const float a = v[j] < 0 ? -v[j] : v[j];
            amax = a > amax ? a : amax;
        }
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        int32_t sum = 0;
        for (int j = 0; j < CV_QK; j++) {
            const int q = (int)__builtin_roundf(v[j] * id);
            out[i].q[j] = (int8_t)q;
            sum += q;
        }
        out[i].d = d;
        out[i].sum = sum;
        out[i].s = d * (float)sum;
    }
}

/* ---- levels ------------------------------------------------------------- */

int cv_qlevel_supported(cv_qlevel l) {
    cv_qtiles k;
    const cv_cpu_features *f = cv_cpu_features_get();
    const int avx2 = f->avx2 && f->fma && f->f16c;
#ifdef CV_EMULATE_AVX512 /* development: every level runs on portable intrinsics */
    const int vnni512 = 1, vnni = 1;
#else
    const int vnni512 = f->avx512vnni && f->avx512vl && f->avx512f, vnni = f->avxvnni;
#endif
    switch (l) {
    case CV_QL_SCALAR: return 1;
    case CV_QL_AVX2: return avx2 && cv_qtiles_avx2(CV_Q8_0, &k);
    case CV_QL_AVX512VNNI: return avx2 && vnni512 && cv_qtiles_vnni(CV_Q8_0, 1, &k);
    case CV_QL_AVXVNNI: return avx2 && vnni && cv_qtiles_vnni(CV_Q8_0, 0, &k);
    }
    return 0;
}

cv_qlevel cv_qlevel_best(int simd) {
    if (simd <= CV_SIMD_SCALAR) return CV_QL_SCALAR;
    if (simd >= CV_SIMD_AVX512 && cv_qlevel_supported(CV_QL_AVX512VNNI)) return CV_QL_AVX512VNNI;
    if (cv_qlevel_supported(CV_QL_AVXVNNI)) return CV_QL_AVXVNNI;
    if (cv_qlevel_supported(CV_QL_AVX2)) return CV_QL_AVX2;
    return CV_QL_SCALAR;
}

const char *cv_qlevel_name(cv_qlevel l) {
    static const char *const names[] = {"scalar", "avx2", "avx512vnni", "avxvnni"};
    return (unsigned)l < 4 ? names[l] : "unknown";
}

/* The micro-kernels of dtype at level l (plain C where l has none). */
static void tiles_for(cv_dtype t, cv_qlevel l, cv_qtiles *out) {
    int ok = 0;
    if ((t == CV_Q2_K || t == CV_Q8_M) && l != CV_QL_SCALAR) ok = cv_qtiles_q2k(t, out); /* x86/avx2_q2k.c */
    else if (l == CV_QL_AVX512VNNI || l == CV_QL_AVXVNNI) ok = cv_qtiles_vnni(t, l == CV_QL_AVX512VNNI, out);
    else if (l == CV_QL_AVX2) ok = cv_qtiles_avx2(t, out);
    if (!ok) qtiles_scalar(t, out);
}

/* ---- preparation ------------------------------------------------------------ */

/* Packing rows into P16 panels, the panels split evenly across the threads. */
typedef struct qp16_pack_job {
    unsigned char *dst;
    const void *src; /* [rows][nb] blocks of t */
    cv_dtype t;
    int64_t rows, nb, panels;
    size_t stride, row_bytes;
} qp16_pack_job;

static void qp16_pack_fn(void *arg, int tid, int nth) {
    const qp16_pack_job *j = arg;
    const int64_t p0 = j->panels * tid / nth, p1 = j->panels * (tid + 1) / nth;
    if (p0 >= p1) return;
    const int64_t r0 = p0 * CV_QP16_ROWS, r1 = p1 * CV_QP16_ROWS < j->rows ? p1 * CV_QP16_ROWS : j->rows;
    cv_qp16_pack(j->dst + (size_t)p0 * j->stride, (const char *)j->src + (size_t)r0 * j->row_bytes, j->t, r1 - r0,
                 j->nb);
}

/* Repacking rows of another stored type (cv_quant_repack), split evenly across the threads. */
typedef struct repack_job {
    unsigned char *dst;
    const char *src;
    cv_dtype dst_t, src_t;
    int64_t rows, cols;
    size_t dst_row, src_row;
} repack_job;

static void repack_fn(void *arg, int tid, int nth) {
    const repack_job *j = arg;
    for (int64_t r = j->rows * tid / nth; r < j->rows * (tid + 1) / nth; r++)
        cv_quant_repack(j->dst + (size_t)r * j->dst_row, j->dst_t, j->src + (size_t)r * j->src_row, j->src_t,
                        (size_t)j->cols);
}

int cv_cpu_qmatrix_prepare(cv_backend *b, cv_matrix *out, const void *src, cv_dtype src_dtype, int64_t rows,
                           int64_t cols, cv_dtype dtype, cv_err *err) {
    memset(out, 0, sizeof *out);
    if (!src || rows <= 0 || cols <= 0)
        return cv_set_err(err, CV_ERR_INVALID, "matrix_prepare: bad shape [%lld][%lld] or NULL source",
                          (long long)rows, (long long)cols);
    if (cols % CV_QK != 0)
        return cv_set_err(err, CV_ERR_INVALID, "matrix_prepare: %s needs cols a multiple of %d, got %lld",
                          cv_dtype_name(dtype), CV_QK, (long long)cols);
    if (dtype != cv_quant_compute_type(dtype))
        return cv_set_err(err, CV_ERR_TYPE, "matrix_prepare: the CPU computes %s as %s; ask for that",
                          cv_dtype_name(dtype), cv_dtype_name(cv_quant_compute_type(dtype)));
    /* from a quantized source: its blocks as they are, or repacked exactly */
    const int repack = cv_dtype_is_quant(src_dtype) && (src_dtype == dtype || dtype == CV_Q8_F || dtype == CV_Q8_M ||
                                                        cv_quant_compute_type(src_dtype) == dtype) &&
                       !(dtype == CV_Q8_F && (src_dtype == CV_Q2_K || src_dtype == CV_Q8_M)); /* two mins a block */
    if (!repack && (!cv_dtype_can_quantize(dtype) ||
                    (src_dtype != CV_F32 && src_dtype != CV_F16 && src_dtype != CV_BF16 && !cv_dtype_is_quant(src_dtype))))
        return cv_set_err(err, CV_ERR_TYPE, "matrix_prepare: source dtype %s cannot be made %s",
                          cv_dtype_name(src_dtype), cv_dtype_name(dtype));
    if (cv_dtype_is_quant(src_dtype) && cols % (int64_t)cv_quant_block_elems(src_dtype) != 0)
        return cv_set_err(err, CV_ERR_INVALID, "matrix_prepare: %s needs cols a multiple of %zu, got %lld",
                          cv_dtype_name(src_dtype), cv_quant_block_elems(src_dtype), (long long)cols);
    size_t elems, bytes;
    if (!cv_mul_size((size_t)rows, (size_t)cols, &elems) || (bytes = cv_dtype_bytes(dtype, elems)) == 0)
        return cv_set_err(err, CV_ERR_NOMEM, "matrix_prepare: [%lld][%lld] is too large", (long long)rows,
                          (long long)cols);
    const size_t row_bytes = bytes / (size_t)rows;
    cv_cpu *c = cv_cpu_of(b);
    /* the VNNI level's panels (quant_ukr.h: the P16 layout; Q4_K's, Q5_K's,
     * Q5_0's and Q6_K's keep their bytes, CV_QLAYOUT_P16_Q4K ...); blocks already of the
     * panels' type go into them straight from the source, without a row-major copy */
    const cv_dtype ptype =
        (src_dtype == CV_Q4_K || src_dtype == CV_Q5_K || src_dtype == CV_Q5_0 || src_dtype == CV_Q6_K) &&
                dtype == cv_quant_compute_type(src_dtype)
            ? src_dtype : dtype;
    const int kq = ptype == CV_Q4_K || ptype == CV_Q5_K;
    const int p16 = c->qlevel == CV_QL_AVX512VNNI && cv_qp16_packs(ptype) &&
                    (kq ? cv_qp16k_kernel(ptype, 1, 1) != NULL : cv_qp16_kernel(ptype, 1, 1) != NULL);
    const int direct = p16 && src_dtype == ptype;
    /* row-major blocks: the matrix itself, or what its panels are packed from */
    unsigned char *data = direct ? NULL
                          : p16  ? aligned_alloc(64, (bytes + 63) & ~(size_t)63)
                                 : cv_weight_arena_alloc(&c->weights, bytes);
    float *row = malloc((size_t)cols * sizeof(float));
    int rc = CV_OK;
    if ((!direct && !data) || !row) {
        rc = cv_set_err(err, CV_ERR_NOMEM, "matrix_prepare: out of memory for [%lld][%lld] %s", (long long)rows,
                        (long long)cols, cv_dtype_name(dtype));
        goto done;
    }
    const size_t qx_bytes = (size_t)QP_TOKENS * (size_t)(cols / CV_QK) * sizeof(cv_xq_block);
    if (qx_bytes > c->qx_bytes) { /* activation scratch for the widest quantized matrix */
        void *qx = realloc(c->qx, qx_bytes);
        if (!qx) {
            rc = cv_set_err(err, CV_ERR_NOMEM, "matrix_prepare: out of memory for activation scratch");
            goto done;
        }
        c->qx = qx;
        c->qx_bytes = qx_bytes;
    }
    if (direct) {
        /* packed below from src */
    } else if (repack) {
        repack_job j = {.dst = data, .src = src, .dst_t = dtype, .src_t = src_dtype, .rows = rows, .cols = cols,
                        .dst_row = row_bytes, .src_row = cv_dtype_bytes(src_dtype, (size_t)cols)};
        cv_pool_run(c->pool, cv_threads_for(c, (double)rows * (double)cols, 1 << 20), repack_fn, &j);
    } else {
        const size_t src_row = cv_dtype_bytes(src_dtype, (size_t)cols);
        for (int64_t r = 0; r < rows; r++) {
            cv_convert_to_f32(row, (const char *)src + (size_t)r * src_row, src_dtype, (size_t)cols);
            for (int64_t k = 0; k < cols; k++)
                if (!(row[k] - row[k] == 0.0f)) {
                    rc = cv_set_err(err, CV_ERR_INVALID, "matrix_prepare: row %lld holds a non-finite value; "
                                    "cannot quantize to %s", (long long)r, cv_dtype_name(dtype));
                    goto done;
                }
            cv_quantize(data + (size_t)r * row_bytes, row, dtype, (size_t)cols);
        }
    }
    if (p16) {
        const int64_t nb = cols / CV_QK, panels = (rows + CV_QP16_ROWS - 1) / CV_QP16_ROWS;
        const size_t pbytes = (size_t)panels * cv_qp16_stride(ptype, nb);
        unsigned char *packed = cv_weight_arena_alloc(&c->weights, pbytes);
        if (!packed) {
            rc = cv_set_err(err, CV_ERR_NOMEM, "matrix_prepare: out of memory for [%lld][%lld] %s",
                            (long long)rows, (long long)cols, cv_dtype_name(dtype));
            goto done;
        }
        qp16_pack_job j = {.dst = packed, .src = direct ? src : data, .t = ptype, .rows = rows, .nb = nb,
                           .panels = panels, .stride = cv_qp16_stride(ptype, nb),
                           .row_bytes = direct ? cv_dtype_bytes(src_dtype, (size_t)cols) : row_bytes};
        cv_pool_run(c->pool, cv_threads_for(c, (double)rows * (double)cols, 1 << 20), qp16_pack_fn, &j);
        free(data);
        data = packed;
        bytes = pbytes;
        out->layout = cv_qp16_layout(ptype);
    }
    out->data = data;
    out->dtype = dtype;
    out->rows = rows;
    out->cols = cols;
    out->bytes = bytes;
    data = NULL;
done:
    if (p16) /* the row-major blocks the panels came from */
        free(data);
    else
        cv_weight_arena_free(&c->weights, data);
    free(row);
    return rc;
}

/* ---- GEMM ------------------------------------------------------------------ */

/* The type the P16 functions take for a panel-packed matrix (quant_ukr.h). */
static cv_dtype panel_type(const cv_matrix *w) { return cv_qp16_type(w->dtype, w->layout); }

typedef struct qgemm_job {
    cv_rows units;         /* the P16 path's dynamic regions: tokens to quantize, then chunks of panels */
    float *out;
    const cv_matrix *w;
    const float *bias;
    int accumulate;
    const cv_xq_block *xq; /* [nt][nb] */
    int64_t t0, nt, nb;
    cv_gemm_in in;         /* the rows quantized by the quantization region */
    const cv_cpu *cpu;     /* its per-thread rows buffers */
    const cv_cpu_kernels *kern;
    cv_xq_block *xq_w;
    cv_quantize_x_fn quantize;
    cv_qtiles k;
} qgemm_job;

/* Tokens [a, z) of the block: quantized (their prologue rows made first). */
static void quantize_range(qgemm_job *j, int tid, int64_t a, int64_t z) {
    const int64_t cols = j->w->cols;
    float *row = j->in.kind != CV_IN_X ? cv_cpu_gemm_rows_buf(j->cpu, tid, (size_t)cols) : NULL;
    for (int64_t t = a; t < z; t++) {
        const float *x = j->in.src + (j->t0 + t) * cols;
        if (row) { /* the prologue's row, made here and quantized at once */
            cv_cpu_gemm_in_rows(&j->in, row, j->t0 + t, 1, cols, j->kern);
            x = row;
        }
        j->quantize(j->xq_w + t * j->nb, x, cols);
    }
}

static void quantize_fn(void *arg, int tid, int nth) {
    qgemm_job *j = arg;
    quantize_range(j, tid, j->nt * tid / nth, j->nt * (tid + 1) / nth);
}

static void quantize_dyn_fn(void *arg, int tid, int nth) {
    (void)nth;
    qgemm_job *j = arg;
    for (int64_t a, z; cv_rows_claim(&j->units, &a, &z);) quantize_range(j, tid, a, z);
}

/* Stores a rows x tokens tile v[r * tokens + t] at output rows r0.. of tokens t0.. */
static void store_tile(const qgemm_job *j, const float *v, int64_t r0, int rows, int64_t t0, int tokens) {
    const int64_t n_out = j->w->rows;
    for (int t = 0; t < tokens; t++) {
        float *o = j->out + (j->t0 + t0 + t) * n_out + r0;
        for (int r = 0; r < rows; r++) {
            float y = v[r * tokens + t];
            if (j->bias) y += j->bias[r0 + r];
            o[r] = j->accumulate ? o[r] + y : y;
        }
    }
}

/* A thread's chunks of rows; in each, every token panel (activations in L1)
 * meets every row tile (the chunk's weights stay in L1/L2 across panels). */
static void rows_fn(void *arg, int tid, int nth) {
    qgemm_job *j = arg;
    const int64_t rows = j->w->rows, nb = j->nb;
    const size_t row_bytes = cv_dtype_bytes(j->w->dtype, (size_t)j->w->cols);
    const int64_t chunks = (rows + Q_ROW_CHUNK - 1) / Q_ROW_CHUNK;
    const int64_t c0 = chunks * tid / nth, c1 = chunks * (tid + 1) / nth;
    float v[CV_QTILE_MAX_ROWS * CV_QTILE_MAX_TOKENS];
    /* a P16 matrix at another level: each chunk (one panel) back in rows first */
    const int unpack = j->w->layout != CV_QLAYOUT_ROWS;
    const size_t pstride = unpack ? cv_qp16_stride(panel_type(j->w), nb) : 0;
    char *rowbuf = unpack ? (char *)cv_cpu_gemm_rows_buf(j->cpu, tid, (Q_ROW_CHUNK * row_bytes + 3) / 4) : NULL;
    if (unpack && !rowbuf) return; /* cannot happen: prepare reserves 6 * cols floats a thread */
    for (int64_t ch = c0; ch < c1; ch++) {
        const int64_t r0 = ch * Q_ROW_CHUNK, r1 = r0 + Q_ROW_CHUNK < rows ? r0 + Q_ROW_CHUNK : rows;
        if (unpack)
            cv_qp16_unpack(rowbuf, row_bytes, (const char *)j->w->data + (size_t)(r0 / CV_QP16_ROWS) * pstride,
                           panel_type(j->w), (int)(r1 - r0), nb);
        const char *wbase = unpack ? rowbuf : (const char *)j->w->data + (size_t)r0 * row_bytes; /* row r0 */
        for (int64_t t = 0; t < j->nt;) {
            const int tokens = (int)(j->nt - t < j->k.max_tokens ? j->nt - t : j->k.max_tokens);
            const int full = j->k.rows[tokens];
            for (int64_t r = r0; r < r1;) {
                const int nr = r1 - r >= full ? full : 1;
                const cv_qtile_fn f = nr == full ? j->k.tile[tokens] : j->k.row[tokens];
                f(wbase + (size_t)(r - r0) * row_bytes, row_bytes, j->xq + t * nb, nb, nb, v);
                store_tile(j, v, r, nr, t, tokens);
                r += nr;
            }
            t += tokens;
        }
    }
}

/* The P16 layout at the VNNI level: a thread's panels in chunks of 4; in
 * each, every token tile meets every panel (tiles of P panels x T tokens). */
#define QP_CHUNK 4

/* Panels per kernel call for a tile of T tokens, in a GEMM of ntiles token
 * tiles. A GEMM of one tile (a decode step of up to CV_QP16_MAX_TOKENS
 * sequences) streams its weights from memory once, and a core keeps one
 * stream (one panel read front to back) going at about the rate of a plain
 * read, where four panels at once make four streams that it reads at half
 * that rate or less (docs/dev/gemm.md). With more tiles the weights come from
 * cache and the wider tile does more work per load. The values are the same
 * either way: each output lane runs the same operations. */
static int tile_panels(int T, int64_t ntiles) { return ntiles == 1 ? 1 : cv_qp16_panels_for(T); }

/* Kernel calls of one token tile of T tokens over np panels: full tiles of
 * tile_panels panels, then one panel at a time (as panels_fn). */
static int64_t chunk_calls(int64_t np, int T, int64_t ntiles) {
    const int full = tile_panels(T, ntiles);
    return np / full + np % full;
}
/* Floats of a chunk's expanded K-quant scales (cv_qp16k_scales). */
static size_t kq_scale_floats(int64_t nb) { return (size_t)QP_CHUNK * (size_t)nb * 32; }

static void panels_fn(void *arg, int tid, int nth) {
    (void)nth;
    qgemm_job *j = arg;
    const int64_t rows = j->w->rows, nb = j->nb, n_out = rows;
    const int64_t panels = (rows + CV_QP16_ROWS - 1) / CV_QP16_ROWS;
    const cv_dtype dt = panel_type(j->w);
    const size_t stride = cv_qp16_stride(dt, nb);
    const int64_t ntiles = (j->nt + CV_QP16_MAX_TOKENS - 1) / CV_QP16_MAX_TOKENS;
    /* Q4_K / Q5_K panels: a buffer for a chunk's expanded scales (matrix_prepare
     * reserves it; without one the kernels expand them, the same values) */
    const int kq = dt == CV_Q4_K || dt == CV_Q5_K;
    float *ksc = kq ? cv_cpu_gemm_rows_buf(j->cpu, tid, kq_scale_floats(nb)) : NULL;
    /* Q5_0 panels with several token tiles: each pair of panels made Q8_0
     * panels once (the same integers) for all its tiles, which then run
     * Q8_0's kernels, at its rate; without the buffer (matrix_prepare
     * reserves it) the Q5_0 kernels, the same values */
    const size_t q8_stride = cv_qp16_stride(CV_Q8_0, nb);
    char *q8 = dt == CV_Q5_0 && ntiles > 1 ? (char *)cv_cpu_gemm_rows_buf(j->cpu, tid, (2 * q8_stride + 3) / 4) : NULL;
    /* With several token tiles units are claimed one ahead, so that a unit's
     * last chunk can ask for the first chunk of the thread's next unit. A
     * GEMM of one token tile asks for nothing ahead (its stream is the prefetchers'),
     * and claims a unit only as it starts it: its units are long (a thread's
     * share, cv_cpu_qgemm_in), and one claimed ahead would leave the other
     * thread idle. Results never depend on which thread takes a unit. */
    const int ahead = ntiles > 1;
    int64_t u0, u1, v0 = 0, v1 = 0;
    for (int more = cv_rows_claim(&j->units, &u0, &u1); more;) {
        const int have = ahead && cv_rows_claim(&j->units, &v0, &v1);
        for (int64_t c0 = u0 * QP_CHUNK; c0 < u1 * QP_CHUNK && c0 < panels; c0 += QP_CHUNK) {
            const int64_t c1 = c0 + QP_CHUNK < panels ? c0 + QP_CHUNK : panels;
            /* With several token tiles the chunk's weights are reused (compute
             * bound): the next chunk (of this unit or the next one claimed) is
             * asked for a slice per tile, so it arrives from memory while this
             * one computes. */
            const int64_t next = c1 < u1 * QP_CHUNK ? c1 : (have ? v0 * QP_CHUNK : panels);
            cv_prefetch_span pf = {0};
            if (ntiles > 1 && next < panels) {
                const int64_t n1 = next + QP_CHUNK < panels ? next + QP_CHUNK : panels;
                /* a slice per kernel call: the full tiles' calls and the last tile's */
                const int64_t tail = j->nt % CV_QP16_MAX_TOKENS;
                const int64_t calls = q8 ? ntiles * (c1 - c0) /* at most */
                                         : j->nt / CV_QP16_MAX_TOKENS * chunk_calls(c1 - c0, CV_QP16_MAX_TOKENS, ntiles) +
                                               (tail ? chunk_calls(c1 - c0, (int)tail, ntiles) : 0);
                pf = cv_prefetch_span_of((const char *)j->w->data + (size_t)next * stride, (size_t)(n1 - next) * stride,
                                         (size_t)calls);
            }
            if (q8) {
                for (int64_t p = c0; p < c1;) {
                    const int np = c1 - p >= 2 ? 2 : 1;
                    for (int k = 0; k < np; k++)
                        cv_qp16_q5_to_q8(q8 + (size_t)k * q8_stride, (const char *)j->w->data + (size_t)(p + k) * stride, nb);
                    for (int64_t t = 0; t < j->nt;) {
                        const int T = (int)(j->nt - t < CV_QP16_MAX_TOKENS ? j->nt - t : CV_QP16_MAX_TOKENS);
                        const int per = cv_qp16_panels_for(T) == np ? np : 1; /* panels a call */
                        for (int k = 0; k < np; k += per) {
                            const int64_t r0 = (p + k) * CV_QP16_ROWS;
                            const int nr = (int)(rows - r0 < per * CV_QP16_ROWS ? rows - r0 : per * CV_QP16_ROWS);
                            int64_t pfl = 0;
                            const char *pfp = cv_prefetch_take(&pf, nb, &pfl);
                            cv_qp16_kernel(CV_Q8_0, per, T)(q8 + (size_t)k * q8_stride, q8_stride, nb, j->xq + t * nb, nb,
                                                            j->out + (j->t0 + t) * n_out + r0, n_out, nr,
                                                            j->bias ? j->bias + r0 : NULL, j->accumulate, pfp, pfl);
                        }
                        t += T;
                    }
                    p += np;
                }
                continue;
            }
            /* K-quants with several token tiles: the chunk's scales once for all of them */
            const float *kchunk = ksc && ntiles > 1 ? ksc : NULL;
            if (kchunk)
                cv_qp16k_scales(ksc, (const char *)j->w->data + (size_t)c0 * stride, stride, dt, (int)(c1 - c0), nb);
            for (int64_t t = 0; t < j->nt;) {
                const int T = (int)(j->nt - t < CV_QP16_MAX_TOKENS ? j->nt - t : CV_QP16_MAX_TOKENS);
                const int full = tile_panels(T, ntiles);
                for (int64_t p = c0; p < c1;) {
                    const int np = c1 - p >= full ? full : 1;
                    const int64_t r0 = p * CV_QP16_ROWS;
                    const int nr = (int)(rows - r0 < np * CV_QP16_ROWS ? rows - r0 : np * CV_QP16_ROWS);
                    /* each call asks for its share of this tile's slice over its blocks */
                    int64_t pfl = 0;
                    const char *pfp = cv_prefetch_take(&pf, nb, &pfl);
                    const char *wp = (const char *)j->w->data + (size_t)p * stride;
                    float *o = j->out + (j->t0 + t) * n_out + r0;
                    const float *b = j->bias ? j->bias + r0 : NULL;
                    if (kq)
                        cv_qp16k_kernel(dt, np, T)(wp, stride, nb, j->xq + t * nb, nb, o, n_out, nr, b, j->accumulate,
                                                   pfp, pfl, kchunk ? kchunk + (size_t)(p - c0) * (size_t)nb * 32 : NULL);
                    else
                        cv_qp16_kernel(dt, np, T)(wp, stride, nb, j->xq + t * nb, nb, o, n_out, nr, b, j->accumulate,
                                                  pfp, pfl);
                    p += np;
                }
                t += T;
            }
        }
        if (ahead) {
            more = have;
            u0 = v0;
            u1 = v1;
        } else {
            more = cv_rows_claim(&j->units, &u0, &u1);
        }
    }
}

void cv_cpu_qgemm_in(cv_backend *b, float *out, const cv_gemm_in *in, int64_t n, const cv_matrix *w,
                     const float *bias, int accumulate, cv_qlevel level, float *scratch) {
    cv_cpu *c = cv_cpu_of(b);
    if (n <= 0 || w->rows <= 0) return;
    const int64_t nb = w->cols / CV_QK;
    /* the scratch is sized at prepare time for the widest matrix */
    cv_xq_block *xq = c->qx;
    qgemm_job j = {.out = out, .w = w, .bias = bias, .accumulate = accumulate, .nb = nb, .in = *in, .cpu = c,
                   .kern = &c->kern};
    if (in->kind != CV_IN_X && !cv_cpu_gemm_rows_buf(c, 0, (size_t)w->cols)) { /* prepared elsewhere */
        cv_cpu_gemm_in_rows(in, scratch, 0, n, w->cols, &c->kern); /* one thread: a rare path */
        j.in = (cv_gemm_in){.kind = CV_IN_X, .src = scratch};
    }
    tiles_for(w->dtype, level, &j.k);
    j.quantize = level != CV_QL_SCALAR && cv_quantize_x_avx2() ? cv_quantize_x_avx2() : cv_quantize_x;
    const int panels = w->layout != CV_QLAYOUT_ROWS && level == CV_QL_AVX512VNNI;
    if (panels && cv_quantize_x_avx512()) j.quantize = cv_quantize_x_avx512();
    const int64_t block = panels ? QP_TOKENS : QX_TOKENS;
    for (int64_t t0 = 0; t0 < n; t0 += block) {
        j.t0 = t0;
        j.nt = n - t0 < block ? n - t0 : block;
        j.xq = j.xq_w = xq;
        int nth = cv_threads_for(c, (double)(j.nt * w->cols), 16384.0);
        if (panels && nth > 1) /* dynamic: a descheduled thread does not hold the others */
            cv_cpu_run_rows(c, nth, &j.units, j.nt, quantize_dyn_fn, &j);
        else
            cv_pool_run(c->pool, nth, quantize_fn, &j);
        nth = cv_threads_for(c, (double)(j.nt * w->rows) * (double)w->cols, 65536.0);
        const int64_t units = (w->rows + QP_CHUNK * CV_QP16_ROWS - 1) / (QP_CHUNK * CV_QP16_ROWS);
        if (panels && j.nt <= CV_QP16_MAX_TOKENS) /* one stream a thread: each claim a thread's share */
            cv_cpu_run_chunks(c, nth, &j.units, units, (units + nth - 1) / (nth > 0 ? nth : 1), panels_fn, &j);
        else if (panels)
            cv_cpu_run_rows(c, nth, &j.units, units, panels_fn, &j);
        else
            cv_pool_run(c->pool, nth, rows_fn, &j);
    }
}

void cv_cpu_qgemm_level(cv_backend *b, float *out, const float *x, int64_t n, const cv_matrix *w,
                        const float *bias, int accumulate, cv_qlevel level) {
    const cv_gemm_in in = {.kind = CV_IN_X, .src = x};
    cv_cpu_qgemm_in(b, out, &in, n, w, bias, accumulate, level, NULL);
}

/* ---- embedding rows ---------------------------------------------------------- */

void cv_cpu_qembedding(cv_backend *b, float *out, const int32_t *tokens, int64_t n, const cv_table *t) {
    (void)b;
    const size_t row_bytes = cv_dtype_bytes(t->dtype, (size_t)t->cols);
    for (int64_t i = 0; i < n; i++)
        cv_dequantize(out + i * t->cols, (const char *)t->data + (size_t)tokens[i] * row_bytes, t->dtype,
                      (size_t)t->cols);
}
