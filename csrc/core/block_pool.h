/* KV block pool: every KV block of the cache, the free queue, reference
 * counts and the prefix cache. Sees only block ids (and, for the prefix cache,
 * the token ids a block holds).
 *
 * Free queue: an intrusive doubly linked list over block ids (prev/next
 * arrays), so alloc, free and taking a block out of the middle are O(1).
 * Allocation takes from the head. A freed block that holds a cached prefix
 * goes to the tail and stays reusable until it reaches the head (LRU
 * eviction); a freed block without one goes to the head (reused first).
 * Block 0 is reserved and never handed out.
 *
 * Generations: a block's generation goes up each time it is handed out by
 * alloc (the only way its KV is ever overwritten), so a holder that noted
 * (block, generation) when it let the block go knows later whether the KV it
 * wrote there is still intact. A block released with keep goes to the tail
 * like a cached one, so it lives as long as the LRU allows.
 *
 * Prefix cache: a full, computed block may be registered under a key
 * (parent key, its block_size token ids). The parent key is the cache key of
 * the previous block of the same sequence (0 for the first block). Keys are
 * unique ids handed out at registration and never reused, so a lookup that
 * matches (parent key, tokens) exactly matches the whole prefix exactly: no
 * hash collision can ever give wrong KV. The 64-bit hash of (parent key,
 * tokens) only picks the bucket of a chained hash table sized at creation. */
#ifndef CV_BLOCK_POOL_H
#define CV_BLOCK_POOL_H

#include <stdint.h>
#include "../../base/common.h"

typedef struct cv_block_pool cv_block_pool;

/* num_blocks >= 2 (block 0 reserved), block_size >= 1. The prefix cache
 * tables exist only when enable_prefix_caching is set. NULL on error. */
cv_block_pool *cv_block_pool_create(int64_t num_blocks, int64_t block_size,
                                    int enable_prefix_caching, cv_err *err);
void cv_block_pool_destroy(cv_block_pool *p);

int64_t cv_block_pool_num_free(const cv_block_pool *p);    /* free, cached or not */
int64_t cv_block_pool_num_cached_free(const cv_block_pool *p);
/* Blocks ever handed out: on the CPU, where the KV pool is committed as it is
 * used, the part of the pool that is resident. */
int64_t cv_block_pool_num_touched(const cv_block_pool *p);

/* Takes the head of the free queue (evicting its cached prefix, if any) with
 * ref count 1. Returns -1 when no block is free. */
int32_t cv_block_pool_alloc(cv_block_pool *p);
/* Adds a reference to block b (a free cached block leaves the free queue). */
void cv_block_pool_incref(cv_block_pool *p, int32_t b);
/* Drops a reference; at zero the block returns to the free queue. */
void cv_block_pool_decref(cv_block_pool *p, int32_t b);
int32_t cv_block_pool_refcount(const cv_block_pool *p, int32_t b);
/* Drops a reference; at zero the block goes to the tail of the free queue
 * (evicted last) even when it holds no cached prefix: its KV is worth keeping. */
void cv_block_pool_decref_keep(cv_block_pool *p, int32_t b);
/* How many times block b has been handed out by alloc. */
uint64_t cv_block_pool_generation(const cv_block_pool *p, int32_t b);

/* Prefix cache. tokens: [block_size]. Returns the block cached under
 * (parent_key, tokens), or -1. No side effects. */
int32_t cv_block_pool_lookup(const cv_block_pool *p, uint64_t parent_key, const int32_t *tokens);
/* Cache key of block b, 0 when it holds no cached prefix. */
uint64_t cv_block_pool_key(const cv_block_pool *p, int32_t b);
/* Registers the referenced, full block b as holding (parent_key, tokens) and
 * returns the key of that content: b's own key when it already has one, the
 * key of another block already caching the same content (b stays uncached),
 * or a new key for b. Returns 0 when caching is off. */
uint64_t cv_block_pool_register(cv_block_pool *p, int32_t b, uint64_t parent_key,
                                const int32_t *tokens);

/* For tests: checks the free queue (no cycles, length == free count, free
 * xor referenced), block 0, the hash table (every entry where its hash puts
 * it, holding the key and tokens it was registered with) and, when
 * expected_refs ([num_blocks]) is given, every ref count against it.
 * CV_OK or CV_ERR_STATE with a message (CV_ERR_NOMEM if it cannot check). */
int cv_block_pool_check(const cv_block_pool *p, const int32_t *expected_refs, cv_err *err);

#endif
