/* llama2.c's encoder: see llama2c_bpe.h. */
#include "llama2c_bpe.h"

#include <stdlib.h>
#include <string.h>

struct cv_llama2c_bpe {
    cv_vocab_table table;
    cv_token_text *pieces; /* [n], into arena */
    char *arena;
    uint64_t *hash;  /* of each piece [n] */
    uint64_t *power; /* base^(piece's bytes) [n] */
    double *scores;  /* [n] */
    int64_t n;
};

void cv_llama2c_bpe_free(cv_llama2c_bpe *t) {
    if (!t) return;
    cv_vocab_table_free(&t->table);
    free(t->pieces);
    free(t->arena);
    free(t->hash);
    free(t->power);
    free(t->scores);
    free(t);
}

int cv_llama2c_bpe_create(cv_llama2c_bpe **out, const cv_token_text *pieces, const double *scores, int64_t n,
                          uint64_t seed, cv_err *err) {
    *out = NULL;
    if (n < 259 || n > INT32_MAX)
        return cv_set_err(err, CV_ERR_FORMAT, "llama2.c tokenizer: %lld tokens (259 to %d)", (long long)n,
                          INT32_MAX);
    cv_llama2c_bpe *t = calloc(1, sizeof *t);
    if (!t) return cv_set_err(err, CV_ERR_NOMEM, "llama2.c tokenizer: out of memory");
    size_t bytes = 0;
    for (int64_t i = 0; i < n; i++) {
        if (pieces[i].len > SIZE_MAX - bytes) {
            cv_llama2c_bpe_free(t);
            return cv_set_err(err, CV_ERR_FORMAT, "llama2.c tokenizer: the pieces are too long");
        }
        bytes += pieces[i].len;
    }
    const size_t m = (size_t)n;
    t->n = n;
    t->arena = malloc(bytes ? bytes : 1);
    t->pieces = malloc(m * sizeof *t->pieces);
    t->hash = malloc(m * sizeof *t->hash);
    t->power = malloc(m * sizeof *t->power);
    t->scores = malloc(m * sizeof *t->scores);
    if (!t->arena || !t->pieces || !t->hash || !t->power || !t->scores) {
        cv_llama2c_bpe_free(t);
        return cv_set_err(err, CV_ERR_NOMEM, "llama2.c tokenizer: out of memory for %lld tokens", (long long)n);
    }
    size_t at = 0;
    for (int64_t i = 0; i < n; i++) {
        if (pieces[i].len) memcpy(t->arena + at, pieces[i].p, pieces[i].len);
        t->pieces[i] = (cv_token_text){t->arena + at, pieces[i].len};
        at += pieces[i].len;
        t->scores[i] = scores[i];
    }
    int rc = cv_vocab_table_build(&t->table, t->pieces, n, seed, err);
    if (rc) {
        cv_llama2c_bpe_free(t);
        return rc;
    }
    cv_vocab_hash_tokens(&t->table, t->hash, t->power);
    *out = t;
    return 0;
}

/* The bytes of the character at p[0..len): a valid UTF-8 sequence, else 1. */
static size_t char_len(const unsigned char *p, size_t len) {
    const unsigned char c = p[0];
    size_t n;
    unsigned char lo = 0x80, hi = 0xBF; /* the range of the second byte */
    if (c < 0x80) return 1;
    if (c >= 0xC2 && c <= 0xDF) n = 2;
    else if (c >= 0xE0 && c <= 0xEF) {
        n = 3;
        if (c == 0xE0) lo = 0xA0;
        if (c == 0xED) hi = 0x9F; /* no surrogates */
    } else if (c >= 0xF0 && c <= 0xF4) {
        n = 4;
        if (c == 0xF0) lo = 0x90;
        if (c == 0xF4) hi = 0x8F;
    } else
        return 1;
    if (len < n || p[1] < lo || p[1] > hi) return 1;
    for (size_t k = 2; k < n; k++)
        if (p[k] < 0x80 || p[k] > 0xBF) return 1;
    return n;
}

/* A pair that may merge: ordered by best score, then leftmost (then the rest, so
 * that the order is total). */
typedef struct pair {
    double score;
    size_t i, j;
    int32_t ti, tj, m;
} pair;

static int before(const pair *a, const pair *b) {
    if (a->score != b->score) return a->score > b->score;
    if (a->i != b->i) return a->i < b->i;
    if (a->j != b->j) return a->j < b->j;
    if (a->ti != b->ti) return a->ti < b->ti;
    if (a->tj != b->tj) return a->tj < b->tj;
    return a->m < b->m;
}

typedef struct heap {
    pair *a;
    size_t n, cap;
} heap;

static void heap_push(heap *h, pair p) {
    size_t k = h->n++;
    while (k > 0) {
        size_t up = (k - 1) / 2;
        if (!before(&p, &h->a[up])) break;
        h->a[k] = h->a[up];
        k = up;
    }
    h->a[k] = p;
}

static pair heap_pop(heap *h) {
    pair top = h->a[0], last = h->a[--h->n];
    size_t k = 0;
    for (;;) {
        size_t c = 2 * k + 1;
        if (c >= h->n) break;
        if (c + 1 < h->n && before(&h->a[c + 1], &h->a[c])) c++;
        if (!before(&h->a[c], &last)) break;
        h->a[k] = h->a[c];
        k = c;
    }
    if (h->n) h->a[k] = last;
    return top;
}

typedef struct symbols {
    int32_t *tok;
    size_t *next, *prev; /* SIZE_MAX: none */
    unsigned char *alive;
} symbols;

static void push_pair(const cv_llama2c_bpe *t, const symbols *s, heap *h, size_t i) {
    if (i == SIZE_MAX || s->next[i] == SIZE_MAX) return;
    const size_t j = s->next[i];
    const int32_t a = s->tok[i], b = s->tok[j];
    const cv_token_text *pa = &t->pieces[a], *pb = &t->pieces[b];
    const uint64_t hh = t->hash[a] + t->power[a] * t->hash[b];
    const int32_t m = cv_vocab_find2(&t->table, hh, pa->p, pa->len, pb->p, pb->len);
    if (m < 0 || !(t->scores[m] > -1e10)) return;
    if (h->n == h->cap) return; /* cannot happen: cap bounds every push */
    heap_push(h, (pair){t->scores[m], i, j, a, b, m});
}

int cv_llama2c_bpe_encode(const cv_llama2c_bpe *t, const int32_t *lead, size_t n_lead, const unsigned char *data,
                          size_t len, int32_t **ids, size_t *n_ids, cv_err *err) {
    *ids = NULL;
    *n_ids = 0;
    for (size_t k = 0; k < n_lead; k++)
        if (lead[k] < 0 || lead[k] >= t->n)
            return cv_set_err(err, CV_ERR_INVALID, "llama2.c tokenizer: id %d is outside the vocabulary", lead[k]);
    /* every byte is at most one symbol; each merge pushes at most two pairs */
    if (n_lead > SIZE_MAX / 64 || len > (SIZE_MAX / 4 - n_lead) / (3 * sizeof(pair)))
        return cv_set_err(err, CV_ERR_INVALID, "llama2.c tokenizer: a text of %zu bytes is too long", len);
    const size_t cap = n_lead + len, heap_cap = 3 * cap + 1;
    symbols s = {malloc((cap ? cap : 1) * sizeof *s.tok), malloc((cap ? cap : 1) * sizeof *s.next),
                 malloc((cap ? cap : 1) * sizeof *s.prev), malloc(cap ? cap : 1)};
    heap h = {malloc(heap_cap * sizeof *h.a), 0, heap_cap};
    int32_t *out = NULL;
    int rc = 0;
    if (!s.tok || !s.next || !s.prev || !s.alive || !h.a) {
        rc = cv_set_err(err, CV_ERR_NOMEM, "llama2.c tokenizer: out of memory for a text of %zu bytes", len);
        goto done;
    }
    size_t n = 0;
    for (size_t k = 0; k < n_lead; k++) s.tok[n++] = lead[k];
    for (size_t i = 0; i < len;) {
        const size_t cl = char_len(data + i, len - i);
        const int32_t id = cv_vocab_find(&t->table, cv_vocab_hash(&t->table, (const char *)data + i, cl),
                                         (const char *)data + i, cl);
        if (id >= 0)
            s.tok[n++] = id;
        else
            for (size_t k = 0; k < cl; k++) s.tok[n++] = (int32_t)data[i + k] + 3;
        i += cl;
    }
    for (size_t i = 0; i < n; i++) {
        s.next[i] = i + 1 < n ? i + 1 : SIZE_MAX;
        s.prev[i] = i > 0 ? i - 1 : SIZE_MAX;
        s.alive[i] = 1;
    }
    for (size_t i = 0; i + 1 < n; i++) push_pair(t, &s, &h, i);
    while (h.n) {
        const pair p = heap_pop(&h);
        if (!s.alive[p.i] || s.next[p.i] != p.j || s.tok[p.i] != p.ti || s.tok[p.j] != p.tj)
            continue; /* stale: one side merged since this pair was queued */
        s.tok[p.i] = p.m;
        s.alive[p.j] = 0;
        s.next[p.i] = s.next[p.j];
        if (s.next[p.j] != SIZE_MAX) s.prev[s.next[p.j]] = p.i;
        push_pair(t, &s, &h, s.prev[p.i]);
        push_pair(t, &s, &h, p.i);
    }
    out = malloc((n ? n : 1) * sizeof *out);
    if (!out) {
        rc = cv_set_err(err, CV_ERR_NOMEM, "llama2.c tokenizer: out of memory for %zu ids", n);
        goto done;
    }
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        if (s.alive[i]) out[k++] = s.tok[i];
    *ids = out;
    *n_ids = k;
done:
    free(s.tok);
    free(s.next);
    free(s.prev);
    free(s.alive);
    free(h.a);
    return rc;
}
