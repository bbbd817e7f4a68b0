/* A hash table over a tokenizer's vocabulary: token text -> first id.
 *
 * Texts are hashed with a polynomial hash h(s) = sum s[i] * base^i (mod 2^64),
 * so the hash of every prefix and suffix of a token, and of two tokens joined,
 * follows from its parts in O(1). The base is odd and drawn from the caller's
 * seed (crafted files cannot aim at it); equal hashes are always confirmed by
 * comparing bytes. Two slots per token. */
#ifndef CV_MODEL_VOCAB_TABLE_H
#define CV_MODEL_VOCAB_TABLE_H

#include <stddef.h>
#include <stdint.h>
#include "../../base/common.h"

/* tokenizer.ggml.token_type values */
enum { CV_TOKEN_NORMAL = 1, CV_TOKEN_UNKNOWN = 2, CV_TOKEN_CONTROL = 3, CV_TOKEN_USER = 4,
       CV_TOKEN_UNUSED = 5, CV_TOKEN_BYTE = 6 };

typedef struct cv_token_text {
    const char *p; /* UTF-8, not NUL-terminated [len] */
    size_t len;
} cv_token_text;

typedef struct cv_vocab_slot {
    uint64_t hash;
    int32_t id;   /* -1 when empty */
    uint32_t len; /* the token's bytes (checked before its text is read) */
} cv_vocab_slot;

typedef struct cv_vocab_table {
    cv_vocab_slot *slots;        /* [mask + 1] */
    size_t mask;                 /* slots - 1 (a power of two) */
    uint64_t base;               /* the hash's base (odd) */
    const cv_token_text *tokens; /* not owned [n_tokens] */
    int64_t n_tokens;
} cv_vocab_table;

/* Builds the table over tokens [n] (which must outlive it); a text held by
 * several ids maps to the first. CV_ERR_NOMEM when out of memory. */
int cv_vocab_table_build(cv_vocab_table *t, const cv_token_text *tokens, int64_t n, uint64_t seed, cv_err *err);
void cv_vocab_table_free(cv_vocab_table *t);

uint64_t cv_vocab_hash(const cv_vocab_table *t, const char *p, size_t len);
/* Each of the table's tokens' hash and base^(its length), into hash[n_tokens]
 * and power[n_tokens]: token a followed by token b hashes to
 * hash[a] + power[a] * hash[b]. */
void cv_vocab_hash_tokens(const cv_vocab_table *t, uint64_t *hash, uint64_t *power);
/* The first id of the text p[len] whose hash is h, or -1. */
int32_t cv_vocab_find(const cv_vocab_table *t, uint64_t h, const char *p, size_t len);
/* The first id of a[la] followed by b[lb] (hash h), or -1. */
int32_t cv_vocab_find2(const cv_vocab_table *t, uint64_t h, const char *a, size_t la, const char *b, size_t lb);

#endif
