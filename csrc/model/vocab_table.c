/* Vocabulary hash table: see vocab_table.h. */
#include "vocab_table.h"

#include <stdlib.h>
#include <string.h>

static size_t slot_of(uint64_t h, size_t mask) {
    h ^= h >> 33; /* murmur3's finalizer: the low bits of a polynomial hash are weak */
    h *= UINT64_C(0xff51afd7ed558ccd);
    h ^= h >> 33;
    h *= UINT64_C(0xc4ceb9fe1a85ec53);
    h ^= h >> 33;
    return (size_t)h & mask;
}

uint64_t cv_vocab_hash(const cv_vocab_table *t, const char *p, size_t len) {
    uint64_t h = 0, pw = 1;
    for (size_t i = 0; i < len; i++, pw *= t->base) h += (uint64_t)(unsigned char)p[i] * pw;
    return h;
}

void cv_vocab_hash_tokens(const cv_vocab_table *t, uint64_t *hash, uint64_t *power) {
    for (int64_t i = 0; i < t->n_tokens; i++) {
        const cv_token_text *tok = &t->tokens[i];
        uint64_t h = 0, pw = 1;
        for (size_t k = 0; k < tok->len; k++, pw *= t->base) h += (uint64_t)(unsigned char)tok->p[k] * pw;
        hash[i] = h;
        power[i] = pw;
    }
}

int32_t cv_vocab_find(const cv_vocab_table *t, uint64_t h, const char *p, size_t len) {
    for (size_t s = slot_of(h, t->mask);; s = (s + 1) & t->mask) {
        const cv_vocab_slot *e = &t->slots[s];
        if (e->id < 0) return -1;
        if (e->hash == h && e->len == len && !memcmp(t->tokens[e->id].p, p, len)) return e->id;
    }
}

int32_t cv_vocab_find2(const cv_vocab_table *t, uint64_t h, const char *a, size_t la, const char *b, size_t lb) {
    for (size_t s = slot_of(h, t->mask);; s = (s + 1) & t->mask) {
        const cv_vocab_slot *e = &t->slots[s];
        if (e->id < 0) return -1;
        if (e->hash == h && e->len == la + lb) {
            const char *q = t->tokens[e->id].p;
            if (!memcmp(q, a, la) && !memcmp(q + la, b, lb)) return e->id;
        }
    }
}

int cv_vocab_table_build(cv_vocab_table *t, const cv_token_text *tokens, int64_t n, uint64_t seed, cv_err *err) {
    memset(t, 0, sizeof *t);
    if (n < 0 || n > INT32_MAX)
        return cv_set_err(err, CV_ERR_FORMAT, "tokenizer: %lld tokens (at most %d)", (long long)n, INT32_MAX);
    size_t cap = 16;
    while (cap < 2 * (size_t)n) cap *= 2;
    t->slots = malloc(cap * sizeof *t->slots);
    if (!t->slots)
        return cv_set_err(err, CV_ERR_NOMEM, "tokenizer: out of memory for the vocabulary table of %lld tokens",
                          (long long)n);
    for (size_t s = 0; s < cap; s++) t->slots[s] = (cv_vocab_slot){0, -1, 0};
    t->mask = cap - 1;
    t->base = (seed * UINT64_C(0x9E3779B97F4A7C15)) | 1u;
    t->tokens = tokens;
    t->n_tokens = n;
    for (int64_t i = 0; i < n; i++) {
        if (tokens[i].len > UINT32_MAX) continue; /* longer than any text looked up */
        const uint64_t h = cv_vocab_hash(t, tokens[i].p, tokens[i].len);
        if (cv_vocab_find(t, h, tokens[i].p, tokens[i].len) >= 0) continue; /* the first id keeps the text */
        size_t s = slot_of(h, t->mask);
        while (t->slots[s].id >= 0) s = (s + 1) & t->mask;
        t->slots[s] = (cv_vocab_slot){h, (int32_t)i, (uint32_t)tokens[i].len};
    }
    return 0;
}

void cv_vocab_table_free(cv_vocab_table *t) {
    free(t->slots);
    memset(t, 0, sizeof *t);
}
