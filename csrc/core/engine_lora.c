/* The engine's LoRA slots: loading and emptying them, and checking that a
 * request names a loaded one (the slots themselves live in the worker). */
#include "engine_internal.h"

int cv_engine_lora_load(cv_engine *e, int64_t slot, int64_t rank, float scale, int64_t n_pairs,
                        const int32_t *layers, const int32_t *modules, const float *const *a,
                        const float *const *b, cv_err *err) {
    cv_lora_pool_lock(&e->worker.lora); /* between steps: see engine_step */
    int rc = cv_lora_pool_load(&e->worker.lora, e->worker.model, slot, rank, scale, n_pairs, layers, modules, a, b,
                               err);
    cv_lora_pool_unlock(&e->worker.lora);
    return rc;
}

int cv_engine_lora_unload(cv_engine *e, int64_t slot, cv_err *err) {
    if (slot < 0 || slot >= e->worker.lora.n_slots)
        return cv_set_err(err, CV_ERR_INVALID, "LoRA slot %lld outside [0, %lld)", (long long)slot,
                          (long long)e->worker.lora.n_slots);
    cv_lora_pool_lock(&e->worker.lora);
    cv_lora_pool_unload(&e->worker.lora, e->backend, slot);
    cv_lora_pool_unlock(&e->worker.lora);
    return CV_OK;
}

int cv_engine_lora_check(const cv_engine *e, int32_t slot, int64_t lora_id, cv_err *err) {
    if (lora_id == 0) return CV_OK; /* the base model (lora_slot is not read) */
    const cv_lora_pool *p = &e->worker.lora;
    if (p->n_slots == 0)
        return cv_set_field_err(err, CV_ERR_INVALID, "lora_request",
                                "a LoRA adapter was requested but the engine was made without enable_lora=True");
    if (slot < 0 || slot >= p->n_slots || !p->slots[slot].loaded || lora_id < 1)
        return cv_set_field_err(err, CV_ERR_INVALID, "lora_request", "LoRA slot %d (adapter id %lld) is not loaded",
                                slot, (long long)lora_id);
    return CV_OK;
}

void cv_engine_lora_shape(const cv_engine *e, int module, int64_t *out, int64_t *in) {
    cv_lora_module_shape(e->worker.model, module, out, in);
}

int64_t cv_engine_lora_slots(const cv_engine *e, int64_t *max_rank) {
    if (max_rank) *max_rank = e->worker.lora.max_rank;
    return e->worker.lora.n_slots;
}

cv_dtype cv_engine_lora_dtype(const cv_engine *e) {
    return e->worker.lora.n_slots ? e->worker.lora.dtype : CV_DTYPE_INVALID;
}
