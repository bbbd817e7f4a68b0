/* KV block pool: free queue, ref counts, prefix cache (see block_pool.h). */
#include "block_pool.h"

#include <stdlib.h>
#include <string.h>

#define NIL (-1)

struct cv_block_pool {
    int64_t num_blocks; /* including reserved block 0 */
    int64_t block_size;
    int caching;

    int32_t *ref;   /* [num_blocks] reference counts */
    int32_t *fprev; /* [num_blocks] free queue links, NIL at the ends */
    int32_t *fnext; /* [num_blocks] */
    int32_t head, tail;
    int64_t n_free;
    int64_t n_cached_free;
    uint8_t *touched;   /* [num_blocks] 1 once handed out: its KV memory has been written */
    uint64_t *gen;      /* [num_blocks] times handed out by alloc */
    int64_t n_touched;

    /* prefix cache (NULL when caching is off) */
    uint64_t *key;     /* [num_blocks] cache key, 0 = holds no cached prefix */
    uint64_t *parent;  /* [num_blocks] parent key the block was registered under */
    uint64_t *hash;    /* [num_blocks] bucket hash of (parent, tokens) */
    int32_t *tokens;   /* [num_blocks][block_size] tokens the block was registered with */
    int32_t *hnext;    /* [num_blocks] next block in the same bucket, 0 = end */
    int32_t *buckets;  /* [n_buckets] first block of each bucket, 0 = empty (block 0 is never cached) */
    uint64_t n_buckets; /* power of two */
    uint64_t next_key;
    int64_t n_cached;  /* blocks holding a key */
};

/* ---- hashing ---- */

static uint64_t mix64(uint64_t x) {
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    x ^= x >> 31;
    return x;
}

static uint64_t block_hash(uint64_t parent, const int32_t *tokens, int64_t n) {
    uint64_t h = mix64(parent + 0x9e3779b97f4a7c15ULL);
    for (int64_t i = 0; i < n; i++) {
        h ^= (uint32_t)tokens[i];
        h *= 0x9e3779b97f4a7c15ULL; /* odd multiplier: a bijection */
        h ^= h >> 29;
    }
    return mix64(h);
}

/* ---- life cycle ---- */

cv_block_pool *cv_block_pool_create(int64_t num_blocks, int64_t block_size,
                                    int enable_prefix_caching, cv_err *err) {
    cv_block_pool *p = NULL;
    if (num_blocks < 2 || num_blocks > INT32_MAX) {
        cv_set_err(err, CV_ERR_INVALID, "block pool: num_blocks must be in [2, %d], got %lld",
                   (int)INT32_MAX, (long long)num_blocks);
        goto fail;
    }
    if (block_size < 1 || block_size > INT32_MAX) {
        cv_set_err(err, CV_ERR_INVALID, "block pool: block_size must be >= 1, got %lld",
                   (long long)block_size);
        goto fail;
    }
    p = calloc(1, sizeof *p);
    if (!p) goto nomem;
    p->num_blocks = num_blocks;
    p->block_size = block_size;
    p->caching = enable_prefix_caching ? 1 : 0;
    size_t nb = (size_t)num_blocks;
    p->ref = calloc(nb, sizeof *p->ref);
    p->fprev = malloc(nb * sizeof *p->fprev);
    p->fnext = malloc(nb * sizeof *p->fnext);
    p->touched = calloc(nb, 1);
    p->gen = calloc(nb, sizeof *p->gen);
    if (!p->ref || !p->fprev || !p->fnext || !p->touched || !p->gen) goto nomem;
    if (p->caching) {
        size_t ntok;
        if (!cv_mul_size(nb, (size_t)block_size, &ntok) || !cv_mul_size(ntok, sizeof(int32_t), &ntok))
            goto nomem;
        uint64_t nbk = 16;
        while (nbk < 2 * (uint64_t)num_blocks) nbk <<= 1;
        p->n_buckets = nbk;
        p->key = calloc(nb, sizeof *p->key);
        p->parent = calloc(nb, sizeof *p->parent);
        p->hash = calloc(nb, sizeof *p->hash);
        p->tokens = malloc(ntok);
        p->hnext = calloc(nb, sizeof *p->hnext);
        p->buckets = calloc((size_t)nbk, sizeof *p->buckets);
        if (!p->key || !p->parent || !p->hash || !p->tokens || !p->hnext || !p->buckets) goto nomem;
        p->next_key = 1;
    }
    /* Block 0 reserved: outside the queue. Blocks 1..n-1 free in order. */
    p->fprev[0] = p->fnext[0] = NIL;
    for (int64_t b = 1; b < num_blocks; b++) {
        p->fprev[b] = b > 1 ? (int32_t)(b - 1) : NIL;
        p->fnext[b] = b + 1 < num_blocks ? (int32_t)(b + 1) : NIL;
    }
    p->head = 1;
    p->tail = (int32_t)(num_blocks - 1);
    p->n_free = num_blocks - 1;
    return p;
nomem:
    cv_set_err(err, CV_ERR_NOMEM, "block pool: out of memory for %lld blocks of %lld tokens",
               (long long)num_blocks, (long long)block_size);
fail:
    cv_block_pool_destroy(p);
    return NULL;
}

void cv_block_pool_destroy(cv_block_pool *p) {
    if (!p) return;
    free(p->ref);
    free(p->fprev);
    free(p->fnext);
    free(p->touched);
    free(p->gen);
    free(p->key);
    free(p->parent);
    free(p->hash);
    free(p->tokens);
    free(p->hnext);
    free(p->buckets);
    free(p);
}

int64_t cv_block_pool_num_free(const cv_block_pool *p) { return p->n_free; }
int64_t cv_block_pool_num_cached_free(const cv_block_pool *p) { return p->n_cached_free; }
int64_t cv_block_pool_num_touched(const cv_block_pool *p) { return p->n_touched; }

/* ---- free queue ---- */

static void queue_unlink(cv_block_pool *p, int32_t b) {
    int32_t pr = p->fprev[b], nx = p->fnext[b];
    if (pr != NIL) p->fnext[pr] = nx; else p->head = nx;
    if (nx != NIL) p->fprev[nx] = pr; else p->tail = pr;
    p->fprev[b] = p->fnext[b] = NIL;
}

static void queue_push_tail(cv_block_pool *p, int32_t b) {
    p->fprev[b] = p->tail;
    p->fnext[b] = NIL;
    if (p->tail != NIL) p->fnext[p->tail] = b; else p->head = b;
    p->tail = b;
}

static void queue_push_head(cv_block_pool *p, int32_t b) {
    p->fprev[b] = NIL;
    p->fnext[b] = p->head;
    if (p->head != NIL) p->fprev[p->head] = b; else p->tail = b;
    p->head = b;
}

/* ---- hash table ---- */

static const int32_t *block_tokens(const cv_block_pool *p, int32_t b) {
    return p->tokens + (size_t)b * (size_t)p->block_size;
}

static void table_remove(cv_block_pool *p, int32_t b) {
    int32_t *link = &p->buckets[p->hash[b] & (p->n_buckets - 1)];
    while (*link && *link != b) link = &p->hnext[*link];
    if (*link == b) *link = p->hnext[b];
    p->hnext[b] = 0;
    p->key[b] = 0;
    p->n_cached--;
}

int32_t cv_block_pool_lookup(const cv_block_pool *p, uint64_t parent_key, const int32_t *tokens) {
    if (!p->caching) return -1;
    uint64_t h = block_hash(parent_key, tokens, p->block_size);
    size_t bytes = (size_t)p->block_size * sizeof *tokens;
    for (int32_t b = p->buckets[h & (p->n_buckets - 1)]; b; b = p->hnext[b]) {
        /* exact compare: the hash only picks the bucket */
        if (p->hash[b] == h && p->parent[b] == parent_key && memcmp(block_tokens(p, b), tokens, bytes) == 0)
            return b;
    }
    return -1;
}

uint64_t cv_block_pool_key(const cv_block_pool *p, int32_t b) {
    return p->caching ? p->key[b] : 0;
}

uint64_t cv_block_pool_register(cv_block_pool *p, int32_t b, uint64_t parent_key,
                                const int32_t *tokens) {
    if (!p->caching) return 0;
    if (p->key[b]) return p->key[b];
    int32_t other = cv_block_pool_lookup(p, parent_key, tokens);
    if (other >= 0) return p->key[other]; /* same content cached already: keep one copy */
    uint64_t h = block_hash(parent_key, tokens, p->block_size);
    p->key[b] = p->next_key++;
    p->parent[b] = parent_key;
    p->hash[b] = h;
    memcpy(p->tokens + (size_t)b * (size_t)p->block_size, tokens,
           (size_t)p->block_size * sizeof *tokens);
    int32_t *bucket = &p->buckets[h & (p->n_buckets - 1)];
    p->hnext[b] = *bucket;
    *bucket = b;
    p->n_cached++;
    return p->key[b];
}

/* ---- alloc / ref counts ---- */

int32_t cv_block_pool_alloc(cv_block_pool *p) {
    int32_t b = p->head;
    if (b == NIL) return -1;
    queue_unlink(p, b);
    p->n_free--;
    if (p->caching && p->key[b]) { /* evict the least recently freed cached prefix */
        table_remove(p, b);
        p->n_cached_free--;
    }
    p->ref[b] = 1;
    p->gen[b]++;
    if (!p->touched[b]) {
        p->touched[b] = 1;
        p->n_touched++;
    }
    return b;
}

void cv_block_pool_incref(cv_block_pool *p, int32_t b) {
    if (p->ref[b] == 0) { /* a cache hit on a free block: out of the middle of the queue */
        queue_unlink(p, b);
        p->n_free--;
        if (p->caching && p->key[b]) p->n_cached_free--;
    }
    p->ref[b]++;
}

void cv_block_pool_decref(cv_block_pool *p, int32_t b) {
    if (p->ref[b] <= 0) return; /* never below zero; check() reports mismatches */
    if (--p->ref[b] > 0) return;
    if (p->caching && p->key[b]) {
        queue_push_tail(p, b); /* stays reusable until it reaches the head */
        p->n_cached_free++;
    } else {
        queue_push_head(p, b); /* holds nothing worth keeping: reuse first */
    }
    p->n_free++;
}

void cv_block_pool_decref_keep(cv_block_pool *p, int32_t b) {
    if (p->ref[b] <= 0) return;
    if (--p->ref[b] > 0) return;
    queue_push_tail(p, b);
    if (p->caching && p->key[b]) p->n_cached_free++;
    p->n_free++;
}

uint64_t cv_block_pool_generation(const cv_block_pool *p, int32_t b) { return p->gen[b]; }

int32_t cv_block_pool_refcount(const cv_block_pool *p, int32_t b) {
    if (b < 0 || b >= p->num_blocks) return -1;
    return p->ref[b];
}

/* ---- invariants ---- */

int cv_block_pool_check(const cv_block_pool *p, const int32_t *expected_refs, cv_err *err) {
    int rc = CV_OK;
    uint8_t *in_queue = calloc((size_t)p->num_blocks, 1);
    if (!in_queue) return cv_set_err(err, CV_ERR_NOMEM, "block pool check: out of memory");

    if (p->ref[0] != 0 || (p->caching && p->key[0])) {
        rc = cv_set_err(err, CV_ERR_STATE, "block 0 is reserved but has ref %d", p->ref[0]);
        goto done;
    }
    /* free queue: walk forward with a bound (catches cycles), check back links */
    int64_t n = 0, n_cached_free = 0;
    int32_t prev = NIL;
    for (int32_t b = p->head; b != NIL; b = p->fnext[b]) {
        if (b <= 0 || b >= p->num_blocks) {
            rc = cv_set_err(err, CV_ERR_STATE, "free queue holds invalid block %d", b);
            goto done;
        }
        if (in_queue[b]) {
            rc = cv_set_err(err, CV_ERR_STATE, "free queue has a cycle at block %d", b);
            goto done;
        }
        in_queue[b] = 1;
        if (p->fprev[b] != prev) {
            rc = cv_set_err(err, CV_ERR_STATE, "free queue: block %d prev %d, expected %d", b,
                            p->fprev[b], prev);
            goto done;
        }
        if (p->caching && p->key[b]) n_cached_free++;
        prev = b;
        n++;
    }
    if (p->tail != prev) {
        rc = cv_set_err(err, CV_ERR_STATE, "free queue tail %d, last walked %d", p->tail, prev);
        goto done;
    }
    if (n != p->n_free) {
        rc = cv_set_err(err, CV_ERR_STATE, "free queue length %lld != free count %lld",
                        (long long)n, (long long)p->n_free);
        goto done;
    }
    if (n_cached_free != p->n_cached_free) {
        rc = cv_set_err(err, CV_ERR_STATE, "cached free blocks %lld != counter %lld",
                        (long long)n_cached_free, (long long)p->n_cached_free);
        goto done;
    }
    for (int64_t b = 1; b < p->num_blocks; b++) {
        if (p->ref[b] < 0 || (p->ref[b] == 0) != ((in_queue[b] & 1) != 0)) {
            rc = cv_set_err(err, CV_ERR_STATE, "block %lld: ref %d but %s the free queue",
                            (long long)b, p->ref[b], (in_queue[b] & 1) ? "in" : "not in");
            goto done;
        }
        if (expected_refs && p->ref[b] != expected_refs[b]) {
            rc = cv_set_err(err, CV_ERR_STATE, "block %lld: ref count %d but %d block tables hold it",
                            (long long)b, p->ref[b], expected_refs[b]);
            goto done;
        }
    }
    if (p->caching) {
        int64_t entries = 0;
        for (uint64_t k = 0; k < p->n_buckets; k++) {
            for (int32_t b = p->buckets[k]; b; b = p->hnext[b]) {
                if (b <= 0 || b >= p->num_blocks || entries > p->num_blocks) {
                    rc = cv_set_err(err, CV_ERR_STATE, "hash table: bad chain in bucket %llu",
                                    (unsigned long long)k);
                    goto done;
                }
                uint64_t h = block_hash(p->parent[b], block_tokens(p, b), p->block_size);
                if (!p->key[b] || p->hash[b] != h || (h & (p->n_buckets - 1)) != k) {
                    rc = cv_set_err(err, CV_ERR_STATE,
                                    "hash table: block %d in bucket %llu does not hold that hash",
                                    b, (unsigned long long)k);
                    goto done;
                }
                if (in_queue[b] & 2) {
                    rc = cv_set_err(err, CV_ERR_STATE, "hash table: block %d listed twice", b);
                    goto done;
                }
                in_queue[b] |= 2;
                if (p->parent[b] >= p->key[b]) { /* a parent is always registered first */
                    rc = cv_set_err(err, CV_ERR_STATE, "hash table: block %d key %llu parent %llu",
                                    b, (unsigned long long)p->key[b], (unsigned long long)p->parent[b]);
                    goto done;
                }
                entries++;
            }
        }
        if (entries != p->n_cached) {
            rc = cv_set_err(err, CV_ERR_STATE, "hash table holds %lld entries, %lld blocks have keys",
                            (long long)entries, (long long)p->n_cached);
            goto done;
        }
        int64_t keyed = 0;
        for (int64_t b = 0; b < p->num_blocks; b++) keyed += p->key[b] != 0;
        if (keyed != p->n_cached) {
            rc = cv_set_err(err, CV_ERR_STATE, "%lld blocks have keys, table counts %lld",
                            (long long)keyed, (long long)p->n_cached);
            goto done;
        }
    }
done:
    free(in_queue);
    return rc;
}
