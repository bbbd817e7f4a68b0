#include "kv_cache.h"

#include <stdlib.h>
#include <string.h>

size_t cv_kv_bytes_per_token(int64_t n_layers, int64_t n_kv_heads, int64_t head_dim, cv_dtype dtype) {
    const size_t esz = cv_dtype_size(dtype);
    if (esz == 0) return 0;
    /* int8: each row's float32 scale too */
    const size_t row = (size_t)head_dim * esz + (dtype == CV_I8 ? sizeof(float) : 0);
    return 2 * (size_t)n_layers * (size_t)n_kv_heads * row;
}

int cv_kv_cache_create(cv_kv_cache *kv, cv_backend *b, int64_t n_layers, int64_t n_kv_heads,
                       int64_t head_dim, cv_dtype dtype, int64_t block_size, size_t budget_bytes,
                       const atomic_int *cancel, cv_err *err) {
    memset(kv, 0, sizeof *kv);
    size_t per_block = cv_kv_bytes_per_token(n_layers, n_kv_heads, head_dim, dtype) * (size_t)block_size;
    if (per_block == 0) return cv_set_err(err, CV_ERR_INVALID, "the KV cache dtype has no size");
    if (dtype == CV_I8 && strcmp(b->name, "cpu") != 0)
        return cv_set_err(err, CV_ERR_UNSUPPORTED,
                          "kv_cache_dtype=\"int8\" is supported on the CPU backend only, not on \"%s\"", b->name);
    int64_t num_blocks = (int64_t)(budget_bytes / per_block) + 1; /* + reserved block 0 */
    if (num_blocks < 2)
        return cv_set_err(err, CV_ERR_INVALID,
                          "kv_cache_memory of %zu bytes holds no KV block (one block needs %zu bytes)",
                          budget_bytes, per_block);
    kv->layers = calloc((size_t)n_layers, sizeof *kv->layers);
    if (!kv->layers) return cv_set_err(err, CV_ERR_NOMEM, "out of memory");
    kv->n_layers = n_layers;
    kv->num_blocks = num_blocks;
    kv->bytes = (size_t)num_blocks * per_block;
    /* one layer's K (or V) pool, and (int8) its scales */
    const size_t rows = (size_t)num_blocks * (size_t)n_kv_heads * (size_t)block_size;
    const size_t layer_half = rows * (size_t)head_dim * cv_dtype_size(dtype);
    const size_t scale_bytes = dtype == CV_I8 ? rows * sizeof(float) : 0;
    int rc = CV_OK;
    for (int64_t l = 0; l < n_layers; l++) {
        if (cancel && atomic_load(cancel)) {
            rc = cv_set_err(err, CV_ERR_CANCELLED, "creating the engine was cancelled");
            goto fail;
        }
        cv_kv_layer *c = &kv->layers[l];
        c->k = b->alloc(b, layer_half); /* zeroed; the CPU backend commits pages as they are used */
        c->v = c->k ? b->alloc(b, layer_half) : NULL;
        if (c->v && scale_bytes) {
            c->k_scale = b->alloc(b, scale_bytes);
            c->v_scale = c->k_scale ? b->alloc(b, scale_bytes) : NULL;
        }
        if (!c->v || (scale_bytes && !c->v_scale)) {
            rc = cv_set_err(err, CV_ERR_NOMEM, "cannot allocate a KV cache of %zu bytes", kv->bytes);
            goto fail;
        }
        c->dtype = dtype;
        c->num_blocks = num_blocks;
        c->n_kv_heads = n_kv_heads;
        c->block_size = block_size;
        c->head_dim = head_dim;
    }
    return CV_OK;
fail:
    cv_kv_cache_free(kv, b);
    return rc;
}

void cv_kv_cache_free(cv_kv_cache *kv, cv_backend *b) {
    if (kv->layers && b)
        for (int64_t l = 0; l < kv->n_layers; l++) {
            if (kv->layers[l].k) b->free(b, kv->layers[l].k);
            if (kv->layers[l].v) b->free(b, kv->layers[l].v);
            if (kv->layers[l].k_scale) b->free(b, kv->layers[l].k_scale);
            if (kv->layers[l].v_scale) b->free(b, kv->layers[l].v_scale);
        }
    free(kv->layers);
    memset(kv, 0, sizeof *kv);
}
