/* BPE merges from SentencePiece scores: see score_merges.h. */
#include "score_merges.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef struct scored {
    double score;
    int32_t id;
} scored;

/* best score first, then the lower id: the order the merges are applied in */
static int scored_order(const void *pa, const void *pb) {
    const scored *a = pa, *b = pb;
    if (a->score != b->score) return a->score > b->score ? -1 : 1;
    return (a->id > b->id) - (a->id < b->id);
}

typedef struct split {
    int32_t left, right;
} split;

/* Sorts one token's splits by left id (at most a few hundred: insertion sort). */
static void sort_splits(split *s, size_t n) {
    for (size_t i = 1; i < n; i++) {
        const split x = s[i];
        size_t j = i;
        for (; j > 0 && s[j - 1].left > x.left; j--) s[j] = s[j - 1];
        s[j] = x;
    }
}

static int is_continuation(unsigned char c) { return (c & 0xC0) == 0x80; }

static size_t count_chars(const char *p, size_t len) {
    size_t n = 0;
    for (size_t i = 0; i < len; i++) n += !is_continuation((unsigned char)p[i]);
    return n;
}

/* Appends token p[len]'s splits with both parts in the vocabulary to out
 * (sorted by left id); suffix is scratch [len + 1]. */
static int token_splits(cv_score_merges *out, int64_t *cap, const cv_vocab_table *table, const char *p, size_t len,
                        uint64_t *suffix, split *found, int64_t max_merges, cv_err *err) {
    const uint64_t base = table->base;
    size_t n = 0;
    suffix[len] = 0;
    for (size_t k = len; k-- > 0;) suffix[k] = (unsigned char)p[k] + base * suffix[k + 1];
    uint64_t prefix = (unsigned char)p[0], pw = base;
    for (size_t k = 1; k < len; prefix += (unsigned char)p[k] * pw, pw *= base, k++) {
        if (is_continuation((unsigned char)p[k])) continue;
        const int32_t left = cv_vocab_find(table, prefix, p, k);
        if (left < 0) continue;
        const int32_t right = cv_vocab_find(table, suffix[k], p + k, len - k);
        if (right >= 0) found[n++] = (split){left, right};
    }
    if (!n) return 0;
    if (out->n + (int64_t)n > max_merges)
        return cv_set_err(err, CV_ERR_FORMAT, "GGUF tokenizer: the scores give more than %lld merges",
                          (long long)max_merges);
    if (out->n + (int64_t)n > *cap) {
        int64_t grown = *cap ? 2 * *cap : 4096;
        if (grown < out->n + (int64_t)n) grown = out->n + (int64_t)n;
        if (grown > max_merges) grown = max_merges;
        int32_t *l = realloc(out->left, (size_t)grown * sizeof *l);
        if (l) out->left = l;
        int32_t *r = l ? realloc(out->right, (size_t)grown * sizeof *r) : NULL;
        if (r) out->right = r;
        if (!l || !r) return cv_set_err(err, CV_ERR_NOMEM, "GGUF tokenizer: out of memory for %lld merges", (long long)grown);
        *cap = grown;
    }
    sort_splits(found, n);
    for (size_t j = 0; j < n; j++) {
        out->left[out->n + (int64_t)j] = found[j].left;
        out->right[out->n + (int64_t)j] = found[j].right;
    }
    out->n += (int64_t)n;
    return 0;
}

int cv_score_merges_build(cv_score_merges *out, const cv_token_text *tokens, const double *scores,
                          const int32_t *types, int64_t n_tokens, int max_token_chars, int64_t max_merges,
                          uint64_t seed, cv_err *err) {
    memset(out, 0, sizeof *out);
    if (n_tokens < 0 || n_tokens > INT32_MAX)
        return cv_set_err(err, CV_ERR_FORMAT, "GGUF tokenizer: %lld tokens (at most %d)", (long long)n_tokens, INT32_MAX);
    if (max_token_chars < 2 || max_merges < 0)
        return cv_set_err(err, CV_ERR_INVALID, "score merges: max_token_chars %d must be >= 2 and max_merges %lld >= 0",
                          max_token_chars, (long long)max_merges);
    for (int64_t i = 0; i < n_tokens; i++)
        if (isnan(scores[i])) return cv_set_err(err, CV_ERR_FORMAT, "GGUF tokenizer: the score of token %lld is NaN", (long long)i);

    /* a valid token of max_token_chars characters has at most 4 bytes each */
    const size_t max_bytes = 4 * (size_t)max_token_chars;
    cv_vocab_table table = {0};
    int64_t cap = 0, n_split = 0;
    uint64_t *suffix = malloc((max_bytes + 1) * sizeof *suffix); /* hash of token[k:] [len + 1] */
    split *found = malloc(max_bytes * sizeof *found);             /* one token's splits [len - 1] */
    scored *order = malloc((n_tokens ? (size_t)n_tokens : 1) * sizeof *order); /* the tokens to split */
    int rc = suffix && found && order ? cv_vocab_table_build(&table, tokens, n_tokens, seed, err)
                                      : cv_set_err(err, CV_ERR_NOMEM, "GGUF tokenizer: out of memory");
    for (int64_t i = 0; rc == 0 && i < n_tokens; i++) {
        const int32_t type = types ? types[i] : CV_TOKEN_NORMAL;
        const size_t len = tokens[i].len;
        if ((type != CV_TOKEN_NORMAL && type != CV_TOKEN_USER) || len < 2 || len > max_bytes) continue;
        const size_t chars = count_chars(tokens[i].p, len);
        if (chars >= 2 && chars <= (size_t)max_token_chars) order[n_split++] = (scored){scores[i], (int32_t)i};
    }
    if (rc == 0) qsort(order, (size_t)n_split, sizeof *order, scored_order);
    for (int64_t j = 0; rc == 0 && j < n_split; j++) {
        const cv_token_text *t = &tokens[order[j].id];
        rc = token_splits(out, &cap, &table, t->p, t->len, suffix, found, max_merges, err);
    }
    if (rc < 0) cv_score_merges_free(out);
    free(order);
    free(found);
    free(suffix);
    cv_vocab_table_free(&table);
    return rc;
}
void cv_score_merges_free(cv_score_merges *m) {
    free(m->left);
    free(m->right);
    memset(m, 0, sizeof *m);
}
