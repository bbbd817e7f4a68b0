#include "kv_cache.h"

#include <stdlib.h>
#include <string.h>

size_t cv_kv_bytes_per_token(int64_t n_layers, int64_t n_kv_heads, int64_t head_dim, cv_dtype dtype) {
    return 2 * (size_t)n_layers * (size_t)(n_kv_heads * head_dim) * cv_dtype_size(dtype);
}

int cv_kv_cache_create(cv_kv_cache *kv, cv_backend *b, int64_t n_layers, int64_t n_kv_heads,
                       int64_t head_dim, cv_dtype dtype, int64_t block_size, size_t budget_bytes,
                       cv_err *err) {
    memset(kv, 0, sizeof *kv);
    size_t per_block = cv_kv_bytes_per_token(n_layers, n_kv_heads, head_dim, dtype) * (size_t)block_size;
    if (per_block == 0) return cv_set_err(err, CV_ERR_INVALID, "the KV cache dtype has no size");
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
    kv->mem = b->alloc(b, kv->bytes);
    if (!kv->mem) {
        size_t bytes = kv->bytes;
        cv_kv_cache_free(kv, b);
        return cv_set_err(err, CV_ERR_NOMEM, "cannot allocate a KV cache of %zu bytes", bytes);
    }
    size_t layer_half = kv->bytes / (2 * (size_t)n_layers); /* one layer's K (or V) pool */
    for (int64_t l = 0; l < n_layers; l++) {
        cv_kv_layer *c = &kv->layers[l];
        c->k = (char *)kv->mem + (size_t)(2 * l) * layer_half;
        c->v = (char *)kv->mem + (size_t)(2 * l + 1) * layer_half;
        c->dtype = dtype;
        c->num_blocks = num_blocks;
        c->n_kv_heads = n_kv_heads;
        c->block_size = block_size;
        c->head_dim = head_dim;
    }
    return CV_OK;
}

void cv_kv_cache_free(cv_kv_cache *kv, cv_backend *b) {
    if (kv->mem && b) b->free(b, kv->mem);
    free(kv->layers);
    memset(kv, 0, sizeof *kv);
}
