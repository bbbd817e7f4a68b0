/* The forward pass over one ragged batch (Orca's selective batching): every
 * linear layer, norm and activation runs over all new tokens of all sequences
 * at once; only attention is per sequence, over its paged KV. */
#include <stdlib.h>
#include <math.h>
#include <string.h>

#include "model.h"

/* A step's scratch. Host memory comes zeroed from the backend and is committed
 * as steps first use it, like the KV pool: writing it all now would fault in
 * the logits of max_num_seqs rows of the vocabulary (256 x 262k floats for
 * Gemma 3) at start, for steps that may never be that large. */
static void *ws_alloc(cv_backend *b, size_t n, size_t elem, int *ok) {
    void *p = b->alloc(b, n * elem);
    if (!p) *ok = 0;
    return p;
}

int cv_forward_ws_init(cv_forward_ws *ws, const cv_model *m, int64_t max_tokens, int64_t max_seqs,
                       int64_t max_blocks_per_seq, cv_err *err) {
    cv_backend *b = m->backend;
    const cv_model_config *c = &m->cfg;
    size_t T = (size_t)max_tokens, S = (size_t)max_seqs;
    int ok = 1;
    memset(ws, 0, sizeof *ws);
    ws->max_tokens = max_tokens;
    ws->max_seqs = max_seqs;
    ws->max_blocks_per_seq = max_blocks_per_seq;
    ws->x = ws_alloc(b, T * (size_t)c->dim, sizeof(float), &ok);
    ws->xn = ws_alloc(b, T * (size_t)c->dim, sizeof(float), &ok);
    ws->qkv = ws_alloc(b, T * (size_t)(m->q_dim + 2 * m->kv_dim), sizeof(float), &ok);
    ws->attn = ws_alloc(b, T * (size_t)m->q_dim, sizeof(float), &ok);
    ws->gu = ws_alloc(b, T * (size_t)(2 * c->hidden_dim), sizeof(float), &ok);
    ws->h = ws_alloc(b, T * (size_t)c->hidden_dim, sizeof(float), &ok);
    ws->xlast = ws_alloc(b, S * (size_t)c->dim, sizeof(float), &ok);
    ws->xlast_n = ws_alloc(b, S * (size_t)c->dim, sizeof(float), &ok);
    ws->logits = ws_alloc(b, S * (size_t)c->vocab_size, sizeof(float), &ok);
    ws->device_copies = b->device_memory;
    if (ws->device_copies) {
        ws->d_tokens = ws_alloc(b, T, sizeof(int32_t), &ok);
        ws->d_positions = ws_alloc(b, T, sizeof(int32_t), &ok);
        ws->d_slots = ws_alloc(b, T, sizeof(int64_t), &ok);
        ws->d_query_start = ws_alloc(b, S + 1, sizeof(int32_t), &ok);
        ws->d_context_lens = ws_alloc(b, S, sizeof(int32_t), &ok);
        ws->d_block_tables = ws_alloc(b, S * (size_t)max_blocks_per_seq, sizeof(int32_t), &ok);
        ws->d_logits_rows = ws_alloc(b, S, sizeof(int32_t), &ok);
        ws->logits_host = malloc(S * (size_t)c->vocab_size * sizeof(float));
        if (!ws->logits_host) ok = 0;
    } else {
        ws->logits_host = ws->logits; /* the CPU reads its logits in place */
    }
    if (!ok) {
        cv_forward_ws_free(ws, m);
        return cv_set_err(err, CV_ERR_NOMEM,
                          "out of memory for activations of %lld tokens (lower max_num_batched_tokens)",
                          (long long)max_tokens);
    }
    return CV_OK;
}

void cv_forward_ws_free(cv_forward_ws *ws, const cv_model *m) {
    cv_backend *b = m->backend;
    void *bufs[] = {ws->x, ws->xn, ws->qkv, ws->attn, ws->gu, ws->h, ws->xlast, ws->xlast_n,
                    ws->logits, ws->d_tokens, ws->d_positions, ws->d_slots, ws->d_query_start,
                    ws->d_context_lens, ws->d_block_tables, ws->d_logits_rows};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) b->free(b, bufs[i]);
    if (ws->device_copies) free(ws->logits_host);
    memset(ws, 0, sizeof *ws);
}

/* The fused kernels where the backend has them (forward.c knows no device:
 * a NULL entry means the backend wants the unfused pair, same results). */

/* out (+)= rmsnorm(x) . W^T; xn: [n][w.cols] for the normalized rows, which it
 * holds afterwards where keep is set (LoRA reads them again): then the unfused
 * pair runs, whose sums are the fused kernel's. */
static void norm_gemm(cv_backend *b, float *out, const float *x, const float *gain, float eps, int64_t n,
                      const cv_matrix *w, const float *bias, int accumulate, float *xn, int keep) {
    if (b->rmsnorm_gemm && !keep) {
        b->rmsnorm_gemm(b, out, x, gain, eps, n, w, bias, accumulate, xn);
        return;
    }
    b->rmsnorm(b, xn, x, gain, n, w->cols, eps);
    b->gemm(b, out, xn, n, w, bias, accumulate);
}

/* out (+)= swiglu(gu) . W^T; h: [n][w.cols] for the activations, kept as
 * norm_gemm keeps xn. */
static void swiglu_gemm(cv_backend *b, float *out, const float *gu, int64_t n, const cv_matrix *w,
                        int accumulate, float *h, int keep) {
    if (b->swiglu_gemm && !keep) {
        b->swiglu_gemm(b, out, gu, n, w, NULL, accumulate, h);
        return;
    }
    b->swiglu(b, h, gu, n, w->cols);
    b->gemm(b, out, h, n, w, NULL, accumulate);
}

/* Whether any sequence of the batch runs under an adapter. */
static int batch_has_lora(const cv_batch *bt) {
    if (!bt->lora || !bt->lora_slots || !bt->lora->n_slots) return 0;
    for (int64_t s = 0; s < bt->n_seqs; s++)
        if (bt->lora_slots[s] >= 0) return 1;
    return 0;
}

/* y += scale * (x A^T) B^T of the n_modules projections from `first` in
 * cv_lora_module order, which read the same rows x and whose outputs lie side
 * by side in y in that order (q, k, v in the fused qkv rows; gate, up), for
 * the rows of each adapter: consecutive sequences of one slot make one
 * segment per projection (Punica's SGMV), and one backend call runs them all.
 * x rows x_stride apart, y rows y_stride apart, both indexed by the batch's
 * token rows. */
static void lora_add(cv_backend *b, const cv_batch *bt, int64_t layer, int first, int n_modules, float *y,
                     int64_t y_stride, const float *x, int64_t x_stride, const cv_model *m) {
    const cv_lora_pool *p = bt->lora;
    int64_t in = 0, out[CV_LORA_MAX_FUSED], col0[CV_LORA_MAX_FUSED], n_segs = 0;
    for (int i = 0; i < n_modules; i++) {
        cv_lora_module_shape(m, first + i, &out[i], &in); /* the same in for all of them */
        col0[i] = i ? col0[i - 1] + out[i - 1] : 0;
    }
    for (int64_t s = 0; s < bt->n_seqs;) {
        const int32_t slot = bt->lora_slots[s];
        int64_t e = s + 1;
        while (e < bt->n_seqs && bt->lora_slots[e] == slot) e++;
        const cv_lora_slot *ls = slot >= 0 && slot < p->n_slots && p->slots[slot].loaded ? &p->slots[slot] : NULL;
        for (int i = 0; ls && i < n_modules; i++) {
            const size_t k = (size_t)layer * CV_LORA_N_MODULES + (size_t)(first + i);
            if (!ls->a[k] || n_segs >= p->max_segs) continue;
            p->segs[n_segs++] = (cv_lora_segment){
                .row0 = bt->query_start[s], .n_rows = bt->query_start[e] - bt->query_start[s], .rank = ls->rank,
                .col0 = col0[i], .out = out[i], .a = ls->a[k], .bt = ls->bt[k], .dtype = p->dtype,
                .scale = ls->scale};
        }
        s = e;
    }
    if (n_segs) b->lora_sgmv(b, y, y_stride, x, x_stride, p->segs, n_segs, in, p->tmp);
}

/* Rotates q and k of the fused qkv rows and writes k and v to the cache. */
static void rope_kv(cv_backend *b, float *qkv, int64_t stride, const cv_model *m, const int32_t *pos, int64_t n,
                    const cv_rope *rope, cv_kv_layer *cache, const int64_t *slots) {
    const cv_model_config *c = &m->cfg;
    float *q = qkv, *k = qkv + m->q_dim, *v = qkv + m->q_dim + m->kv_dim;
    if (b->rope_kv_write) {
        b->rope_kv_write(b, q, stride, c->n_heads, k, stride, c->n_kv_heads, v, stride, pos, n, rope, cache,
                         slots);
        return;
    }
    b->rope(b, q, stride, c->n_heads, k, stride, c->n_kv_heads, pos, n, rope);
    b->kv_write(b, cache, k, stride, v, stride, slots, n);
}

/* Gathers rows[n_rows] (device indices) of the final residual stream (n
 * tokens), norms and projects them into ws->logits, then to the host. */
static void lm_head_rows(const cv_model *m, cv_forward_ws *ws, const int32_t *rows, int64_t n_rows,
                         int64_t n) {
    cv_backend *b = m->backend;
    const cv_model_config *c = &m->cfg;
    const int64_t dim = c->dim;
    cv_table xs = {.data = ws->x, .dtype = CV_F32, .rows = n, .cols = dim,
                   .bytes = (size_t)(n * dim) * sizeof(float)};
    b->embedding(b, ws->xlast, rows, n_rows, &xs);
    norm_gemm(b, ws->logits, ws->xlast, m->final_norm, c->rms_eps, n_rows, &m->lm_head, NULL, 0, ws->xlast_n, 0);
    if (ws->device_copies)
        b->to_host(b, ws->logits_host, ws->logits, (size_t)(n_rows * c->vocab_size) * sizeof(float));
}

int cv_model_logits(const cv_model *m, cv_forward_ws *ws, const int32_t *rows, int64_t n_rows,
                    int64_t n_tokens, cv_err *err) {
    cv_backend *b = m->backend;
    if (n_rows <= 0) return CV_OK;
    if (n_rows > ws->max_seqs || n_tokens > ws->max_tokens)
        return cv_set_err(err, CV_ERR_INVALID, "logits rows beyond the workspace");
    for (int64_t i = 0; i < n_rows; i++)
        if (rows[i] < 0 || rows[i] >= n_tokens)
            return cv_set_err(err, CV_ERR_INVALID, "logits row %d outside the batch", rows[i]);
    const int32_t *d_rows = rows;
    if (ws->device_copies) {
        b->to_device(b, ws->d_logits_rows, rows, (size_t)n_rows * sizeof(int32_t));
        d_rows = ws->d_logits_rows;
    }
    lm_head_rows(m, ws, d_rows, n_rows, n_tokens);
    b->sync(b);
    int rc = b->last_error ? b->last_error(b, err) : CV_OK;
    return rc ? rc : CV_OK;
}

int cv_model_forward(const cv_model *m, cv_forward_ws *ws, cv_kv_layer *caches,
                     const cv_batch *bt, cv_err *err) {
    cv_backend *b = m->backend;
    const cv_model_config *c = &m->cfg;
    const int64_t n = bt->n_tokens;
    const int64_t qkv_dim = m->q_dim + 2 * m->kv_dim;
    if (n <= 0) return CV_OK;
    if (n > ws->max_tokens || bt->n_seqs > ws->max_seqs || bt->n_logits > ws->max_seqs ||
        bt->max_blocks_per_seq > ws->max_blocks_per_seq)
        return cv_set_err(err, CV_ERR_INVALID, "batch larger than the workspace");

    /* Index arrays: used in place on the CPU, copied to the device elsewhere. */
    const int32_t *tokens = bt->tokens, *positions = bt->positions, *qs = bt->query_start,
                  *ctx = bt->context_lens, *tables = bt->block_tables, *rows = bt->logits_rows;
    const int64_t *slots = bt->slot_mapping;
    if (ws->device_copies) {
        b->to_device(b, ws->d_tokens, tokens, (size_t)n * sizeof(int32_t));
        b->to_device(b, ws->d_positions, positions, (size_t)n * sizeof(int32_t));
        b->to_device(b, ws->d_slots, slots, (size_t)n * sizeof(int64_t));
        b->to_device(b, ws->d_query_start, qs, (size_t)(bt->n_seqs + 1) * sizeof(int32_t));
        b->to_device(b, ws->d_context_lens, ctx, (size_t)bt->n_seqs * sizeof(int32_t));
        b->to_device(b, ws->d_block_tables, tables,
                     (size_t)(bt->n_seqs * bt->max_blocks_per_seq) * sizeof(int32_t));
        b->to_device(b, ws->d_logits_rows, rows, (size_t)bt->n_logits * sizeof(int32_t));
        tokens = ws->d_tokens; positions = ws->d_positions; slots = ws->d_slots;
        qs = ws->d_query_start; ctx = ws->d_context_lens; tables = ws->d_block_tables;
        rows = ws->d_logits_rows;
    }

    cv_attn_batch ab = {
        .n_seqs = bt->n_seqs, .query_start = qs, .context_lens = ctx, .block_tables = tables,
        .max_blocks_per_seq = bt->max_blocks_per_seq, .max_context_len = bt->max_context_len,
        .n_heads = c->n_heads, .n_kv_heads = c->n_kv_heads, .head_dim = c->head_dim,
        .scale = c->attn_scale > 0 ? c->attn_scale : 1.0f / sqrtf((float)c->head_dim),
    };
    cv_rope rope = {.inv_freq = m->inv_freq, .head_dim = c->head_dim, .layout = c->rope_layout};
    cv_rope rope_local = rope;
    if (m->inv_freq_local) rope_local.inv_freq = m->inv_freq_local;

    if (m->embed_in_head)
        b->matrix_rows(b, ws->x, tokens, n, &m->lm_head); /* the layout was checked at load */
    else
        b->embedding(b, ws->x, tokens, n, &m->embed);
    if (c->embed_scale > 0) b->scale(b, ws->x, n * c->dim, c->embed_scale);
    const int lora = batch_has_lora(bt) && b->lora_sgmv;
    const int64_t dim = c->dim, hid = c->hidden_dim;
    for (int64_t l = 0; l < c->n_layers; l++) {
        const cv_layer *L = &m->layers[l];
        const int local = cv_layer_is_local(c, l);
        ab.window = local ? c->sliding_window : 0;
        /* LoRA reads the projections' inputs again: they are kept */
        norm_gemm(b, ws->qkv, ws->x, L->attn_norm, c->rms_eps, n, &L->wqkv, L->bqkv, 0, ws->xn, lora);
        if (lora) lora_add(b, bt, l, CV_LORA_Q, 3, ws->qkv, qkv_dim, ws->xn, dim, m); /* q, k, v */
        if (c->qk_norm) { /* each q and k head, before RoPE */
            b->head_rmsnorm(b, ws->qkv, qkv_dim, c->n_heads, n, c->head_dim, L->q_norm, c->rms_eps);
            b->head_rmsnorm(b, ws->qkv + m->q_dim, qkv_dim, c->n_kv_heads, n, c->head_dim, L->k_norm, c->rms_eps);
        }
        rope_kv(b, ws->qkv, qkv_dim, m, positions, n, local ? &rope_local : &rope, &caches[l], slots);
        b->paged_attention(b, ws->attn, ws->qkv, qkv_dim, &caches[l], &ab);
        /* o and down add into the residual stream (or Gemma's pre-norm output) after the GEMM */
        float *attn_out = c->gemma ? ws->xn : ws->x;
        b->gemm(b, attn_out, ws->attn, n, &L->wo, NULL, !c->gemma); /* residual add in the GEMM */
        if (lora) lora_add(b, bt, l, CV_LORA_O, 1, attn_out, dim, ws->attn, m->q_dim, m);
        if (c->gemma) b->add_rmsnorm(b, ws->x, ws->xn, L->post_attn_norm, n, c->dim, c->rms_eps);
        norm_gemm(b, ws->gu, ws->x, L->ffn_norm, c->rms_eps, n, &L->w_gate_up, NULL, 0, ws->xn, lora);
        if (lora) lora_add(b, bt, l, CV_LORA_GATE, 2, ws->gu, 2 * hid, ws->xn, dim, m); /* gate, up */
        if (!c->gemma) {
            swiglu_gemm(b, ws->x, ws->gu, n, &L->w_down, 1, ws->h, lora); /* residual add */
            if (lora) lora_add(b, bt, l, CV_LORA_DOWN, 1, ws->x, dim, ws->h, hid, m);
            continue;
        }
        /* Gemma: x += norm(attn . Wo); x += norm(down(gelu(gate) * up)) */
        b->geglu(b, ws->h, ws->gu, n, c->hidden_dim);
        b->gemm(b, ws->xn, ws->h, n, &L->w_down, NULL, 0);
        if (lora) lora_add(b, bt, l, CV_LORA_DOWN, 1, ws->xn, dim, ws->h, hid, m);
        b->add_rmsnorm(b, ws->x, ws->xn, L->post_ffn_norm, n, c->dim, c->rms_eps);
    }
    if (bt->n_logits > 0) lm_head_rows(m, ws, rows, bt->n_logits, n);
    b->sync(b);
    /* Device kernels report failures (bad indices, launch errors) after the fact. */
    int rc = b->last_error ? b->last_error(b, err) : CV_OK;
    return rc ? rc : CV_OK;
}
