/* KV manager over the block pool (see kv_manager.h). */
#include "kv_manager.h"
#include "block_pool.h"

#include <stdlib.h>
#include <string.h>

struct cv_kv_manager {
    cv_block_pool *pool;
    int64_t num_blocks, bs;
    int enable_prefix_caching;
    int32_t *hits;             /* [max_hits] blocks found by the last prefix lookup */
    int64_t max_hits, n_hits;
    const cv_sequence *hits_for; /* the sequence that lookup was for */
    /* the last resume lookup: for whom, from its own kept blocks or from hits */
    const cv_sequence *resume_for;
    int resume_own;
    int64_t resume_tokens, resume_blocks;
    int64_t prefix_queries, prefix_hits;
};

cv_kv_manager *cv_kv_manager_create(int64_t num_blocks, int64_t block_size, int enable_prefix_caching,
                                    cv_err *err) {
    cv_kv_manager *m = calloc(1, sizeof *m);
    if (!m) {
        cv_set_err(err, CV_ERR_NOMEM, "KV manager: out of memory");
        return NULL;
    }
    m->num_blocks = num_blocks;
    m->bs = block_size;
    m->enable_prefix_caching = enable_prefix_caching ? 1 : 0;
    m->pool = cv_block_pool_create(num_blocks, block_size, m->enable_prefix_caching, err);
    if (!m->pool) goto fail;
    /* a lookup never passes the usable blocks: a longer sequence is refused at add */
    m->max_hits = m->enable_prefix_caching ? num_blocks - 1 : 0;
    if (m->max_hits > 0) {
        m->hits = calloc((size_t)m->max_hits, sizeof *m->hits);
        if (!m->hits) {
            cv_set_err(err, CV_ERR_NOMEM, "KV manager: out of memory for %lld prefix hits", (long long)m->max_hits);
            goto fail;
        }
    }
    return m;
fail:
    cv_kv_manager_destroy(m);
    return NULL;
}

void cv_kv_manager_destroy(cv_kv_manager *m) {
    if (!m) return;
    cv_block_pool_destroy(m->pool);
    free(m->hits);
    free(m);
}

int64_t cv_kv_manager_block_size(const cv_kv_manager *m) { return m->bs; }
int64_t cv_kv_manager_num_blocks(const cv_kv_manager *m) { return m->num_blocks; }
int cv_kv_manager_prefix_caching(const cv_kv_manager *m) { return m->enable_prefix_caching; }
int64_t cv_kv_manager_num_free(const cv_kv_manager *m) { return cv_block_pool_num_free(m->pool); }
int64_t cv_kv_manager_num_cached_free(const cv_kv_manager *m) { return cv_block_pool_num_cached_free(m->pool); }
int64_t cv_kv_manager_num_touched(const cv_kv_manager *m) { return cv_block_pool_num_touched(m->pool); }

int32_t cv_kv_manager_refcount(const cv_kv_manager *m, int64_t b) {
    if (b < 0 || b >= m->num_blocks) return -1;
    return cv_block_pool_refcount(m->pool, (int32_t)b);
}

void cv_kv_manager_prefix_counts(const cv_kv_manager *m, int64_t *queries, int64_t *hits) {
    *queries = m->prefix_queries;
    *hits = m->prefix_hits;
}

int64_t cv_kv_manager_blocks_needed(const cv_kv_manager *m, const cv_sequence *q, int64_t n_tokens) {
    int64_t need = (n_tokens + m->bs - 1) / m->bs - q->blocks.n;
    return need > 0 ? need : 0;
}

/* Amortized growth of q's table. */
int cv_kv_manager_reserve(cv_kv_manager *m, cv_sequence *q, int64_t n) {
    (void)m;
    cv_seq_blocks *t = &q->blocks;
    if (n <= t->cap) return CV_OK;
    int64_t cap = t->cap * 2;
    if (cap < 4) cap = 4;
    if (cap < n) cap = n;
    int32_t *ids = realloc(t->table, (size_t)cap * sizeof *ids);
    if (!ids) return CV_ERR_NOMEM;
    t->table = ids;
    uint64_t *gen = realloc(t->gen, (size_t)cap * sizeof *gen);
    if (!gen) return CV_ERR_NOMEM; /* the larger table is kept; cap still says the old size */
    t->gen = gen;
    t->cap = cap;
    return CV_OK;
}

/* A table that takes new blocks no longer holds the ids of its kept ones. */
static void forget_kept(cv_sequence *q) {
    q->blocks.n_kept = 0;
    q->blocks.kept_computed = 0;
}

/* The key a sequence's prefix-cache chain starts from: 0 for the base model;
 * under an adapter, a key no registered block has (those count up from 1), so
 * the same tokens under two adapters, or under none, never share blocks. */
static uint64_t root_key(const cv_sequence *q) {
    return q->lora_id > 0 ? ((uint64_t)1 << 63) | (uint64_t)q->lora_id : 0;
}

int cv_kv_manager_allocate(cv_kv_manager *m, cv_sequence *q, int64_t n) {
    if (n <= 0) return CV_OK;
    if (n > cv_block_pool_num_free(m->pool)) return CV_ERR_STATE;
    if (cv_kv_manager_reserve(m, q, q->blocks.n + n) != CV_OK) return CV_ERR_NOMEM;
    forget_kept(q);
    for (int64_t k = 0; k < n; k++) q->blocks.table[q->blocks.n++] = cv_block_pool_alloc(m->pool);
    return CV_OK;
}

void cv_kv_manager_free(cv_kv_manager *m, cv_sequence *q) {
    cv_seq_blocks *t = &q->blocks;
    for (int64_t j = t->n - 1; j >= 0; j--) cv_block_pool_decref(m->pool, t->table[j]);
    t->n = 0;
    t->n_cached = 0;
    t->last_key = root_key(q);
    t->n_kept = 0;
    t->kept_computed = 0;
    q->n_computed = 0;
    if (m->hits_for == q) m->hits_for = NULL;
    if (m->resume_for == q) m->resume_for = NULL;
}

void cv_kv_manager_preempt(cv_kv_manager *m, cv_sequence *q) {
    cv_seq_blocks *t = &q->blocks;
    int64_t keep = (q->n_computed + m->bs - 1) / m->bs;
    if (keep > t->n) keep = t->n;
    const int64_t computed = q->n_computed < keep * m->bs ? q->n_computed : keep * m->bs;
    /* tail first: the leading blocks, which a resume needs first, are evicted last */
    for (int64_t j = t->n - 1; j >= keep; j--) cv_block_pool_decref(m->pool, t->table[j]);
    for (int64_t j = keep - 1; j >= 0; j--) {
        t->gen[j] = cv_block_pool_generation(m->pool, t->table[j]);
        cv_block_pool_decref_keep(m->pool, t->table[j]);
    }
    t->n = 0;
    t->n_cached = 0;
    t->last_key = root_key(q);
    t->n_kept = keep;
    t->kept_computed = computed;
    q->n_computed = 0;
    if (m->hits_for == q) m->hits_for = NULL;
    if (m->resume_for == q) m->resume_for = NULL;
}

int64_t cv_kv_manager_lookup_resume(cv_kv_manager *m, const cv_sequence *q, int64_t *n_blocks,
                                    int64_t *n_free_hits) {
    const cv_seq_blocks *t = &q->blocks;
    int64_t limit = t->kept_computed < q->n_tokens - 1 ? t->kept_computed : q->n_tokens - 1;
    int64_t k = 0, free_own = 0;
    while (k * m->bs < limit && k < t->n_kept &&
           cv_block_pool_generation(m->pool, t->table[k]) == t->gen[k]) {
        if (cv_block_pool_refcount(m->pool, t->table[k]) == 0) free_own++;
        k++;
    }
    int64_t own = k * m->bs < limit ? k * m->bs : limit;
    /* a block another sequence holds is full and must stay as it is: never end inside one */
    if (own % m->bs && cv_block_pool_refcount(m->pool, t->table[own / m->bs]) > 0) own -= own % m->bs;
    if (own % m->bs == 0 && k > own / m->bs) { /* the last block is not taken */
        k = own / m->bs;
        free_own = 0;
        for (int64_t j = 0; j < k; j++) free_own += cv_block_pool_refcount(m->pool, t->table[j]) == 0;
    }
    int64_t cached_free = 0;
    const int64_t cached = t->n == 0 ? cv_kv_manager_lookup_prefix(m, q, &cached_free) : 0;
    m->resume_for = q;
    m->resume_own = cached * m->bs <= own;
    m->resume_tokens = m->resume_own ? own : cached * m->bs;
    m->resume_blocks = m->resume_own ? (own + m->bs - 1) / m->bs : cached;
    *n_blocks = m->resume_blocks;
    *n_free_hits = m->resume_own ? free_own : cached_free;
    return m->resume_tokens;
}

int cv_kv_manager_take_resume(cv_kv_manager *m, cv_sequence *q) {
    cv_seq_blocks *t = &q->blocks;
    if (m->resume_for != q || t->n != 0) { /* no lookup for q: nothing to take */
        forget_kept(q);
        return CV_OK;
    }
    const int64_t n = m->resume_blocks;
    if (cv_kv_manager_reserve(m, q, n > 0 ? n : 1) != CV_OK) return CV_ERR_NOMEM;
    if (m->resume_own) {
        for (int64_t j = 0; j < n; j++) cv_block_pool_incref(m->pool, t->table[j]);
    } else {
        for (int64_t j = 0; j < n; j++) {
            cv_block_pool_incref(m->pool, m->hits[j]);
            t->table[j] = m->hits[j];
        }
    }
    t->n = n;
    t->n_cached = 0;
    t->last_key = root_key(q);
    forget_kept(q);
    q->n_computed = m->resume_tokens;
    m->resume_for = NULL;
    m->hits_for = NULL;
    cv_kv_manager_cache_full(m, q); /* the keys of its full blocks, found again */
    return CV_OK;
}

int64_t cv_kv_manager_lookup_prefix(cv_kv_manager *m, const cv_sequence *q, int64_t *n_free_hits) {
    *n_free_hits = 0;
    m->n_hits = 0;
    m->hits_for = q;
    if (!m->enable_prefix_caching || q->skip_prefix_cache) return 0;
    int64_t max = (q->n_tokens - 1) / m->bs;
    if (max > m->max_hits) max = m->max_hits;
    uint64_t parent = root_key(q);
    int64_t n = 0;
    for (; n < max; n++) {
        int32_t b = cv_block_pool_lookup(m->pool, parent, q->tokens + n * m->bs);
        if (b < 0) break;
        m->hits[n] = b;
        if (cv_block_pool_refcount(m->pool, b) == 0) (*n_free_hits)++;
        parent = cv_block_pool_key(m->pool, b);
    }
    m->n_hits = n;
    return n;
}

int cv_kv_manager_take_prefix(cv_kv_manager *m, cv_sequence *q, int64_t n_hits) {
    if (!m->enable_prefix_caching) return CV_OK;
    if (m->hits_for != q || n_hits > m->n_hits || n_hits < 0) n_hits = 0; /* no lookup for q: nothing to take */
    if (cv_kv_manager_reserve(m, q, n_hits > 0 ? n_hits : 1) != CV_OK) return CV_ERR_NOMEM;
    cv_seq_blocks *t = &q->blocks;
    forget_kept(q);
    for (int64_t j = 0; j < n_hits; j++) {
        cv_block_pool_incref(m->pool, m->hits[j]);
        t->table[j] = m->hits[j];
    }
    t->n = n_hits;
    t->n_cached = n_hits;
    t->last_key = n_hits ? cv_block_pool_key(m->pool, m->hits[n_hits - 1]) : root_key(q);
    q->n_computed = n_hits * m->bs;
    m->prefix_queries += q->n_tokens;
    m->prefix_hits += n_hits * m->bs;
    if (q->n_preemptions == 0) /* first admission */
        q->n_cached_prompt = q->n_computed < q->n_prompt ? q->n_computed : q->n_prompt;
    m->hits_for = NULL;
    return CV_OK;
}

int cv_kv_manager_fork(cv_kv_manager *m, cv_sequence *child, const cv_sequence *parent) {
    /* only blocks the parent has computed */
    int64_t shared = (parent->n_prompt - 1) / m->bs;
    if (shared > parent->n_computed / m->bs) shared = parent->n_computed / m->bs;
    if (shared > parent->blocks.n) shared = parent->blocks.n;
    if (cv_kv_manager_reserve(m, child, shared > 0 ? shared : 1) != CV_OK) return CV_ERR_NOMEM;
    cv_seq_blocks *t = &child->blocks;
    for (int64_t j = 0; j < shared; j++) {
        cv_block_pool_incref(m->pool, parent->blocks.table[j]);
        t->table[j] = parent->blocks.table[j];
    }
    t->n = shared;
    t->n_cached = 0;
    t->last_key = root_key(child);
    child->n_computed = shared * m->bs;
    child->n_cached_prompt = child->n_computed;
    cv_kv_manager_cache_full(m, child); /* adopts the parent's keys */
    return CV_OK;
}

void cv_kv_manager_cache_full(cv_kv_manager *m, cv_sequence *q) {
    if (!m->enable_prefix_caching) return;
    cv_seq_blocks *t = &q->blocks;
    const int64_t verified = q->n_computed < q->n_tokens - q->n_spec ? q->n_computed : q->n_tokens - q->n_spec;
    while ((t->n_cached + 1) * m->bs <= verified && t->n_cached < t->n) {
        int64_t j = t->n_cached;
        const uint64_t parent = j == 0 ? root_key(q) : t->last_key;
        t->last_key = cv_block_pool_register(m->pool, t->table[j], parent, q->tokens + j * m->bs);
        t->n_cached++;
    }
}

void cv_kv_manager_trim(cv_kv_manager *m, cv_sequence *q, int64_t n_valid) {
    cv_seq_blocks *t = &q->blocks;
    if (q->n_computed > n_valid) q->n_computed = n_valid;
    if (q->n_computed > q->n_tokens) q->n_computed = q->n_tokens;
    const int64_t keep = (q->n_tokens + m->bs - 1) / m->bs;
    for (int64_t j = t->n - 1; j >= keep; j--) cv_block_pool_decref(m->pool, t->table[j]);
    if (t->n > keep) t->n = keep;
    cv_kv_manager_cache_full(m, q);
}

int64_t cv_kv_manager_empty_slots(const cv_kv_manager *m, const cv_sequence *q) {
    int64_t empty = 0;
    for (int64_t j = q->n_computed / m->bs; j < q->blocks.n; j++) {
        if (cv_block_pool_refcount(m->pool, q->blocks.table[j]) != 1) continue;
        int64_t filled = q->n_computed - j * m->bs;
        if (filled < 0) filled = 0;
        if (filled > m->bs) filled = m->bs;
        empty += m->bs - filled;
    }
    return empty;
}

/* ---- invariants (tests) ---- */

int cv_kv_manager_check_seq(const cv_kv_manager *m, const cv_sequence *q, cv_err *err) {
    const cv_seq_blocks *t = &q->blocks;
    if (t->n < 0 || t->n > t->cap || (t->n > 0 && !t->table))
        return cv_set_err(err, CV_ERR_STATE, "sequence %lld: n_blocks %lld, capacity %lld",
                          (long long)q->seq_id, (long long)t->n, (long long)t->cap);
    for (int64_t j = 0; j < t->n; j++) {
        int32_t b = t->table[j];
        if (b <= 0 || b >= m->num_blocks)
            return cv_set_err(err, CV_ERR_STATE, "sequence %lld holds invalid block %d (block 0 is reserved)",
                              (long long)q->seq_id, b);
    }
    if (t->n_kept < 0 || t->n_kept > t->cap || t->kept_computed < 0 || t->kept_computed > t->n_kept * m->bs ||
        (t->n_kept > 0 && t->n > 0))
        return cv_set_err(err, CV_ERR_STATE,
                          "sequence %lld: %lld kept blocks holding %lld tokens, %lld blocks held",
                          (long long)q->seq_id, (long long)t->n_kept, (long long)t->kept_computed,
                          (long long)t->n);
    if (t->n_cached < 0 || t->n_cached > t->n || t->n_cached * m->bs > q->n_computed)
        return cv_set_err(err, CV_ERR_STATE,
                          "sequence %lld: %lld hashed blocks of %lld but %lld tokens computed",
                          (long long)q->seq_id, (long long)t->n_cached, (long long)t->n,
                          (long long)q->n_computed);
    return CV_OK;
}

int cv_kv_manager_check(const cv_kv_manager *m, const cv_sequence *const *seqs, int64_t n, cv_err *err) {
    int rc = CV_OK;
    int32_t *refs = calloc((size_t)m->num_blocks, sizeof *refs);
    int64_t *stamp = calloc((size_t)m->num_blocks, sizeof *stamp); /* i + 1: seen in seqs[i]'s table */
    if (!refs || !stamp) {
        rc = cv_set_err(err, CV_ERR_NOMEM, "KV manager check: out of memory");
        goto done;
    }
    for (int64_t i = 0; i < n; i++) {
        const cv_sequence *q = seqs[i];
        if (!q) continue;
        if ((rc = cv_kv_manager_check_seq(m, q, err)) != CV_OK) goto done;
        for (int64_t j = 0; j < q->blocks.n; j++) {
            int32_t b = q->blocks.table[j];
            if (stamp[b] == i + 1) {
                rc = cv_set_err(err, CV_ERR_STATE, "sequence %lld holds block %d twice", (long long)q->seq_id, b);
                goto done;
            }
            stamp[b] = i + 1;
            refs[b]++;
        }
    }
    rc = cv_block_pool_check(m->pool, refs, err);
done:
    free(refs);
    free(stamp);
    return rc;
}
