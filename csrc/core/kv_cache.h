/* The paged KV cache: its size per token, and each layer's K and V pools,
 * [num_blocks][n_kv_heads][block_size][head_dim] each, one allocation apiece
 * (so building a large cache can be cancelled between allocations).
 * Block 0 is reserved (the scheduler never hands it out). */
#ifndef CV_KV_CACHE_H
#define CV_KV_CACHE_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include "../../base/common.h"
#include "../../kernels/backend.h"

/* K and V bytes of one token over every layer (0 for a dtype with no size). */
size_t cv_kv_bytes_per_token(int64_t n_layers, int64_t n_kv_heads, int64_t head_dim, cv_dtype dtype);

typedef struct cv_kv_cache {
    cv_kv_layer *layers; /* [n_layers]; each k and v is a backend allocation of its own */
    int64_t n_layers;
    int64_t num_blocks;  /* including the reserved block 0 */
    size_t bytes;
} cv_kv_cache;

/* Allocates as many blocks as budget_bytes holds, plus the reserved block;
 * CV_ERR_INVALID when the budget holds no block. Polls *cancel (when not NULL)
 * between allocations: nonzero stops with CV_ERR_CANCELLED. */
int cv_kv_cache_create(cv_kv_cache *kv, cv_backend *b, int64_t n_layers, int64_t n_kv_heads,
                       int64_t head_dim, cv_dtype dtype, int64_t block_size, size_t budget_bytes,
                       const atomic_int *cancel, cv_err *err);
void cv_kv_cache_free(cv_kv_cache *kv, cv_backend *b);

#endif
