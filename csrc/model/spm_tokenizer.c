/* SentencePiece-style encoding from a GGUF vocabulary's tables: see spm_tokenizer.h. */
#include "spm_tokenizer.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* A byte trie of the tokens cut out of the raw text. */
typedef struct trie_edge {
    uint64_t key;  /* parent node * 256 + byte + 1; 0 when empty */
    int32_t child;
} trie_edge;

typedef struct trie {
    int32_t *match;   /* the first id of the token ending at each node, or -1 [n_nodes] */
    int64_t n_nodes;
    trie_edge *edges; /* open addressing [edge_mask + 1] */
    size_t edge_mask;
} trie;

struct cv_spm_tokenizer {
    char *arena;            /* every token's bytes, in id order */
    cv_token_text *tokens;  /* views into arena [n] */
    int64_t n;
    cv_vocab_table table;
    uint64_t *hash;         /* hash of each token's text [n] */
    uint64_t *power;        /* base^(token's bytes) [n] */
    double *scores;         /* [n] */
    int32_t *rank_id;       /* for a first id t: the id whose score ranks the merges into t, or -1 when no
                               merge gives t [n] */
    int32_t byte_id[256];   /* the <0xNN> token of each byte, or -1 */
    int32_t unk;            /* first id of the unknown token, or -1 */
    int prefix;             /* add "▁" in front of each piece */
    trie cut;
};

static size_t mix(uint64_t k) {
    k ^= k >> 31;
    k *= UINT64_C(0x9E3779B97F4A7C15);
    k ^= k >> 29;
    return (size_t)k;
}

static int32_t trie_child(const trie *t, int32_t node, unsigned char b) {
    const uint64_t key = (uint64_t)node * 256 + b + 1;
    for (size_t s = mix(key) & t->edge_mask;; s = (s + 1) & t->edge_mask) {
        if (t->edges[s].key == key) return t->edges[s].child;
        if (!t->edges[s].key) return -1;
    }
}

static int trie_build(trie *t, const cv_spm_tokenizer *v, const int32_t *types, cv_err *err) {
    size_t total = 0;
    for (int64_t i = 0; i < v->n; i++)
        if (types && (types[i] == CV_TOKEN_UNKNOWN || types[i] == CV_TOKEN_CONTROL || types[i] == CV_TOKEN_USER)) {
            if (v->tokens[i].len > CV_SPM_MAX_CUT_BYTES)
                return cv_set_err(err, CV_ERR_FORMAT,
                                  "GGUF tokenizer: token %lld (type %d, matched whole in the text) is %zu bytes long; "
                                  "such tokens may have at most %d",
                                  (long long)i, (int)types[i], v->tokens[i].len, CV_SPM_MAX_CUT_BYTES);
            total += v->tokens[i].len;
        }
    size_t cap = 16;
    while (cap < 2 * total) cap *= 2;
    t->match = malloc((total + 1) * sizeof *t->match);
    t->edges = calloc(cap, sizeof *t->edges);
    if (!t->match || !t->edges)
        return cv_set_err(err, CV_ERR_NOMEM, "tokenizer: out of memory for the %zu bytes of its special tokens", total);
    t->edge_mask = cap - 1;
    t->n_nodes = 1;
    t->match[0] = -1;
    for (int64_t i = 0; types && i < v->n; i++) {
        if (types[i] != CV_TOKEN_UNKNOWN && types[i] != CV_TOKEN_CONTROL && types[i] != CV_TOKEN_USER) continue;
        const cv_token_text *tok = &v->tokens[i];
        if (!tok->len) continue; /* an empty token matches nothing */
        int32_t node = 0;
        for (size_t k = 0; k < tok->len; k++) {
            const unsigned char b = (unsigned char)tok->p[k];
            int32_t next = trie_child(t, node, b);
            if (next < 0) {
                next = (int32_t)t->n_nodes++;
                t->match[next] = -1;
                const uint64_t key = (uint64_t)node * 256 + b + 1;
                size_t s = mix(key) & t->edge_mask;
                while (t->edges[s].key) s = (s + 1) & t->edge_mask;
                t->edges[s] = (trie_edge){key, next};
            }
            node = next;
        }
        if (t->match[node] < 0) t->match[node] = cv_vocab_find(&v->table, v->hash[i], tok->p, tok->len);
    }
    return 0;
}

static size_t count_chars(const char *p, size_t len) {
    size_t n = 0;
    for (size_t i = 0; i < len; i++) n += ((unsigned char)p[i] & 0xC0) != 0x80;
    return n;
}

int cv_spm_create(cv_spm_tokenizer **out, const cv_token_text *tokens, const double *scores, const int32_t *types,
                  int64_t n, int max_token_chars, int32_t unk_id, int add_space_prefix, uint64_t seed, cv_err *err) {
    *out = NULL;
    if (n < 0 || n > INT32_MAX)
        return cv_set_err(err, CV_ERR_FORMAT, "tokenizer: %lld tokens (at most %d)", (long long)n, INT32_MAX);
    for (int64_t i = 0; i < n; i++)
        if (isnan(scores[i])) return cv_set_err(err, CV_ERR_FORMAT, "GGUF tokenizer: the score of token %lld is NaN", (long long)i);
    cv_spm_tokenizer *v = calloc(1, sizeof *v);
    if (!v) return cv_set_err(err, CV_ERR_NOMEM, "tokenizer: out of memory");
    const size_t m = n ? (size_t)n : 1;
    size_t bytes = 0;
    for (int64_t i = 0; i < n; i++) bytes += tokens[i].len;
    v->n = n;
    v->prefix = add_space_prefix != 0;
    v->arena = malloc(bytes ? bytes : 1);
    v->tokens = calloc(m, sizeof *v->tokens);
    v->hash = malloc(m * sizeof *v->hash);
    v->power = malloc(m * sizeof *v->power);
    v->scores = malloc(m * sizeof *v->scores);
    v->rank_id = malloc(m * sizeof *v->rank_id);
    int rc = 0;
    if (!v->arena || !v->tokens || !v->hash || !v->power || !v->scores || !v->rank_id) {
        rc = cv_set_err(err, CV_ERR_NOMEM, "tokenizer: out of memory for %lld tokens", (long long)n);
        goto done;
    }
    size_t at = 0;
    for (int64_t i = 0; i < n; i++) {
        if (tokens[i].len) memcpy(v->arena + at, tokens[i].p, tokens[i].len);
        v->tokens[i] = (cv_token_text){v->arena + at, tokens[i].len};
        at += tokens[i].len;
        v->scores[i] = scores[i];
        v->rank_id[i] = -1;
    }
    rc = cv_vocab_table_build(&v->table, v->tokens, n, seed, err);
    if (rc < 0) goto done;
    cv_vocab_hash_tokens(&v->table, v->hash, v->power);
    /* the merges into a text rank by the last of its ids in merge-list order: the worst score, then the highest id */
    for (int64_t i = 0; i < n; i++) {
        const int32_t type = types ? types[i] : CV_TOKEN_NORMAL;
        const size_t len = v->tokens[i].len;
        if (type != CV_TOKEN_NORMAL && type != CV_TOKEN_USER) continue;
        const size_t chars = count_chars(v->tokens[i].p, len);
        if (chars < 2 || chars > (size_t)max_token_chars) continue;
        const int32_t first = cv_vocab_find(&v->table, v->hash[i], v->tokens[i].p, len);
        if (first < 0) continue; /* longer than the table holds */
        const int32_t cur = v->rank_id[first];
        if (cur < 0 || scores[i] <= scores[cur]) v->rank_id[first] = (int32_t)i;
    }
    for (int b = 0; b < 256; b++) {
        char name[8];
        snprintf(name, sizeof name, "<0x%02X>", b);
        v->byte_id[b] = cv_vocab_find(&v->table, cv_vocab_hash(&v->table, name, 6), name, 6);
    }
    v->unk = unk_id >= 0 && unk_id < n ? cv_vocab_find(&v->table, v->hash[unk_id], v->tokens[unk_id].p, v->tokens[unk_id].len) : -1;
    rc = trie_build(&v->cut, v, types, err);
done:
    if (rc < 0) cv_spm_free(v);
    else *out = v;
    return rc;
}

void cv_spm_free(cv_spm_tokenizer *v) {
    if (!v) return;
    free(v->arena);
    free(v->tokens);
    free(v->hash);
    free(v->power);
    free(v->scores);
    free(v->rank_id);
    cv_vocab_table_free(&v->table);
    free(v->cut.match);
    free(v->cut.edges);
    free(v);
}

/* ------------------------------------------------------------------ encoding */

typedef struct candidate {
    double score;              /* of the token ranking the merge */
    int32_t rank_id, left, right;
    int32_t pos;               /* the left symbol */
    int32_t joined;            /* the merged symbol's id */
} candidate;

/* 1 when a should merge before b */
static int before(const candidate *a, const candidate *b) {
    if (a->score != b->score) return a->score > b->score;
    if (a->rank_id != b->rank_id) return a->rank_id < b->rank_id;
    if (a->left != b->left) return a->left < b->left;
    if (a->right != b->right) return a->right < b->right;
    return a->pos < b->pos;
}

typedef struct heap {
    candidate *items; /* [cap] */
    size_t n, cap;
} heap;

static int heap_push(heap *h, candidate c, cv_err *err) {
    if (h->n == h->cap) {
        const size_t cap = h->cap ? 2 * h->cap : 64;
        candidate *grown = realloc(h->items, cap * sizeof *grown);
        if (!grown) return cv_set_err(err, CV_ERR_NOMEM, "tokenizer: out of memory for %zu merge candidates", cap);
        h->items = grown;
        h->cap = cap;
    }
    size_t i = h->n++;
    while (i > 0 && before(&c, &h->items[(i - 1) / 2])) {
        h->items[i] = h->items[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    h->items[i] = c;
    return 0;
}

static candidate heap_pop(heap *h) {
    const candidate top = h->items[0], last = h->items[--h->n];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= h->n) break;
        if (c + 1 < h->n && before(&h->items[c + 1], &h->items[c])) c++;
        if (!before(&h->items[c], &last)) break;
        h->items[i] = h->items[c];
        i = c;
    }
    if (h->n) h->items[i] = last;
    return top;
}

/* The merge of symbols a, b into *out (pos left unset); 0 when their joined text is not a merge. */
static int pair_merge(const cv_spm_tokenizer *v, int32_t a, int32_t b, candidate *out) {
    const uint64_t h = v->hash[a] + v->power[a] * v->hash[b];
    const int32_t t = cv_vocab_find2(&v->table, h, v->tokens[a].p, v->tokens[a].len, v->tokens[b].p, v->tokens[b].len);
    if (t < 0 || v->rank_id[t] < 0) return 0;
    *out = (candidate){v->scores[v->rank_id[t]], v->rank_id[t], a, b, -1, t};
    return 1;
}

typedef struct symbols {
    int32_t *id, *prev, *next; /* [cap] */
    size_t *len;               /* bytes covered; 0 once merged into its left neighbour [cap] */
    size_t n;
} symbols;

static void add_symbol(symbols *s, int32_t id, size_t len) {
    const size_t i = s->n++;
    s->id[i] = id;
    s->len[i] = len;
    s->prev[i] = (int32_t)i - 1;
    s->next[i] = -1;
    if (i) s->next[i - 1] = (int32_t)i;
}

static size_t char_len(const unsigned char *p, size_t left) {
    const size_t n = p[0] < 0x80 ? 1 : p[0] >= 0xF0 ? 4 : p[0] >= 0xE0 ? 3 : p[0] >= 0xC0 ? 2 : 1;
    return n <= left ? n : 1;
}

typedef struct output {
    int32_t *ids;
    size_t n, cap;
} output;

static int emit(output *o, int32_t id, cv_err *err) {
    if (o->n == o->cap) {
        const size_t cap = o->cap ? 2 * o->cap : 64;
        int32_t *grown = realloc(o->ids, cap * sizeof *grown);
        if (!grown) return cv_set_err(err, CV_ERR_NOMEM, "tokenizer: out of memory for %zu ids", cap);
        o->ids = grown;
        o->cap = cap;
    }
    o->ids[o->n++] = id;
    return 0;
}

/* Steps 2-4 of the header for one piece of text (not empty). */
static int encode_piece(const cv_spm_tokenizer *v, const char *text, size_t len, output *o, cv_err *err) {
    static const char meta[3] = {'\xE2', '\x96', '\x81'}; /* "▁" */
    size_t spaces = 0;
    for (size_t i = 0; i < len; i++) spaces += text[i] == ' ';
    const size_t norm_len = len + 2 * spaces + (v->prefix ? 3 : 0);
    if (norm_len > INT32_MAX)
        return cv_set_err(err, CV_ERR_INVALID, "tokenizer: a text of %zu bytes is too long to encode (at most %d)",
                          len, INT32_MAX / 3);
    char *norm = malloc(norm_len);
    symbols s = {0};
    s.id = malloc(norm_len * sizeof *s.id);
    s.prev = malloc(norm_len * sizeof *s.prev);
    s.next = malloc(norm_len * sizeof *s.next);
    s.len = malloc(norm_len * sizeof *s.len);
    heap h = {0};
    int rc = 0;
    if (!norm || !s.id || !s.prev || !s.next || !s.len) {
        rc = cv_set_err(err, CV_ERR_NOMEM, "tokenizer: out of memory for a text of %zu bytes", len);
        goto done;
    }
    size_t at = 0;
    if (v->prefix) {
        memcpy(norm, meta, 3);
        at = 3;
    }
    for (size_t i = 0; i < len; i++) {
        if (text[i] == ' ') {
            memcpy(norm + at, meta, 3);
            at += 3;
        } else {
            norm[at++] = text[i];
        }
    }
    /* characters to symbols: the token, else the byte tokens, else the unknown token (a run fused) */
    int32_t unk_pending = 0;
    size_t unk_len = 0;
    for (size_t i = 0; i < norm_len;) {
        const size_t cl = char_len((const unsigned char *)norm + i, norm_len - i);
        const int32_t id = cv_vocab_find(&v->table, cv_vocab_hash(&v->table, norm + i, cl), norm + i, cl);
        if (id >= 0) {
            if (unk_pending) add_symbol(&s, v->unk, unk_len);
            unk_pending = 0;
            add_symbol(&s, id, cl);
        } else {
            int all = 1;
            for (size_t k = 0; k < cl; k++) all &= v->byte_id[(unsigned char)norm[i + k]] >= 0;
            if (all) {
                for (size_t k = 0; k < cl; k++) add_symbol(&s, v->byte_id[(unsigned char)norm[i + k]], 1);
            } else if (v->unk >= 0) {
                unk_len = unk_pending ? unk_len + cl : cl;
                unk_pending = 1;
            }
        }
        i += cl;
    }
    if (unk_pending) add_symbol(&s, v->unk, unk_len);

    candidate c;
    for (size_t i = 0; rc == 0 && i + 1 < s.n; i++)
        if (pair_merge(v, s.id[i], s.id[i + 1], &c)) {
            c.pos = (int32_t)i;
            rc = heap_push(&h, c, err);
        }
    while (rc == 0 && h.n) {
        const candidate top = heap_pop(&h);
        const int32_t pos = top.pos, right = s.next[pos];
        if (!s.len[pos] || right < 0) continue;
        if (!pair_merge(v, s.id[pos], s.id[right], &c) || c.joined != top.joined) continue; /* stale */
        s.id[pos] = top.joined;
        s.len[pos] += s.len[right];
        s.len[right] = 0;
        s.next[pos] = s.next[right];
        if (s.next[pos] >= 0) s.prev[s.next[pos]] = pos;
        if (s.prev[pos] >= 0 && pair_merge(v, s.id[s.prev[pos]], s.id[pos], &c)) {
            c.pos = s.prev[pos];
            rc = heap_push(&h, c, err);
        }
        if (rc == 0 && s.next[pos] >= 0 && pair_merge(v, s.id[pos], s.id[s.next[pos]], &c)) {
            c.pos = pos;
            rc = heap_push(&h, c, err);
        }
    }
    for (size_t i = 0; rc == 0 && i < s.n; i++)
        if (s.len[i]) rc = emit(o, s.id[i], err);
done:
    free(norm);
    free(s.id);
    free(s.prev);
    free(s.next);
    free(s.len);
    free(h.items);
    return rc;
}

int cv_spm_encode(const cv_spm_tokenizer *v, const char *text, size_t len, int32_t **ids, size_t *n_ids, cv_err *err) {
    output o = {0};
    int rc = 0;
    size_t piece = 0, i = 0;
    while (rc == 0 && i < len) {
        /* the longest special token starting here */
        int32_t found = -1, node = 0;
        size_t end = 0;
        for (size_t k = i; k < len; k++) {
            node = trie_child(&v->cut, node, (unsigned char)text[k]);
            if (node < 0) break;
            if (v->cut.match[node] >= 0) {
                found = v->cut.match[node];
                end = k + 1;
            }
        }
        if (found < 0) {
            i++;
            continue;
        }
        if (piece < i) rc = encode_piece(v, text + piece, i - piece, &o, err);
        if (rc == 0) rc = emit(&o, found, err);
        piece = i = end;
    }
    if (rc == 0 && piece < len) rc = encode_piece(v, text + piece, len - piece, &o, err);
    if (rc < 0) {
        free(o.ids);
        return rc;
    }
    *ids = o.ids;
    *n_ids = o.n;
    return 0;
}
