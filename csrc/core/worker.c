#include "worker.h"

#include <stdlib.h>
#include <string.h>

#include "../../base/quant_format.h"

int cv_worker_load(cv_worker *w, cv_backend *b, const char *path, cv_dtype dtype, cv_dtype quantization,
                   const atomic_int *cancel, cv_err *err) {
    memset(w, 0, sizeof *w);
    w->backend = b;
    return cv_model_load_quantized(&w->model, path, b, dtype,
                                   cv_dtype_is_quant(quantization) ? quantization : CV_DTYPE_INVALID, cancel, err);
}

int cv_worker_init_compute(cv_worker *w, int64_t max_tokens, int64_t max_seqs, int64_t max_rows,
                           int64_t max_len, int64_t block_size, cv_err *err) {
    if (max_rows < max_seqs) max_rows = max_seqs;
    w->max_blocks_per_seq = (max_len + block_size - 1) / block_size + 1;
    int rc = cv_forward_ws_init(&w->ws, w->model, max_tokens, max_rows, w->max_blocks_per_seq, err);
    if (rc) return rc;
    w->ws_ready = 1;
    return cv_runner_init(&w->runner, max_tokens, max_seqs, max_rows, w->max_blocks_per_seq, block_size, err);
}

int cv_worker_init_cache(cv_worker *w, cv_dtype kv_dtype, int64_t block_size, size_t bytes,
                         int enable_prefix_caching, const atomic_int *cancel, cv_err *err) {
    const cv_model_config *mc = &w->model->cfg;
    int rc = cv_kv_cache_create(&w->kv, w->backend, mc->n_layers, mc->n_kv_heads, mc->head_dim, kv_dtype,
                                block_size, bytes, cancel, err);
    if (rc) return rc;
    w->blocks = cv_kv_manager_create(w->kv.num_blocks, block_size, enable_prefix_caching, err);
    if (!w->blocks) return err && err->code ? err->code : CV_ERR_NOMEM;
    return CV_OK;
}

int cv_worker_init_lora(cv_worker *w, int64_t n_slots, int64_t max_rank, int64_t max_tokens, int64_t max_seqs,
                        cv_dtype dtype, cv_err *err) {
    if (!w->backend->lora_sgmv)
        return cv_set_field_err(err, CV_ERR_INVALID, "enable_lora", "this backend has no LoRA kernels");
    int rc = cv_lora_pool_init(&w->lora, w->model, n_slots, max_rank, max_tokens, max_seqs, dtype, err);
    if (rc) return rc;
    w->lora_slots = malloc((size_t)(max_seqs > 0 ? max_seqs : 1) * sizeof *w->lora_slots);
    if (!w->lora_slots) return cv_set_err(err, CV_ERR_NOMEM, "out of memory for LoRA slots");
    return CV_OK;
}

void cv_worker_free(cv_worker *w) {
    if (!w) return;
    if (w->backend) cv_lora_pool_free(&w->lora, w->backend);
    free(w->lora_slots);
    cv_kv_manager_destroy(w->blocks);
    cv_runner_free(&w->runner);
    if (w->ws_ready) cv_forward_ws_free(&w->ws, w->model);
    if (w->backend) cv_kv_cache_free(&w->kv, w->backend);
    cv_model_free(w->model);
    memset(w, 0, sizeof *w);
}

cv_dtype cv_worker_matrix_dtype(const cv_worker *w) {
    const cv_model *m = w->model;
    return m->cfg.n_layers > 0 ? m->layers[0].w_gate_up.dtype : m->lm_head.dtype;
}

cv_dtype cv_worker_auto_kv_dtype(const cv_worker *w) {
    return cv_dtype_is_quant(cv_worker_matrix_dtype(w)) ? CV_BF16 : w->model->dtype;
}

int cv_worker_prepare(cv_worker *w, const cv_sched_output *plan, cv_err *err) {
    int rc = cv_runner_build(&w->runner, plan, err);
    if (rc || !w->lora_slots) return rc;
    /* the runner keeps the plan's order of sequences */
    for (int64_t s = 0; s < plan->n_seqs; s++) w->lora_slots[s] = plan->seqs[s]->lora_slot;
    w->runner.batch.lora_slots = w->lora_slots;
    w->runner.batch.lora = &w->lora;
    return CV_OK;
}

int cv_worker_forward(cv_worker *w, cv_err *err) {
    return cv_model_forward(w->model, &w->ws, w->kv.layers, &w->runner.batch, err);
}

int cv_worker_execute(cv_worker *w, const cv_sched_output *plan, cv_err *err) {
    int rc = cv_worker_prepare(w, plan, err);
    return rc ? rc : cv_worker_forward(w, err);
}
