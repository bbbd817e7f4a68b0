#include "lora.h"

#include <stdlib.h>
#include <string.h>

#include "model.h"

void cv_lora_module_shape(const cv_model *m, int module, int64_t *out, int64_t *in) {
    const int64_t dim = m->cfg.dim, hidden = m->cfg.hidden_dim;
    switch (module) {
    case CV_LORA_Q: *out = m->q_dim; *in = dim; break;
    case CV_LORA_K: case CV_LORA_V: *out = m->kv_dim; *in = dim; break;
    case CV_LORA_O: *out = dim; *in = m->q_dim; break;
    case CV_LORA_GATE: case CV_LORA_UP: *out = hidden; *in = dim; break;
    default: *out = dim; *in = hidden; break;
    }
}

cv_dtype cv_lora_auto_dtype(const cv_model *m) {
    const cv_dtype w = m->cfg.n_layers > 0 ? m->layers[0].w_gate_up.dtype : m->lm_head.dtype;
    return w == CV_F32 ? CV_F32 : CV_BF16;
}

void cv_lora_pool_lock(cv_lora_pool *p) {
    if (p->lock_ready) pthread_mutex_lock(&p->lock);
}

void cv_lora_pool_unlock(cv_lora_pool *p) {
    if (p->lock_ready) pthread_mutex_unlock(&p->lock);
}

int cv_lora_pool_init(cv_lora_pool *p, const cv_model *m, int64_t n_slots, int64_t max_rank, int64_t max_tokens,
                      int64_t max_seqs, cv_dtype dtype, cv_err *err) {
    memset(p, 0, sizeof *p);
    if (n_slots < 1 || n_slots > CV_LORA_MAX_SLOTS)
        return cv_set_field_err(err, CV_ERR_INVALID, "max_loras", "max_loras must be in [1, %d], got %lld",
                                CV_LORA_MAX_SLOTS, (long long)n_slots);
    if (max_rank < 1 || max_rank > CV_LORA_MAX_RANK)
        return cv_set_field_err(err, CV_ERR_INVALID, "max_lora_rank", "max_lora_rank must be in [1, %d], got %lld",
                                CV_LORA_MAX_RANK, (long long)max_rank);
    if (dtype != CV_F32 && dtype != CV_BF16)
        return cv_set_field_err(err, CV_ERR_INVALID, "lora_dtype", "lora_dtype must be float32 or bfloat16");
    const size_t per = (size_t)m->cfg.n_layers * CV_LORA_N_MODULES;
    p->dtype = dtype;
    p->n_slots = n_slots;
    p->max_rank = max_rank;
    p->n_layers = m->cfg.n_layers;
    p->max_tokens = max_tokens;
    p->slots = calloc((size_t)n_slots, sizeof *p->slots);
    p->tmp = m->backend->alloc(m->backend, (size_t)max_tokens * (size_t)max_rank * sizeof(float));
    p->max_segs = CV_LORA_MAX_FUSED * (max_seqs > 0 ? max_seqs : 1);
    p->segs = calloc((size_t)p->max_segs, sizeof *p->segs);
    int ok = p->slots && p->tmp && p->segs;
    if (ok && pthread_mutex_init(&p->lock, NULL) == 0) p->lock_ready = 1;
    else ok = 0;
    for (int64_t s = 0; ok && s < n_slots; s++) {
        p->slots[s].a = calloc(per, sizeof(void *));
        p->slots[s].bt = calloc(per, sizeof(void *));
        ok = p->slots[s].a && p->slots[s].bt;
    }
    if (!ok) {
        cv_lora_pool_free(p, m->backend);
        return cv_set_err(err, CV_ERR_NOMEM, "out of memory for %lld LoRA slots", (long long)n_slots);
    }
    return CV_OK;
}

void cv_lora_pool_unload(cv_lora_pool *p, cv_backend *b, int64_t slot) {
    if (slot < 0 || slot >= p->n_slots) return;
    cv_lora_slot *s = &p->slots[slot];
    const int64_t per = p->n_layers * CV_LORA_N_MODULES;
    for (int64_t i = 0; i < per && s->a; i++) s->a[i] = s->bt[i] = NULL;
    b->free(b, s->block);
    s->block = NULL;
    s->loaded = 0;
    s->rank = 0;
    s->scale = 0.0f;
}

void cv_lora_pool_free(cv_lora_pool *p, cv_backend *b) {
    if (p->slots) {
        for (int64_t s = 0; s < p->n_slots; s++) {
            cv_lora_pool_unload(p, b, s);
            free(p->slots[s].a);
            free(p->slots[s].bt);
        }
        free(p->slots);
    }
    if (p->tmp) b->free(b, p->tmp);
    free(p->segs);
    if (p->lock_ready) pthread_mutex_destroy(&p->lock);
    memset(p, 0, sizeof *p);
}

int cv_lora_pool_load(cv_lora_pool *p, const cv_model *m, int64_t slot, int64_t rank, float scale, int64_t n_pairs,
                      const int32_t *layers, const int32_t *modules, const float *const *a, const float *const *b,
                      cv_err *err) {
    cv_backend *be = m->backend;
    if (p->n_slots == 0) return cv_set_err(err, CV_ERR_STATE, "LoRA is not enabled (enable_lora=True)");
    if (slot < 0 || slot >= p->n_slots)
        return cv_set_err(err, CV_ERR_INVALID, "LoRA slot %lld outside [0, %lld)", (long long)slot,
                          (long long)p->n_slots);
    if (rank < 1 || rank > p->max_rank)
        return cv_set_field_err(err, CV_ERR_INVALID, "max_lora_rank", "adapter rank %lld is over max_lora_rank=%lld",
                                (long long)rank, (long long)p->max_rank);
    for (int64_t i = 0; i < n_pairs; i++) {
        if (layers[i] < 0 || layers[i] >= p->n_layers || modules[i] < 0 || modules[i] >= CV_LORA_N_MODULES)
            return cv_set_err(err, CV_ERR_INVALID, "LoRA pair %lld: layer %d module %d outside the model",
                              (long long)i, layers[i], modules[i]);
    }
    cv_lora_pool_unload(p, be, slot);
    cv_lora_slot *s = &p->slots[slot];
    const size_t elem = p->dtype == CV_BF16 ? 2 : 4, per = (size_t)p->n_layers * CV_LORA_N_MODULES;
    void *host = NULL; /* one matrix in the pool's layout and dtype */
    size_t host_cap = 0, total = 0;
    int64_t *pair_of = malloc(per * sizeof *pair_of); /* [layer * modules + module] -> its pair, or -1 */
    size_t *at = malloc(per * sizeof *at);             /* the byte offset of its A in the block (B^T follows) */
    if (!pair_of || !at) goto nomem;
    for (size_t k = 0; k < per; k++) pair_of[k] = -1;
    for (int64_t i = 0; i < n_pairs; i++) { /* a repeated pair: the first wins */
        const size_t k = (size_t)layers[i] * CV_LORA_N_MODULES + (size_t)modules[i];
        if (pair_of[k] < 0) pair_of[k] = i;
    }
    for (size_t k = 0; k < per; k++) { /* layer by layer, module by module: as the forward reads them */
        if (pair_of[k] < 0) continue;
        int64_t out, in;
        cv_lora_module_shape(m, (int)(k % CV_LORA_N_MODULES), &out, &in);
        at[k] = total;
        total += (((size_t)rank * (size_t)in + (size_t)CV_LORA_BT_SIZE(rank, out)) * elem + 63) & ~(size_t)63;
    }
    if (!(s->block = be->alloc(be, total))) goto nomem;
    for (size_t k = 0; k < per; k++) {
        const int64_t i = pair_of[k];
        if (i < 0) continue;
        int64_t out, in;
        cv_lora_module_shape(m, modules[i], &out, &in);
        const size_t na = (size_t)rank * (size_t)in, nb = (size_t)CV_LORA_BT_SIZE(rank, out);
        const size_t need = (na > nb ? na : nb) * elem;
        if (need > host_cap) {
            void *h = realloc(host, need);
            if (!h) goto nomem;
            host = h;
            host_cap = need;
        }
        s->a[k] = (char *)s->block + at[k];
        s->bt[k] = (char *)s->block + at[k] + na * elem;
        for (size_t e = 0; e < na; e++) /* A as it is */
            if (elem == 2) ((uint16_t *)host)[e] = cv_f32_to_bf16(a[i][e]);
            else ((float *)host)[e] = a[i][e];
        be->to_device(be, s->a[k], host, na * elem);
        memset(host, 0, nb * elem); /* the last panel's padding */
        for (int64_t o = 0; o < out; o++) /* B [out][rank] -> B^T in panels */
            for (int64_t j = 0; j < rank; j++) {
                const size_t e = (size_t)CV_LORA_BT_AT(rank, j, o);
                const float v = b[i][o * rank + j];
                if (elem == 2) ((uint16_t *)host)[e] = cv_f32_to_bf16(v);
                else ((float *)host)[e] = v;
            }
        be->to_device(be, s->bt[k], host, nb * elem);
        be->sync(be); /* the host buffer is reused for the next matrix */
    }
    free(pair_of);
    free(at);
    free(host);
    s->rank = rank;
    s->scale = scale;
    s->loaded = 1;
    return CV_OK;
nomem:
    free(host);
    free(pair_of);
    free(at);
    cv_lora_pool_unload(p, be, slot);
    return cv_set_err(err, CV_ERR_NOMEM, "out of memory for a LoRA adapter of rank %lld", (long long)rank);
}
