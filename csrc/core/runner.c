#include "runner.h"

#include <stdlib.h>
#include <string.h>

int cv_runner_init(cv_runner *r, int64_t max_tokens, int64_t max_seqs, int64_t max_rows,
                   int64_t max_blocks_per_seq, int64_t block_size, cv_err *err) {
    memset(r, 0, sizeof *r);
    if (max_rows < max_seqs) max_rows = max_seqs;
    r->max_tokens = max_tokens;
    r->max_seqs = max_seqs;
    r->max_rows = max_rows;
    r->max_blocks_per_seq = max_blocks_per_seq;
    r->block_size = block_size;
    cv_batch *b = &r->batch;
    b->tokens = malloc((size_t)max_tokens * sizeof(int32_t));
    b->positions = malloc((size_t)max_tokens * sizeof(int32_t));
    b->slot_mapping = malloc((size_t)max_tokens * sizeof(int64_t));
    b->query_start = malloc((size_t)(max_seqs + 1) * sizeof(int32_t));
    b->context_lens = malloc((size_t)max_seqs * sizeof(int32_t));
    b->block_tables = malloc((size_t)(max_seqs * max_blocks_per_seq) * sizeof(int32_t));
    b->logits_rows = malloc((size_t)max_rows * sizeof(int32_t));
    r->sample_plan_index = malloc((size_t)max_rows * sizeof(int32_t));
    if (!b->tokens || !b->positions || !b->slot_mapping || !b->query_start || !b->context_lens ||
        !b->block_tables || !b->logits_rows || !r->sample_plan_index) {
        cv_runner_free(r);
        return cv_set_err(err, CV_ERR_NOMEM, "out of memory for the batch arrays");
    }
    return CV_OK;
}

void cv_runner_free(cv_runner *r) {
    cv_batch *b = &r->batch;
    free(b->tokens);
    free(b->positions);
    free(b->slot_mapping);
    free(b->query_start);
    free(b->context_lens);
    free(b->block_tables);
    free(b->logits_rows);
    free(r->sample_plan_index);
    memset(r, 0, sizeof *r);
}

int cv_runner_build(cv_runner *r, const cv_sched_output *plan, cv_err *err) {
    cv_batch *b = &r->batch;
    const int64_t bs = r->block_size;
    if (plan->n_seqs > r->max_seqs || plan->total_tokens > r->max_tokens)
        return cv_set_err(err, CV_ERR_STATE, "plan exceeds the batch limits");
    int64_t stride = 1, max_ctx = 0, rows = 0;
    for (int64_t s = 0; s < plan->n_seqs; s++) {
        const cv_sequence *q = plan->seqs[s];
        int64_t ctx = plan->start_pos[s] + plan->num_new_tokens[s];
        if (q->n_spec < 0 || q->n_spec >= plan->num_new_tokens[s])
            return cv_set_err(err, CV_ERR_STATE, "sequence %lld: %lld proposals in %d new tokens",
                              (long long)q->seq_id, (long long)q->n_spec, plan->num_new_tokens[s]);
        rows += ctx == q->n_tokens ? 1 + q->n_spec : 0;
        int64_t need = (ctx + bs - 1) / bs;
        if (need > q->blocks.n || need > r->max_blocks_per_seq)
            return cv_set_err(err, CV_ERR_STATE, "sequence %lld lacks KV blocks", (long long)q->seq_id);
        if (need > stride) stride = need;
        if (ctx > max_ctx) max_ctx = ctx;
    }
    if (rows > r->max_rows) return cv_set_err(err, CV_ERR_STATE, "plan wants more logits rows than the batch holds");
    int64_t t = 0;
    b->n_seqs = plan->n_seqs;
    b->n_logits = 0;
    b->max_blocks_per_seq = stride;
    b->max_context_len = max_ctx;
    for (int64_t s = 0; s < plan->n_seqs; s++) {
        const cv_sequence *q = plan->seqs[s];
        int64_t start = plan->start_pos[s], n_new = plan->num_new_tokens[s];
        int64_t ctx = start + n_new;
        b->query_start[s] = (int32_t)t;
        b->context_lens[s] = (int32_t)ctx;
        int64_t nb = (ctx + bs - 1) / bs;
        memcpy(b->block_tables + s * stride, q->blocks.table, (size_t)nb * sizeof(int32_t));
        for (int64_t j = 0; j < n_new; j++, t++) {
            int64_t pos = start + j;
            b->tokens[t] = q->tokens[pos];
            b->positions[t] = (int32_t)pos;
            b->slot_mapping[t] = (int64_t)q->blocks.table[pos / bs] * bs + pos % bs;
        }
        if (ctx == q->n_tokens) {
            for (int64_t j = q->n_spec; j >= 0; j--) {
                r->sample_plan_index[b->n_logits] = (int32_t)s;
                b->logits_rows[b->n_logits++] = (int32_t)(t - 1 - j);
            }
        }
    }
    b->query_start[plan->n_seqs] = (int32_t)t;
    b->n_tokens = t;
    return CV_OK;
}
