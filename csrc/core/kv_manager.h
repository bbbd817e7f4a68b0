/* KV manager: the layer between a scheduler's policy and the block pool.
 * It alone writes a sequence's block table (cv_sequence.blocks): it hands out
 * and takes back blocks, looks up and registers prefix-cache blocks, keeps a
 * preempted sequence's blocks reclaimable, shares a parent's prompt blocks
 * with a fork and trims a table after speculative verification. It decides nothing: which sequence gets blocks, and when, is
 * the caller's (the scheduler, or the draft model's proposer).
 *
 * The KV a sequence holds is its first n_computed positions; every function
 * that drops blocks also lowers n_computed to what the remaining blocks hold. */
#ifndef CV_KV_MANAGER_H
#define CV_KV_MANAGER_H

#include <stdint.h>
#include "../../base/common.h"
#include "sequence.h"

typedef struct cv_kv_manager cv_kv_manager;

/* A pool of num_blocks blocks (>= 2: block 0 is reserved) of block_size
 * token slots. NULL on error (err says why). */
cv_kv_manager *cv_kv_manager_create(int64_t num_blocks, int64_t block_size, int enable_prefix_caching,
                                    cv_err *err);
void cv_kv_manager_destroy(cv_kv_manager *m);

int64_t cv_kv_manager_block_size(const cv_kv_manager *m);
int64_t cv_kv_manager_num_blocks(const cv_kv_manager *m);  /* including the reserved block 0 */
int cv_kv_manager_prefix_caching(const cv_kv_manager *m);
int64_t cv_kv_manager_num_free(const cv_kv_manager *m);    /* free, cached or not */
int64_t cv_kv_manager_num_cached_free(const cv_kv_manager *m);
int64_t cv_kv_manager_num_touched(const cv_kv_manager *m); /* blocks ever handed out */
/* The reference count of block b, -1 when b is out of range. */
int32_t cv_kv_manager_refcount(const cv_kv_manager *m, int64_t b);
/* Prompt tokens looked up in the prefix cache, and of which served from it. */
void cv_kv_manager_prefix_counts(const cv_kv_manager *m, int64_t *queries, int64_t *hits);

static inline int64_t cv_kv_num_blocks(const cv_sequence *q) { return q->blocks.n; }

/* Blocks q must add so that its table covers its first n_tokens positions (>= 0). */
int64_t cv_kv_manager_blocks_needed(const cv_kv_manager *m, const cv_sequence *q, int64_t n_tokens);
/* Room in q's table for n block ids, so that a later allocate or
 * take_prefix within it cannot fail. CV_ERR_NOMEM leaves q as it was. */
int cv_kv_manager_reserve(cv_kv_manager *m, cv_sequence *q, int64_t n);
/* Appends n free blocks to q's table (forgetting any kept blocks, see
 * preempt). CV_ERR_NOMEM (the table cannot grow) or CV_ERR_STATE (fewer than
 * n blocks free) take nothing. */
int cv_kv_manager_allocate(cv_kv_manager *m, cv_sequence *q, int64_t n);
/* Gives back every block of q (tail first, so a prefix's leading blocks are
 * evicted last) and forgets its KV: n_computed 0, no kept blocks. */
void cv_kv_manager_free(cv_kv_manager *m, cv_sequence *q);

/* The longest run of prefix-cache blocks holding q's leading full blocks,
 * leaving at least one token to compute (logits need one); 0 when caching is
 * off or q skips the cache. *n_free_hits: how many of them sit in the free
 * queue (taking them uses up free blocks). Remembered for take_prefix. */
int64_t cv_kv_manager_lookup_prefix(cv_kv_manager *m, const cv_sequence *q, int64_t *n_free_hits);
/* Takes the first n_hits blocks of the last lookup (made for q) into q's
 * empty table: n_computed becomes n_hits * block_size, and the first
 * admission records n_cached_prompt. Counts the lookup in the prefix counts.
 * Nothing when caching is off. CV_ERR_NOMEM (the table cannot grow) takes
 * nothing. */
int cv_kv_manager_take_prefix(cv_kv_manager *m, cv_sequence *q, int64_t n_hits);

/* Preemption that keeps what it can: gives back every block of q like free,
 * but the blocks holding its computed KV go to the tail of the free queue
 * (the prefix cache's LRU) and q remembers them (cv_seq_blocks.n_kept), so a
 * later resume takes back those not handed out since. Whether or not prefix
 * caching is on, only q can take them back this way. */
void cv_kv_manager_preempt(cv_kv_manager *m, cv_sequence *q);
/* For q, preempted and holding no blocks: the KV it can take back, in tokens
 * (< q->n_tokens): its own kept blocks up to the first one handed out since,
 * or, when prefix caching is on and it finds more, the cache's blocks for its
 * tokens. *n_blocks: the blocks that KV is in; *n_free_hits: how many of them
 * sit in the free queue (taking them uses up free blocks). Remembered for
 * take_resume. */
int64_t cv_kv_manager_lookup_resume(cv_kv_manager *m, const cv_sequence *q, int64_t *n_blocks,
                                    int64_t *n_free_hits);
/* Takes the last resume lookup (made for q) into q's empty table:
 * n_computed becomes the tokens found and q forgets its kept blocks.
 * CV_ERR_NOMEM (the table cannot grow) takes nothing. */
int cv_kv_manager_take_resume(cv_kv_manager *m, cv_sequence *q);

/* child (holding exactly parent's prompt, no blocks) shares parent's full,
 * computed prompt blocks strictly before the block of the last prompt token,
 * so it computes at least one token: ref counts go up, child->n_computed
 * and n_cached_prompt become the tokens shared. CV_ERR_NOMEM shares nothing. */
int cv_kv_manager_fork(cv_kv_manager *m, cv_sequence *child, const cv_sequence *parent);

/* After q's n_computed advanced: registers its newly full, computed blocks in
 * the prefix cache, never one holding an unverified proposal (q->n_spec).
 * Nothing when caching is off. */
void cv_kv_manager_cache_full(cv_kv_manager *m, cv_sequence *q);
/* After speculative verification set q's tokens: the KV of positions >=
 * n_valid is not valid. Lowers n_computed to n_valid (and n_tokens), gives
 * back the table's blocks beyond n_tokens and caches the newly full blocks. */
void cv_kv_manager_trim(cv_kv_manager *m, cv_sequence *q, int64_t n_valid);

/* Empty token slots in q's unshared blocks past its computed KV (shared
 * blocks are always full), for the cache-waste figure. */
int64_t cv_kv_manager_empty_slots(const cv_kv_manager *m, const cv_sequence *q);

/* For tests: checks q's table (valid block ids, none twice, no more cached
 * blocks than computed KV). CV_OK or CV_ERR_STATE with a message. */
int cv_kv_manager_check_seq(const cv_kv_manager *m, const cv_sequence *q, cv_err *err);
/* For tests: checks every table of seqs[n] (NULL entries skipped) and the
 * pool, whose reference counts must be exactly the tables' holdings.
 * CV_OK, CV_ERR_STATE with a message, or CV_ERR_NOMEM. */
int cv_kv_manager_check(const cv_kv_manager *m, const cv_sequence *const *seqs, int64_t n, cv_err *err);

#endif
