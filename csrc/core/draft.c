#include "draft.h"

#include <stdlib.h>
#include <string.h>

#include "../../base/quant_format.h"
#include "../model/model.h"
#include "block_pool.h"
#include "kv_cache.h"
#include "runner.h"
#include "scheduler.h"

struct cv_draft {
    cv_model *model;
    cv_kv_cache kv;
    cv_backend *backend;
    cv_block_pool *pool;
    cv_forward_ws ws;
    int ws_ready;
    cv_runner runner;
    int64_t vocab, max_len, max_seqs, max_tokens, block_size, max_k, max_blocks_per_seq;
    cv_sequence **slots;    /* [max_seqs] draft-side sequences (seq_id: the target's), NULL when free */
    /* one round's scratch, by position in the caller's seqs */
    int64_t *slot_of, *left;
    /* one pass's plan */
    cv_sequence **p_seqs;
    int32_t *p_new;
    int64_t *p_start, *p_index;
    int64_t tokens_computed;
};

static void slot_release(cv_draft *d, int64_t k) {
    cv_sequence *q = d->slots[k];
    if (!q) return;
    for (int64_t b = 0; b < q->n_blocks; b++) cv_block_pool_decref(d->pool, q->block_table[b]);
    cv_sequence_free(q);
    d->slots[k] = NULL;
}

void cv_draft_release_all(cv_draft *d) {
    if (!d) return;
    for (int64_t k = 0; k < d->max_seqs; k++) slot_release(d, k);
}

void cv_draft_destroy(cv_draft *d) {
    if (!d) return;
    if (d->slots && d->pool) cv_draft_release_all(d);
    free(d->slots);
    free(d->slot_of);
    free(d->left);
    free(d->p_seqs);
    free(d->p_new);
    free(d->p_start);
    free(d->p_index);
    cv_runner_free(&d->runner);
    if (d->ws_ready) cv_forward_ws_free(&d->ws, d->model);
    cv_block_pool_destroy(d->pool);
    if (d->backend) cv_kv_cache_free(&d->kv, d->backend);
    cv_model_free(d->model);
    free(d);
}

/* Prefixes a failure while building the draft with what it was, naming the field. */
static int draft_err(cv_err *err, int rc, const char *path) {
    if (!err) return rc;
    char msg[CV_ERR_MSG_LEN];
    memcpy(msg, err->msg, sizeof msg);
    msg[sizeof msg - 1] = 0;
    return cv_set_field_err(err, rc, "model", "speculative_config: draft model '%s': %s", path, msg);
}

int cv_draft_create(cv_draft **out, const cv_draft_config *cfg, cv_backend *b, const atomic_int *cancel,
                    cv_err *err) {
    *out = NULL;
    if (!cfg->path || !cfg->path[0])
        return cv_set_field_err(err, CV_ERR_INVALID, "model", "speculative_config: model must name a checkpoint");
    if (cfg->max_seqs < 1 || cfg->max_tokens < 1 || cfg->block_size < 1 || cfg->max_k < 1 || cfg->max_model_len < 1)
        return cv_set_err(err, CV_ERR_INVALID, "draft model: bad limits");
    cv_draft *d = calloc(1, sizeof *d);
    if (!d) return cv_set_err(err, CV_ERR_NOMEM, "out of memory");
    int rc = cv_model_load_quantized(&d->model, cfg->path, b, cfg->dtype,
                                     cv_dtype_is_quant(cfg->quantization) ? cfg->quantization : CV_DTYPE_INVALID,
                                     cancel, err);
    if (rc) { rc = draft_err(err, rc, cfg->path); goto fail; }
    const cv_model_config *mc = &d->model->cfg;
    if (mc->vocab_size != cfg->target_vocab) {
        rc = cv_set_field_err(err, CV_ERR_INVALID, "model",
                              "speculative_config: draft model '%s' has a vocabulary of %lld tokens; the "
                              "target's has %lld (a draft must share the target's tokenizer)",
                              cfg->path, (long long)mc->vocab_size, (long long)cfg->target_vocab);
        goto fail;
    }
    d->vocab = mc->vocab_size;
    d->max_len = cfg->max_model_len < mc->max_pos ? cfg->max_model_len : mc->max_pos;
    d->max_seqs = cfg->max_seqs;
    d->max_tokens = cfg->max_tokens;
    d->block_size = cfg->block_size;
    d->max_k = cfg->max_k;
    d->max_blocks_per_seq = (d->max_len + d->block_size - 1) / d->block_size + 1;
    if ((rc = cv_forward_ws_init(&d->ws, d->model, d->max_tokens, d->max_seqs, d->max_blocks_per_seq, err))) {
        rc = draft_err(err, rc, cfg->path);
        goto fail;
    }
    d->ws_ready = 1;
    /* as the target's rule: bf16 keys and values under quantized weights */
    cv_dtype wt = mc->n_layers > 0 ? d->model->layers[0].w_gate_up.dtype : d->model->lm_head.dtype;
    cv_dtype kvt = cv_dtype_is_quant(wt) ? CV_BF16 : d->model->dtype;
    size_t per_block = cv_kv_bytes_per_token(mc->n_layers, mc->n_kv_heads, mc->head_dim, kvt) * (size_t)d->block_size;
    /* every sequence at full length; the CPU commits only the pages used */
    size_t budget = per_block * (size_t)(d->max_seqs * d->max_blocks_per_seq);
    size_t one_seq = per_block * (size_t)d->max_blocks_per_seq;
    if (cfg->kv_bytes_cap > 0 && budget > cfg->kv_bytes_cap)
        budget = cfg->kv_bytes_cap > one_seq ? cfg->kv_bytes_cap : one_seq;
    d->backend = b;
    if ((rc = cv_kv_cache_create(&d->kv, b, mc->n_layers, mc->n_kv_heads, mc->head_dim, kvt, d->block_size, budget,
                                 cancel, err))) {
        rc = draft_err(err, rc, cfg->path);
        goto fail;
    }
    d->pool = cv_block_pool_create(d->kv.num_blocks, d->block_size, 0, err);
    if (!d->pool) { rc = err ? err->code : CV_ERR_NOMEM; goto fail; }
    if ((rc = cv_runner_init(&d->runner, d->max_tokens, d->max_seqs, d->max_seqs, d->max_blocks_per_seq,
                             d->block_size, err)))
        goto fail;
    size_t S = (size_t)d->max_seqs;
    d->slots = calloc(S, sizeof *d->slots);
    d->slot_of = malloc(S * sizeof *d->slot_of);
    d->left = malloc(S * sizeof *d->left);
    d->p_seqs = malloc(S * sizeof *d->p_seqs);
    d->p_new = malloc(S * sizeof *d->p_new);
    d->p_start = malloc(S * sizeof *d->p_start);
    d->p_index = malloc(S * sizeof *d->p_index);
    if (!d->slots || !d->slot_of || !d->left || !d->p_seqs || !d->p_new || !d->p_start || !d->p_index) {
        rc = cv_set_err(err, CV_ERR_NOMEM, "out of memory for the draft model's state");
        goto fail;
    }
    *out = d;
    return CV_OK;
fail:
    cv_draft_destroy(d);
    return rc ? rc : CV_ERR_STATE;
}

int64_t cv_draft_tokens_computed(const cv_draft *d) { return d ? d->tokens_computed : 0; }

int64_t cv_draft_blocks_used(const cv_draft *d) {
    return d ? d->kv.num_blocks - 1 - cv_block_pool_num_free(d->pool) : 0;
}

int cv_draft_check(const cv_draft *d, cv_err *err) {
    if (!d) return CV_OK;
    int32_t *refs = calloc((size_t)d->kv.num_blocks, sizeof *refs);
    if (!refs) return cv_set_err(err, CV_ERR_NOMEM, "out of memory for the draft pool's check");
    int rc = CV_OK;
    for (int64_t k = 0; k < d->max_seqs && !rc; k++) {
        const cv_sequence *q = d->slots[k];
        for (int64_t b = 0; q && b < q->n_blocks && !rc; b++) {
            int32_t id = q->block_table[b];
            if (id < 1 || id >= d->kv.num_blocks)
                rc = cv_set_err(err, CV_ERR_STATE, "draft sequence %lld holds block %d, outside the pool",
                                (long long)q->seq_id, id);
            else
                refs[id]++;
        }
    }
    if (!rc) rc = cv_block_pool_check(d->pool, refs, err);
    free(refs);
    return rc;
}

/* Makes q hold tokens[n], of which its first `from` already are (capacity as
 * needed); CV_ERR_NOMEM leaves it as it was. */
static int hold_tokens(cv_sequence *q, const int32_t *tokens, int64_t from, int64_t n, int64_t extra) {
    if (q->cap_tokens < n + extra) {
        int64_t cap = n + extra + 64;
        int32_t *t = realloc(q->tokens, (size_t)cap * sizeof *t);
        if (!t) return CV_ERR_NOMEM;
        q->tokens = t;
        q->cap_tokens = cap;
    }
    memcpy(q->tokens + from, tokens + from, (size_t)(n - from) * sizeof *tokens);
    q->n_tokens = n;
    return CV_OK;
}

/* The draft-side sequence of target sequence s: found, or made in a free slot
 * (-1 when none is free or memory is short). */
static int64_t slot_for(cv_draft *d, const cv_sequence *s) {
    int64_t free_slot = -1;
    for (int64_t k = 0; k < d->max_seqs; k++) {
        if (d->slots[k] && d->slots[k]->seq_id == s->seq_id) return k;
        if (!d->slots[k] && free_slot < 0) free_slot = k;
    }
    if (free_slot < 0) return -1;
    cv_sequence *q = cv_sequence_create(s->seq_id, NULL, 0, d->max_len);
    if (!q) return -1;
    q->block_table = malloc((size_t)d->max_blocks_per_seq * sizeof *q->block_table);
    if (!q->block_table) { cv_sequence_free(q); return -1; }
    q->cap_blocks = d->max_blocks_per_seq;
    q->status = CV_SEQ_RUNNING;
    d->slots[free_slot] = q;
    return free_slot;
}

/* Brings draft sequence q in line with target s for k proposals: keeps the
 * KV of their common prefix (at least the last token is recomputed, for its
 * logits) and holds blocks for positions up to n + k - 2. Returns k, or 0
 * when the blocks or the memory are not there. */
static int64_t sync_slot(cv_draft *d, cv_sequence *q, const cv_sequence *s, int64_t k) {
    const int64_t n = s->n_tokens;
    if (k > d->max_len - n + 1) k = d->max_len - n + 1;
    if (k <= 0) return 0;
    int64_t keep = q->n_computed < n - 1 ? q->n_computed : n - 1;
    int64_t same = 0;
    while (same < keep && q->tokens[same] == s->tokens[same]) same++;
    if (hold_tokens(q, s->tokens, same, n, d->max_k + 1)) return 0;
    q->n_computed = same;
    int64_t need = (n + k - 1 + d->block_size - 1) / d->block_size;
    while (q->n_blocks < need) {
        int32_t b = cv_block_pool_alloc(d->pool);
        if (b < 0) return 0;
        q->block_table[q->n_blocks++] = b;
    }
    return k;
}

static int64_t argmax(const float *x, int64_t n) {
    int64_t best = 0;
    for (int64_t i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

int cv_draft_propose(cv_draft *d, cv_sequence *const *seqs, const int64_t *want, int64_t n, int32_t *out,
                     int64_t *got, cv_err *err) {
    if (n > d->max_seqs) n = d->max_seqs;
    /* sequences not asked about this round give their blocks back first */
    for (int64_t k = 0; k < d->max_seqs; k++) {
        if (!d->slots[k]) continue;
        int asked = 0;
        for (int64_t i = 0; i < n && !asked; i++) asked = seqs[i]->seq_id == d->slots[k]->seq_id;
        if (!asked) slot_release(d, k);
    }
    for (int64_t i = 0; i < n; i++) {
        got[i] = 0;
        d->left[i] = 0;
        d->slot_of[i] = slot_for(d, seqs[i]);
        if (d->slot_of[i] < 0) continue;
        int64_t k = want[i] < d->max_k ? want[i] : d->max_k;
        d->left[i] = sync_slot(d, d->slots[d->slot_of[i]], seqs[i], k);
    }
    /* Pass 0 catches each draft sequence up (a prompt at first, then the
     * tokens the target accepted) and draws its first proposal; each further
     * pass feeds the last proposal and draws the next. A catch-up past this
     * pass's token budget goes as far as it can and proposes next round. */
    for (;;) {
        cv_sched_output plan = {.seqs = d->p_seqs, .num_new_tokens = d->p_new, .start_pos = d->p_start};
        int64_t budget = d->max_tokens;
        for (int64_t i = 0; i < n && budget > 0; i++) {
            if (d->left[i] <= 0) continue;
            cv_sequence *q = d->slots[d->slot_of[i]];
            int64_t todo = q->n_tokens - q->n_computed;
            if (todo > budget) {
                todo = budget;
                d->left[i] = 0; /* no logits this round */
            }
            d->p_seqs[plan.n_seqs] = q;
            d->p_new[plan.n_seqs] = (int32_t)todo;
            d->p_start[plan.n_seqs] = q->n_computed;
            d->p_index[plan.n_seqs] = i;
            plan.n_seqs++;
            plan.total_tokens += todo;
            budget -= todo;
        }
        if (plan.n_seqs == 0) break;
        int rc = cv_runner_build(&d->runner, &plan, err);
        if (!rc) rc = cv_model_forward(d->model, &d->ws, d->kv.layers, &d->runner.batch, err);
        if (rc) {
            cv_draft_release_all(d);
            return rc;
        }
        d->tokens_computed += plan.total_tokens;
        for (int64_t j = 0; j < plan.n_seqs; j++) d->p_seqs[j]->n_computed += d->p_new[j];
        for (int64_t row = 0; row < d->runner.batch.n_logits; row++) {
            int64_t j = d->runner.sample_plan_index[row], i = d->p_index[j];
            cv_sequence *q = d->p_seqs[j];
            int32_t t = (int32_t)argmax(d->ws.logits_host + row * d->vocab, d->vocab);
            out[i * d->max_k + got[i]++] = t;
            q->tokens[q->n_tokens++] = t; /* capacity: hold_tokens left max_k + 1 spare */
            d->left[i]--;
        }
    }
    return CV_OK;
}
