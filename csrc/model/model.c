/* Loading a checkpoint onto a backend: fuse q/k/v and gate/up into one matrix
 * each (one GEMM instead of three/two), convert to the asked dtype, and let the
 * backend pack them into its own layout. */
#include "model.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "checkpoint.h"
#include "../../base/quant_format.h"

void cv_rope_inv_freq(float *out, const cv_model_config *cfg) {
    int64_t half = cfg->head_dim / 2;
    for (int64_t i = 0; i < half; i++) {
        double f = pow((double)cfg->rope_theta, -2.0 * (double)i / (double)cfg->head_dim);
        if (cfg->rope_llama3) {
            /* llama3: keep high frequencies, divide low ones by factor, blend between. */
            double old_ctx = (double)cfg->rope_original_max_pos;
            double low_wavelen = old_ctx / cfg->rope_low_freq_factor;
            double high_wavelen = old_ctx / cfg->rope_high_freq_factor;
            double wavelen = 2.0 * M_PI / f;
            if (wavelen > low_wavelen) {
                f = f / cfg->rope_factor;
            } else if (wavelen >= high_wavelen) {
                double smooth = (old_ctx / wavelen - cfg->rope_low_freq_factor) /
                                (cfg->rope_high_freq_factor - cfg->rope_low_freq_factor);
                f = (1.0 - smooth) * f / cfg->rope_factor + smooth * f;
            }
        }
        if (cfg->rope_linear > 0) f /= cfg->rope_linear;
        out[i] = (float)f;
    }
}

int cv_layer_is_local(const cv_model_config *cfg, int64_t l) {
    return cfg->sliding_window > 0 && cfg->swa_period > 0 && (l + 1) % cfg->swa_period != 0;
}

/* Gemma 3's local layers: the local base, no scaling (HF scales only the
 * global layers' frequencies). */
static void rope_inv_freq_local(float *out, const cv_model_config *cfg) {
    for (int64_t i = 0; i < cfg->head_dim / 2; i++)
        out[i] = (float)pow((double)cfg->rope_local_theta, -2.0 * (double)i / (double)cfg->head_dim);
}

static int64_t view_numel(const cv_tensor_view *v) {
    return v->ndim == 1 ? v->shape[0] : v->shape[0] * v->shape[1];
}

/* Copies a float vector (any file dtype) to a new device buffer. */
static int upload_vector(cv_backend *b, float **out, const cv_tensor_view *v, float *scratch,
                         cv_err *err) {
    int64_t n = view_numel(v);
    cv_convert_to_f32(scratch, v->data, v->dtype, (size_t)n);
    *out = b->alloc(b, (size_t)n * sizeof(float));
    if (!*out) return cv_set_err(err, CV_ERR_NOMEM, "out of memory for a %lld-element vector", (long long)n);
    b->to_device(b, *out, scratch, (size_t)n * sizeof(float));
    return CV_OK;
}

/* Precision rank of a quantized type (the most precise wins when the parts
 * of one stacked matrix are stored in different types). */
static int quant_rank(cv_dtype t) { return t == CV_Q8_0 ? 3 : t == CV_Q4_1 ? 2 : t == CV_Q4_0 ? 1 : 0; }

/* The dtype a matrix of parts[n] is kept in: the asked quantization when its
 * rows can be block-quantized and none of its parts is quantized already (a
 * quantized file's matrices are never quantized again); else the type the kernels compute the file's
 * quantized parts in when they share it (cv_quant_compute_type); else, for
 * parts of the Q5/K formats mixed with others, Q8_F, which holds every
 * format exactly but Q2_K (two mins a block: Q8_M, a scale and a min per 16,
 * for a stack mixing Q2_K with other formats); else the most precise of
 * Q8_0/Q4_1/Q4_0 among the parts; else the model's float dtype. */
static cv_dtype matrix_dtype(const cv_tensor_view *const *parts, int n, cv_dtype dtype, cv_dtype quant) {
    if (parts[0]->shape[1] % CV_QK != 0) return dtype;
    int any_quant = 0;
    for (int i = 0; i < n; i++) any_quant = any_quant || cv_dtype_is_quant(parts[i]->dtype);
    if (cv_dtype_is_quant(quant) && !any_quant) return quant;
    cv_dtype best = CV_DTYPE_INVALID;
    int same = 1, all_quant = 1, newer = 0;
    for (int i = 0; i < n; i++) {
        const cv_dtype t = parts[i]->dtype;
        all_quant = all_quant && cv_dtype_is_quant(t);
        same = same && all_quant && cv_quant_compute_type(t) == cv_quant_compute_type(parts[0]->dtype);
        newer = newer || (cv_dtype_is_quant(t) && cv_quant_compute_type(t) != t);
        if (quant_rank(t) > quant_rank(best)) best = t;
    }
    if (same) return cv_quant_compute_type(parts[0]->dtype);
    for (int i = 0; i < n; i++)
        if (parts[i]->dtype == CV_Q2_K) return all_quant ? CV_Q8_M : dtype;
    if (newer && all_quant) return CV_Q8_F;
    return best == CV_DTYPE_INVALID ? dtype : best;
}

/* Repacking one part's rows into scratch, a chunk of rows per item, on the
 * backend's host threads. */
#define REPACK_ROWS 256
typedef struct repack_job {
    char *dst;       /* [rows][cols] of dst_t */
    const char *src; /* [rows][cols] of src_t */
    cv_dtype dst_t, src_t;
    int64_t rows, cols;
} repack_job;

static void repack_rows(void *arg, int64_t i, int worker) {
    const repack_job *j = arg;
    (void)worker;
    const int64_t r0 = i * REPACK_ROWS, r1 = r0 + REPACK_ROWS < j->rows ? r0 + REPACK_ROWS : j->rows;
    cv_quant_repack(j->dst + cv_dtype_bytes(j->dst_t, (size_t)(r0 * j->cols)), j->dst_t,
                    j->src + cv_dtype_bytes(j->src_t, (size_t)(r0 * j->cols)), j->src_t, (size_t)((r1 - r0) * j->cols));
}

static void repack_part(cv_backend *b, void *dst, cv_dtype dst_t, const cv_tensor_view *p, int64_t cols) {
    repack_job j = {.dst = dst, .src = p->data, .dst_t = dst_t, .src_t = p->dtype, .rows = p->shape[0], .cols = cols};
    const int64_t items = (j.rows + REPACK_ROWS - 1) / REPACK_ROWS;
    /* rows split only on whole blocks of both types (a GGUF row always is) */
    if (b->host_parallel && items > 1 && cols % (int64_t)cv_quant_block_elems(p->dtype) == 0 &&
        cols % (int64_t)cv_quant_block_elems(dst_t) == 0)
        b->host_parallel(b, items, repack_rows, &j);
    else
        cv_quant_repack(dst, dst_t, p->data, p->dtype, (size_t)(j.rows * cols));
}

/* Stacks the rows of parts[n] (same cols) into scratch and prepares one
 * matrix: quantized blocks are passed on as they are when every part is
 * already of the target type, everything else goes through float32. */
static int prepare_stacked(cv_backend *b, cv_matrix *out, const cv_tensor_view *const *parts, int n,
                           cv_dtype dtype, cv_dtype quant, float *scratch, cv_err *err) {
    int64_t rows = 0, cols = parts[0]->shape[1];
    const cv_dtype target = matrix_dtype(parts, n, dtype, quant);
    int raw = cv_dtype_is_quant(target);
    for (int i = 0; i < n; i++)
        raw = raw && cv_dtype_is_quant(parts[i]->dtype) &&
              (parts[i]->dtype == target || ((target == CV_Q8_F || target == CV_Q8_M) && quant == CV_DTYPE_INVALID) ||
               cv_quant_compute_type(parts[i]->dtype) == target);
    /* Parts all stored in one type go to the backend in it, which keeps the
     * file's bytes where its kernels read that type (the CPU's panels of Q5_0
     * and the K-quants) and repacks them otherwise. */
    int one_type = raw;
    for (int i = 1; i < n; i++) one_type = one_type && parts[i]->dtype == parts[0]->dtype;
    if (one_type && n == 1) /* the file's blocks as they are: no copy first */
        return b->matrix_prepare(b, out, parts[0]->data, parts[0]->dtype, parts[0]->shape[0], cols, target, err);
    if (one_type) {
        size_t off = 0;
        for (int i = 0; i < n; i++) {
            const size_t part = cv_dtype_bytes(parts[i]->dtype, (size_t)(parts[i]->shape[0] * cols));
            memcpy((char *)scratch + off, parts[i]->data, part);
            off += part;
            rows += parts[i]->shape[0];
        }
        return b->matrix_prepare(b, out, scratch, parts[0]->dtype, rows, cols, target, err);
    }
    if (raw) { /* the file's blocks, repacked exactly where the kernels compute another type */
        size_t off = 0;
        for (int i = 0; i < n; i++) {
            size_t elems = (size_t)(parts[i]->shape[0] * cols);
            repack_part(b, (char *)scratch + off, target, parts[i], cols);
            off += cv_dtype_bytes(target, elems);
            rows += parts[i]->shape[0];
        }
        return b->matrix_prepare(b, out, scratch, target, rows, cols, target, err);
    }
    for (int i = 0; i < n; i++) {
        const cv_tensor_view *p = parts[i];
        cv_convert_to_f32(scratch + rows * cols, p->data, p->dtype, (size_t)(p->shape[0] * cols));
        rows += p->shape[0];
    }
    return b->matrix_prepare(b, out, scratch, CV_F32, rows, cols, target, err);
}

/* The token embedding under quantization=quant: rows converted to float32
 * (scratch holds the whole table) and quantized like the matrices, so the
 * model equals the same checkpoint quantized by llama.cpp's tools. */
static int prepare_quantized_table(cv_backend *b, cv_table *out, const cv_tensor_view *v, cv_dtype quant,
                                   float *scratch, cv_err *err) {
    const size_t n = (size_t)(v->shape[0] * v->shape[1]);
    cv_convert_to_f32(scratch, v->data, v->dtype, n);
    for (size_t i = 0; i < n; i++)
        if (!(scratch[i] - scratch[i] == 0.0f))
            return cv_set_err(err, CV_ERR_INVALID, "the token embedding holds a non-finite value; cannot quantize it");
    void *q = malloc(cv_dtype_bytes(quant, n));
    if (!q) return cv_set_err(err, CV_ERR_NOMEM, "out of memory quantizing the token embedding");
    cv_quantize(q, scratch, quant, n);
    int rc = b->table_prepare(b, out, q, quant, v->shape[0], v->shape[1], quant, err);
    free(q);
    return rc;
}

void cv_model_free(cv_model *m) {
    if (!m) return;
    cv_backend *b = m->backend;
    if (m->layers) {
        for (int64_t l = 0; l < m->cfg.n_layers; l++) {
            cv_layer *L = &m->layers[l];
            b->free(b, L->attn_norm);
            b->free(b, L->ffn_norm);
            b->free(b, L->bqkv);
            b->free(b, L->q_norm);
            b->free(b, L->k_norm);
            b->free(b, L->post_attn_norm);
            b->free(b, L->post_ffn_norm);
            b->matrix_free(b, &L->wqkv);
            b->matrix_free(b, &L->wo);
            b->matrix_free(b, &L->w_gate_up);
            b->matrix_free(b, &L->w_down);
        }
        free(m->layers);
    }
    b->table_free(b, &m->embed);
    b->matrix_free(b, &m->lm_head);
    b->free(b, m->final_norm);
    b->free(b, m->inv_freq);
    b->free(b, m->inv_freq_local);
    free(m);
}

int cv_model_load(cv_model **out, const char *path, cv_backend *b, cv_dtype dtype, cv_err *err) {
    return cv_model_load_quantized(out, path, b, dtype, CV_DTYPE_INVALID, NULL, err);
}

int cv_model_load_quantized(cv_model **out, const char *path, cv_backend *b, cv_dtype dtype, cv_dtype quant,
                            const atomic_int *cancel, cv_err *err) {
    cv_checkpoint ck;
    memset(&ck, 0, sizeof ck);
    cv_model *m = NULL;
    float *scratch = NULL;
    int rc = cv_checkpoint_open(&ck, path, err);
    if (rc) goto done;

    const cv_model_config *c = &ck.cfg;
    if (dtype == CV_DTYPE_INVALID) dtype = c->torch_dtype;
    if (dtype != CV_F32 && dtype != CV_BF16 && dtype != CV_F16) dtype = CV_F32;
    if (quant != CV_DTYPE_INVALID && !cv_dtype_can_quantize(quant)) {
        rc = cv_set_err(err, CV_ERR_INVALID, "quantization must be q8_0, q4_0 or q4_1, got %s", cv_dtype_name(quant));
        goto done;
    }
    if ((c->qk_norm && !b->head_rmsnorm) ||
        (c->gemma && (!b->add_rmsnorm || !b->geglu || !b->scale))) {
        rc = cv_set_err(err, CV_ERR_UNSUPPORTED, "the %s backend lacks the kernels of this architecture (%s)", b->name,
                        c->gemma ? "gemma3" : "qwen3");
        goto done;
    }
    if (c->head_dim % 2 != 0 || c->head_dim > 256) {
        rc = cv_set_err(err, CV_ERR_UNSUPPORTED, "head_dim %lld is not supported (even, at most 256)",
                        (long long)c->head_dim);
        goto done;
    }
    m = calloc(1, sizeof *m);
    if (!m) { rc = cv_set_err(err, CV_ERR_NOMEM, "out of memory"); goto done; }
    m->cfg = *c;
    m->backend = b;
    m->dtype = dtype;
    m->q_dim = c->n_heads * c->head_dim;
    m->kv_dim = c->n_kv_heads * c->head_dim;
    m->layers = calloc((size_t)c->n_layers, sizeof *m->layers);
    if (!m->layers) { rc = cv_set_err(err, CV_ERR_NOMEM, "out of memory"); goto done; }

    /* Scratch big enough for the largest stacked matrix in float32. */
    int64_t qkv_rows = m->q_dim + 2 * m->kv_dim;
    int64_t biggest = qkv_rows * c->dim;
    if (2 * c->hidden_dim * c->dim > biggest) biggest = 2 * c->hidden_dim * c->dim;
    if (c->dim * m->q_dim > biggest) biggest = c->dim * m->q_dim;
    if (c->vocab_size * c->dim > biggest) biggest = c->vocab_size * c->dim;
    scratch = malloc((size_t)biggest * sizeof(float));
    if (!scratch) { rc = cv_set_err(err, CV_ERR_NOMEM, "out of memory for load scratch"); goto done; }

    const cv_tensor_view *head = ck.lm_head.data ? &ck.lm_head : &ck.embed;
    rc = prepare_stacked(b, &m->lm_head, &head, 1, dtype, quant, scratch, err);
    if (rc) goto done;
    /* a quantized embedding (GGUF, or quantization=) stays quantized: rows are dequantized on lookup */
    const int quantize_table = cv_dtype_is_quant(quant) && c->dim % CV_QK == 0 && !cv_dtype_is_quant(ck.embed.dtype);
    const cv_dtype table_dtype = quantize_table ? quant : cv_dtype_is_quant(ck.embed.dtype) ? ck.embed.dtype : dtype;
    /* Tied: when the LM head holds the table's very values (the same dtype,
     * made from the same rows), the lookup reads its rows and no table is kept. */
    m->embed_in_head = !ck.lm_head.data && m->lm_head.dtype == table_dtype && b->matrix_rows &&
                       b->matrix_rows(b, NULL, NULL, 0, &m->lm_head) == CV_OK;
    if (m->embed_in_head)
        rc = CV_OK;
    else if (quantize_table)
        rc = prepare_quantized_table(b, &m->embed, &ck.embed, quant, scratch, err);
    else
        rc = b->table_prepare(b, &m->embed, ck.embed.data, ck.embed.dtype, c->vocab_size, c->dim, table_dtype, err);
    if (rc) goto done;
    rc = upload_vector(b, &m->final_norm, &ck.final_norm, scratch, err);
    if (rc) goto done;
    m->n_params = view_numel(&ck.embed) + view_numel(&ck.final_norm) +
                  (ck.lm_head.data ? view_numel(&ck.lm_head) : 0);

    for (int64_t l = 0; l < c->n_layers; l++) {
        if (cancel && atomic_load(cancel)) {
            rc = cv_set_err(err, CV_ERR_CANCELLED, "loading the model was cancelled");
            goto done;
        }
        const cv_layer_views *v = &ck.layers[l];
        cv_layer *L = &m->layers[l];
        const cv_tensor_view *qkv[3] = {&v->wq, &v->wk, &v->wv};
        const cv_tensor_view *gu[2] = {&v->w_gate, &v->w_up};
        const cv_tensor_view *wo = &v->wo, *wd = &v->w_down;
        if ((rc = upload_vector(b, &L->attn_norm, &v->attn_norm, scratch, err))) goto done;
        if ((rc = upload_vector(b, &L->ffn_norm, &v->ffn_norm, scratch, err))) goto done;
        if (c->qk_norm && ((rc = upload_vector(b, &L->q_norm, &v->q_norm, scratch, err)) ||
                           (rc = upload_vector(b, &L->k_norm, &v->k_norm, scratch, err))))
            goto done;
        if (c->gemma && ((rc = upload_vector(b, &L->post_attn_norm, &v->post_attn_norm, scratch, err)) ||
                         (rc = upload_vector(b, &L->post_ffn_norm, &v->post_ffn_norm, scratch, err))))
            goto done;
        m->n_params += view_numel(&v->q_norm) + view_numel(&v->k_norm) + view_numel(&v->post_attn_norm) +
                       view_numel(&v->post_ffn_norm);
        if ((rc = prepare_stacked(b, &L->wqkv, qkv, 3, dtype, quant, scratch, err))) goto done;
        if ((rc = prepare_stacked(b, &L->wo, &wo, 1, dtype, quant, scratch, err))) goto done;
        if ((rc = prepare_stacked(b, &L->w_gate_up, gu, 2, dtype, quant, scratch, err))) goto done;
        if ((rc = prepare_stacked(b, &L->w_down, &wd, 1, dtype, quant, scratch, err))) goto done;
        m->n_params += view_numel(&v->attn_norm) + view_numel(&v->ffn_norm) + view_numel(&v->wq) +
                       view_numel(&v->wk) + view_numel(&v->wv) + view_numel(&v->wo) +
                       view_numel(&v->w_gate) + view_numel(&v->w_up) + view_numel(&v->w_down);
        if (c->qkv_bias) {
            int64_t off = 0;
            const cv_tensor_view *bias[3] = {&v->bq, &v->bk, &v->bv};
            for (int i = 0; i < 3; i++) {
                int64_t n = view_numel(bias[i]);
                cv_convert_to_f32(scratch + off, bias[i]->data, bias[i]->dtype, (size_t)n);
                off += n;
                m->n_params += n;
            }
            L->bqkv = b->alloc(b, (size_t)off * sizeof(float));
            if (!L->bqkv) { rc = cv_set_err(err, CV_ERR_NOMEM, "out of memory"); goto done; }
            b->to_device(b, L->bqkv, scratch, (size_t)off * sizeof(float));
        }
        m->weight_bytes += L->wqkv.bytes + L->wo.bytes + L->w_gate_up.bytes + L->w_down.bytes +
                           (size_t)(2 * c->dim) * sizeof(float);
    }
    m->weight_bytes += m->embed.bytes + m->lm_head.bytes + (size_t)c->dim * sizeof(float);

    cv_rope_inv_freq(scratch, c);
    if (ck.rope_freqs.data) { /* llama 3.x in GGUF: each frequency divided by its factor */
        float *f = scratch + c->head_dim / 2;
        cv_convert_to_f32(f, ck.rope_freqs.data, ck.rope_freqs.dtype, (size_t)(c->head_dim / 2));
        for (int64_t i = 0; i < c->head_dim / 2; i++) {
            if (!(f[i] > 0.0f) || f[i] > 1e30f) {
                rc = cv_set_err(err, CV_ERR_FORMAT, "%s: rope_freqs.weight[%lld] is %g; must be positive", path,
                                (long long)i, (double)f[i]);
                goto done;
            }
            scratch[i] /= f[i];
        }
    }
    m->inv_freq = b->alloc(b, (size_t)(c->head_dim / 2) * sizeof(float));
    if (!m->inv_freq) { rc = cv_set_err(err, CV_ERR_NOMEM, "out of memory"); goto done; }
    b->to_device(b, m->inv_freq, scratch, (size_t)(c->head_dim / 2) * sizeof(float));
    if (c->sliding_window > 0) {
        rope_inv_freq_local(scratch, c);
        m->inv_freq_local = b->alloc(b, (size_t)(c->head_dim / 2) * sizeof(float));
        if (!m->inv_freq_local) { rc = cv_set_err(err, CV_ERR_NOMEM, "out of memory"); goto done; }
        b->to_device(b, m->inv_freq_local, scratch, (size_t)(c->head_dim / 2) * sizeof(float));
    }
    rc = CV_OK;

done:
    free(scratch);
    cv_checkpoint_close(&ck);
    if (rc) {
        cv_model_free(m);
        m = NULL;
    }
    *out = m;
    return rc;
}
