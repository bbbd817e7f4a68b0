/* Paged attention and the KV-cache write of the CPU backend.
 *
 * Work item: one sequence, one KV head, a tile of query vectors (up to
 * CV_ATT_TILE (token, head) pairs: consecutive new tokens times the query heads
 * that share the KV head), so each key/value row is read once per tile and
 * used by all its vectors (grouped-query attention). The item walks the keys
 * 0 .. (last position of the tile) through the block table in chunks of
 * CV_ATT_KCHUNK keys with an online softmax (running max m, sum l, unnormalized
 * acc), so no buffer of context length is needed. Items are handed out
 * dynamically, longest first. Scores and P.V are the chunk kernels of the
 * backend's kernel table (plain C here; AVX2 in x86/avx2_attention.c: up to
 * 4 query vectors x 4 keys, or x 32 dims; AVX-512 and AVX512_BF16 in
 * x86/avx512_attention.c: 16 scores per transpose-add tree, vdpbf16ps
 * over a bf16 cache, and VNNI integer dots over an int8 one). A chunk's row
 * pointers come from one walk of the block table, and the next chunk's rows
 * are prefetched while this one computes (decode reads each row once): K
 * before the scores, V before P.V, and after a tile's last chunk the first
 * rows of the item the thread has already claimed next.
 *
 * Batch invariance: a vector's result depends only on its own queries, keys
 * and values, never on the other sequences of the step or on the threads.
 * Keys are cut into segments at fixed positions (multiples of ATT_SEG); each
 * segment's (m, l, acc) is made by the online softmax over its chunks of
 * CV_ATT_KCHUNK keys, and the segments are merged in increasing order by one
 * formula (merge_state), whether one thread walks them all or, when the step
 * has fewer than two items per thread, threads claim them as units (each
 * segment's state in a partials buffer of the backend; the last unit of an
 * item to finish merges them in order). A segment in which a vector has no
 * key (past its causal position) leaves its state empty and the merge skips
 * it, so the tile a vector shares with other tokens does not matter either.
 * Within a chunk each vector's dot products and sums run in the same order
 * whatever the other vectors of its tile. */
#include <math.h>
#include <string.h>

#include "cpu_internal.h"

/* Keys per segment (a multiple of CV_ATT_KCHUNK): the unit of the fixed
 * merge order, and of the split across threads. */
#define ATT_SEG 256

/* Largest [vectors][head_dim] tile (head_dim <= CV_ATT_MAX_HD: CV_ATT_TILE vectors). */
#define ATT_VF ((size_t)CV_ATT_TILE * CV_ATT_MAX_HD)
#define ROUND16(x) (((x) + 15) & ~(size_t)15)

/* Thread scratch: qt[ATT_VF] acc[ATT_VF] alpha[T] sc[T][KCHUNK] row[ATT_VF] m[T] l[T]
 * and the merged state: acc[ATT_VF] m[T] l[T] (T = CV_ATT_TILE); a segment's
 * partial result (split mode): m[T] l[T] acc[ATT_VF]. */
size_t cv_cpu_att_scratch_floats(void) {
    return ROUND16(4 * ATT_VF + 5 * CV_ATT_TILE + (size_t)CV_ATT_TILE * CV_ATT_KCHUNK);
}

int cv_cpu_att_partials_reserve(cv_cpu *c, size_t units) {
    if (units <= c->att_partial_units) return CV_OK;
    size_t bytes;
    if (!cv_mul_size(units, c->att_partial_floats * sizeof(float), &bytes)) return CV_ERR_NOMEM;
    float *p = aligned_alloc(64, bytes);
    if (!p) return CV_ERR_NOMEM;
    free(c->att_partials);
    c->att_partials = p;
    c->att_partial_units = units;
    return CV_OK;
}

size_t cv_cpu_att_partial_floats(void) { return ROUND16(ATT_VF + 2 * CV_ATT_TILE); }

typedef struct att_job {
    float *out;                 /* [q_rows][n_heads*head_dim] */
    const float *q;             /* [q_rows][q_stride] */
    int64_t q_stride;
    const cv_kv_layer *cache;
    const cv_attn_batch *bt;
    int64_t G;                  /* query heads per KV head */
    int64_t TV;                 /* vectors per tile (head_dim permitting) */
    int64_t GT, n_gt;           /* heads per tile, head tiles per KV head */
    int64_t TQ;                 /* tokens per tile */
    int64_t n_items;
    int64_t parts;              /* > 1: split mode, unit u is segment u % parts of item u / parts */
    float *scratch;             /* [nthreads][scratch_floats] */
    size_t scratch_floats;
    float *partials;            /* [n_items * parts][partial_floats] (split mode) */
    size_t partial_floats;
    atomic_int *counters;       /* [n_items] parts left (split mode) */
    atomic_llong next;          /* next item or unit to claim */
    const cv_cpu_kernels *kern;
} att_job;

/* The tile an item stands for. */
typedef struct att_tile {
    int64_t s, h;       /* sequence, KV head */
    int64_t j0, j1;     /* new tokens [j0, j1) of the sequence */
    int64_t g0, g1;     /* query heads [g0, g1) within the group */
} att_tile;

/* Online-softmax state of a tile's vectors. */
typedef struct att_state {
    float *acc;  /* [nv][head_dim] unnormalized output */
    float *m;    /* [CV_ATT_TILE] running max */
    float *l;    /* [CV_ATT_TILE] running sum */
} att_state;

static int64_t seq_items(const att_job *j, int64_t s) {
    const int64_t nq = j->bt->query_start[s + 1] - j->bt->query_start[s];
    if (nq <= 0) return 0;
    return j->bt->n_kv_heads * ((nq + j->TQ - 1) / j->TQ) * j->n_gt;
}

/* Cursor over sequences: items are claimed in increasing order per thread. */
typedef struct att_cursor {
    int64_t s, base; /* sequence s owns items [base, base + seq_items(s)) */
} att_cursor;

static void locate(const att_job *j, att_cursor *c, int64_t item, att_tile *t) {
    int64_t cnt;
    while (item >= c->base + (cnt = seq_items(j, c->s))) {
        c->base += cnt;
        c->s++;
    }
    const int64_t s = c->s, li = item - c->base;
    const int64_t nq = j->bt->query_start[s + 1] - j->bt->query_start[s];
    const int64_t n_tq = (nq + j->TQ - 1) / j->TQ;
    const int64_t per_h = n_tq * j->n_gt;
    const int64_t r = li % per_h;
    const int64_t tq = n_tq - 1 - r / j->n_gt; /* latest tokens (longest keys) first */
    const int64_t gi = r % j->n_gt;
    t->s = s;
    t->h = li / per_h;
    t->j0 = tq * j->TQ;
    t->j1 = t->j0 + j->TQ < nq ? t->j0 + j->TQ : nq;
    t->g0 = gi * j->GT;
    t->g1 = t->g0 + j->GT < j->G ? t->g0 + j->GT : j->G;
}

/* ------------------------------------------------------------------------ */
/* Chunk kernels. nv vectors; vector v has valid keys [0, nval[v]) of the
 * chunk (causal); sc[v][CV_ATT_KCHUNK] holds scores, then probabilities. */

/* A K or V row as float32 (int8: the stored integers, the scale applied by
 * the caller). */
static void widen_row(float *row, const void *p, cv_dtype dt, int64_t hd) {
    if (dt == CV_I8) {
        for (int64_t d = 0; d < hd; d++) row[d] = (float)((const int8_t *)p)[d];
        return;
    }
    cv_cpu_widen(row, p, dt, hd, NULL);
}

/* Plain C: each key row is widened once into row[hd] and used by all vectors. */
void cv_att_scores_plain(float *sc, const float *qt, int64_t hd, int nv, const int *nval, const void *const *kp,
                         cv_dtype dt, float *row) {
    const int nk = cv_att_max_valid(nval, 0, nv);
    for (int i = 0; i < nk; i++) {
        widen_row(row, kp[i], dt, hd);
        for (int v = 0; v < nv; v++) {
            if (i >= nval[v]) continue;
            float s = 0.0f;
            for (int64_t d = 0; d < hd; d++) s += qt[v * hd + d] * row[d];
            sc[v * CV_ATT_KCHUNK + i] = s;
        }
    }
}

void cv_att_pv_plain(float *acc, const float *sc, const float *alpha, int64_t hd, int nv, const int *nval,
                     const void *const *vp, cv_dtype dt, float *row) {
    for (int v = 0; v < nv; v++)
        for (int64_t d = 0; d < hd; d++) acc[v * hd + d] *= alpha[v];
    const int nk = cv_att_max_valid(nval, 0, nv);
    for (int i = 0; i < nk; i++) {
        widen_row(row, vp[i], dt, hd);
        for (int v = 0; v < nv; v++) {
            if (i >= nval[v]) continue;
            const float p = sc[v * CV_ATT_KCHUNK + i];
            for (int64_t d = 0; d < hd; d++) acc[v * hd + d] += p * row[d];
        }
    }
}

/* Online-softmax update of one vector's (m, l) with its chunk scores; leaves
 * probabilities in sc (0 past nval) and the rescale factor of acc in alpha. */
static void softmax_step_plain(float *sc, int nk, float *m, float *l, float *alpha, int nval) {
    if (nval > 0) {
        float mx = sc[0];
        for (int i = 1; i < nval; i++) mx = sc[i] > mx ? sc[i] : mx;
        const float mn = *m > mx ? *m : mx;
        const float a = *m == -INFINITY ? 0.0f : expf(*m - mn);
        float sum = 0.0f;
        for (int i = 0; i < nval; i++) {
            sc[i] = expf(sc[i] - mn);
            sum += sc[i];
        }
        *l = *l * a + sum;
        *m = mn;
        *alpha = a;
    } else {
        *alpha = 1.0f;
    }
    for (int i = nval > 0 ? nval : 0; i < nk; i++) sc[i] = 0.0f;
}

void cv_att_softmax_plain(float *sc, int nk, int nv, const int *nval, float *m, float *l, float *alpha) {
    for (int v = 0; v < nv; v++) softmax_step_plain(sc + v * CV_ATT_KCHUNK, nk, &m[v], &l[v], &alpha[v], nval[v]);
}


/* Sliding window: scores of the chunk's keys (from position c0) before
 * vector v's window (positions < vpos[v] - window + 1) become -inf, which
 * every softmax_step turns into probability 0. A vector whose valid keys all
 * lie before its window has nval 0 already, so each vector with nval > 0
 * keeps at least one finite score (its running max stays finite). */
static void window_mask(float *sc, int nv, const int *nval, const int64_t *vpos, int64_t c0, int64_t window) {
    for (int v = 0; v < nv; v++) {
        const int64_t first = vpos[v] - window + 1 - c0; /* first key of the chunk inside the window */
        for (int64_t i = 0; i < first && i < nval[v]; i++) sc[v * CV_ATT_KCHUNK + i] = -INFINITY;
    }
}

/* int8 cache: each vector's valid entries of the chunk times the rows'
 * scales: raw scores q.k8 times the key scales (before the window mask, so a
 * masked -inf never meets a zero scale), probabilities times the value scales
 * after the softmax step (its sum l keeps the unscaled ones), so P.V sums
 * p_i s_i v8_i. One multiply per entry: the same whatever the tile. */
void cv_att_scale_plain(float *sc, int nv, const int *nval, const float *s) {
    for (int v = 0; v < nv; v++)
        for (int i = 0; i < nval[v]; i++) sc[v * CV_ATT_KCHUNK + i] *= s[i];
}

/* ------------------------------------------------------------------------ */
/* Where the K and V rows of a chunk lie in a tile's cache. */
typedef struct att_rows {
    const char *k, *v;       /* the caches */
    const float *ks, *vs;    /* int8: their scales (else NULL) */
    size_t head_sc, blk_sc;  /* int8: scales to the KV head within a block, scales of a block */
    const int32_t *table;    /* the sequence's block table */
    int64_t bs;              /* block size */
    size_t head_off;         /* bytes to the KV head within a block */
    size_t blk_bytes, row_bytes;
} att_rows;

/* int8 cache: the scales of keys [c0, c0 + nk) into ksc[nk] and vsc[nk]
 * (one run per block), or with prefetch only a request for their cache lines
 * (the next chunk's, read when its turn comes). */
static void chunk_scales(const att_rows *r, int64_t c0, int nk, float *ksc, float *vsc, int prefetch) {
    for (int i = 0; i < nk;) {
        const int64_t b = (c0 + i) / r->bs, o = (c0 + i) % r->bs;
        const int n = (int)(r->bs - o < nk - i ? r->bs - o : nk - i);
        const size_t so = (size_t)r->table[b] * r->blk_sc + r->head_sc + (size_t)o;
        if (prefetch) {
            for (int e = 0; e < n; e += 16) {
                __builtin_prefetch(r->ks + so + (size_t)e);
                __builtin_prefetch(r->vs + so + (size_t)e);
            }
            __builtin_prefetch(r->ks + so + (size_t)n - 1);
            __builtin_prefetch(r->vs + so + (size_t)n - 1);
        } else {
            for (int e = 0; e < n; e++) { /* a plain loop: n is small, a memcpy call costs more */
                ksc[i + e] = r->ks[so + (size_t)e];
                vsc[i + e] = r->vs[so + (size_t)e];
            }
        }
        i += n;
    }
}

/* Keys in the chunk that starts at key c of a run ending before key end:
 * at most CV_ATT_KCHUNK, 0 when c is past the run. */
static inline int chunk_keys(int64_t c, int64_t end) {
    return c >= end ? 0 : (int)(end - c < CV_ATT_KCHUNK ? end - c : CV_ATT_KCHUNK);
}

/* Row pointers of keys [c0, c0 + nk): the block table walked from c0 (one
 * division per chunk, not per key). With prefetch, also asks for their
 * cache lines: the rows of the next chunk arrive while this one computes. */
static void chunk_rows(const att_rows *r, int64_t c0, int nk, const void **kp, const void **vp, int prefetch) {
    int64_t bi = c0 / r->bs, bo = c0 % r->bs;
    size_t off = (size_t)r->table[bi] * r->blk_bytes + r->head_off + (size_t)bo * r->row_bytes;
    if (r->ks && (prefetch & 1)) chunk_scales(r, c0, nk, NULL, NULL, 1);
    for (int i = 0; i < nk; i++) {
        kp[i] = r->k + off;
        vp[i] = r->v + off;
        if (prefetch & 1)
            for (size_t b = 0; b < r->row_bytes; b += 64) __builtin_prefetch(r->k + off + b);
        if (prefetch & 2)
            for (size_t b = 0; b < r->row_bytes; b += 64) __builtin_prefetch(r->v + off + b);
        off += r->row_bytes;
        if (++bo == r->bs && i + 1 < nk) {
            bo = 0;
            off = (size_t)r->table[++bi] * r->blk_bytes + r->head_off;
        }
    }
}

/* Where tile t's K and V rows lie. */
static att_rows tile_rows(const att_job *j, const att_tile *t) {
    const cv_kv_layer *kv = j->cache;
    const int64_t hd = j->bt->head_dim, bs = kv->block_size, nkv = kv->n_kv_heads;
    const size_t esz = cv_dtype_size(kv->dtype);
    const int i8 = kv->dtype == CV_I8;
    const att_rows rows = {.k = kv->k, .v = kv->v,
                           .table = j->bt->block_tables + (size_t)t->s * (size_t)j->bt->max_blocks_per_seq,
                           .bs = bs, .ks = i8 ? kv->k_scale : NULL, .vs = i8 ? kv->v_scale : NULL,
                           .head_sc = (size_t)t->h * (size_t)bs, .blk_sc = (size_t)nkv * (size_t)bs,
                           .head_off = (size_t)t->h * (size_t)bs * (size_t)hd * esz,
                           .blk_bytes = (size_t)nkv * (size_t)bs * (size_t)hd * esz,
                           .row_bytes = (size_t)hd * esz};
    return rows;
}

/* Keys of tile t: its last position + 1. */
static int64_t tile_keys(const att_job *j, const att_tile *t) {
    const int64_t nq = j->bt->query_start[t->s + 1] - j->bt->query_start[t->s];
    return j->bt->context_lens[t->s] - nq + t->j1;
}

/* Asks for the cache lines of tile t's query rows: in a prefill step they
 * are the QKV GEMM's output from megabytes back, and a tile's set-up waited
 * on them (2% of the step in `perf`). */
static void prefetch_queries(const att_job *j, const att_tile *t) {
    const int64_t hd = j->bt->head_dim;
    const size_t bytes = (size_t)((t->g1 - t->g0) * hd) * sizeof(float);
    for (int64_t jt = t->j0; jt < t->j1; jt++) {
        const char *src = (const char *)(j->q + (size_t)(j->bt->query_start[t->s] + jt) * (size_t)j->q_stride +
                                         (size_t)((t->h * j->G + t->g0) * hd));
        cv_prefetch_bytes(src, bytes);
    }
}

/* Asks for the cache lines of tile t's first chunk of keys (what 1: K, 2: V
 * and the queries): the item a thread runs next, while it finishes this one. */
static void prefetch_tile(const att_job *j, const att_tile *t, int what) {
    const att_rows rows = tile_rows(j, t);
    const int64_t keys = tile_keys(j, t);
    const void *kp[CV_ATT_KCHUNK], *vp[CV_ATT_KCHUNK];
    if (keys > 0) chunk_rows(&rows, 0, chunk_keys(0, keys), kp, vp, what);
    if (what & 2) prefetch_queries(j, t);
}

/* Prefetch of what comes after the chunk that ends at c1: the next chunk's
 * row pointers into kp/vp and its K rows (what 1) or V rows (what 2), or,
 * with no chunk left in this tile, the first rows of the thread's next tile.
 * K and V are asked for at two moments (before the scores and before P.V):
 * one burst of every line of a chunk fills the core's miss buffers, and the
 * prefetches then stall the kernel that should run beside them. The V pass
 * walks the block table again rather than reusing the K pass's pointers: the
 * walk spaces the prefetches out (the stored pointers measured slower: 1-6%
 * in 4 of 5 pairs). */
static void prefetch_next(const att_job *j, const att_rows *rows, int64_t c1, int64_t k_hi,
                          const att_tile *next, const void **kp, const void **vp, int what) {
    if (c1 < k_hi) chunk_rows(rows, c1, chunk_keys(c1, k_hi), kp, vp, what);
    else if (next) prefetch_tile(j, next, what);
}

/* One item (or one part of it): keys [k_lo, k_hi) of tile t, into st; next
 * (or NULL): the tile the thread runs after it, whose first keys are
 * prefetched during the last chunk. */
static void att_tile_run(const att_job *j, float *scr, const att_state *st, const att_tile *t,
                         int64_t k_lo, int64_t k_hi, const att_tile *next) {
    const cv_attn_batch *bt = j->bt;
    const cv_kv_layer *kv = j->cache;
    const int64_t hd = bt->head_dim;
    const int64_t ng = t->g1 - t->g0;
    const int nv = (int)((t->j1 - t->j0) * ng);
    const int64_t nq = bt->query_start[t->s + 1] - bt->query_start[t->s];
    const int64_t ctx = bt->context_lens[t->s];
    float *qt = scr;                          /* [nv][hd] scaled queries */
    float *alpha = scr + 2 * ATT_VF;          /* [CV_ATT_TILE] */
    float *sc = alpha + CV_ATT_TILE;          /* [CV_ATT_TILE][CV_ATT_KCHUNK] */
    float *row = sc + CV_ATT_TILE * CV_ATT_KCHUNK; /* [hd] widened K or V row (plain) */
    float *acc = st->acc, *m = st->m, *l = st->l;
    int64_t vpos[CV_ATT_TILE];
    int nval[CV_ATT_TILE];

    /* keys past the tile's last position are masked for every vector */
    const int64_t last = ctx - nq + t->j1 - 1;
    if (k_hi > last + 1) k_hi = last + 1;
    /* sliding window (bt->window > 0): chunks wholly before the first vector's
     * window are skipped, the start kept on the fixed chunk grid (a multiple
     * of CV_ATT_KCHUNK, so a vector's chunks do not depend on its tile); the
     * keys before each vector's own window are masked per vector (window_mask) */
    if (bt->window > 0) {
        int64_t w0 = ctx - nq + t->j0 - bt->window + 1;
        w0 = w0 > 0 ? w0 - w0 % CV_ATT_KCHUNK : 0;
        if (k_lo < w0) k_lo = w0;
    }
    const int i8 = kv->dtype == CV_I8;
    const att_rows rows = tile_rows(j, t);
    /* row pointers of this chunk (kp2[cur]) and of the next (kp2[!cur]) */
    const void *kp2[2][CV_ATT_KCHUNK], *vp2[2][CV_ATT_KCHUNK];
    float ksc[CV_ATT_KCHUNK], vsc[CV_ATT_KCHUNK]; /* int8: this chunk's scales */
    int cur = 0;
    /* the first chunk's rows are asked for (prefetch) before the queries are
     * set up, so that their cache misses overlap that work */
    if (k_lo < k_hi)
        chunk_rows(&rows, k_lo, chunk_keys(k_lo, k_hi), kp2[0], vp2[0], 3);
    for (int v = 0; v < nv; v++) {
        const int64_t jt = t->j0 + v / ng, g = t->g0 + v % ng;
        const float *src = j->q + (size_t)(bt->query_start[t->s] + jt) * (size_t)j->q_stride +
                           (size_t)((t->h * j->G + g) * hd);
        for (int64_t d = 0; d < hd; d++) qt[v * hd + d] = src[d] * bt->scale;
        memset(acc + v * hd, 0, (size_t)hd * sizeof(float));
        m[v] = -INFINITY;
        l[v] = 0.0f;
        vpos[v] = ctx - nq + jt;
    }
    /* bf16 cache with vdpbf16ps: the scaled queries as bf16, once per tile;
     * int8 cache with VNNI: as int8 blocks (the row scratch holds either) */
    const cv_cpu_kernels *k = j->kern;
    const int bf16_dot = k->att_scores_bf16 && kv->dtype == CV_BF16;
    const int i8_dot = i8 && k->att_scores_i8;
    uint16_t *qb = (uint16_t *)row;
    if (bf16_dot) k->att_round_q_bf16(qb, qt, hd, nv);
    if (i8_dot) k->att_quantize_q_i8(row, qt, hd, nv);
    for (int64_t c0 = k_lo; c0 < k_hi; c0 += CV_ATT_KCHUNK, cur = !cur) {
        const int nk = chunk_keys(c0, k_hi);
        const void *const *kp = kp2[cur], *const *vp = vp2[cur];
        const int64_t c1 = c0 + CV_ATT_KCHUNK;
        /* bf16 and int8-dot kernels take the next chunk's rows and spread their
         * prefetch over their loops; the others get it as a burst before each pass */
        const int nk_next = chunk_keys(c1, k_hi);
        const int spread = bf16_dot || i8_dot;
        if (spread && nk_next) {
            chunk_rows(&rows, c1, nk_next, kp2[!cur], vp2[!cur], 0);
            if (i8) chunk_scales(&rows, c1, nk_next, NULL, NULL, 1);
        } else {
            prefetch_next(j, &rows, c1, k_hi, next, kp2[!cur], vp2[!cur], 1);
        }
        if (i8) chunk_scales(&rows, c0, nk, ksc, vsc, 0);
        for (int v = 0; v < nv; v++) {
            const int64_t n_ok = vpos[v] - c0 + 1;
            nval[v] = n_ok <= 0 ? 0 : (n_ok >= nk ? nk : (int)n_ok);
            if (bt->window > 0 && c0 + nval[v] <= vpos[v] - bt->window + 1) nval[v] = 0; /* all before the window */
        }
        if (spread) {
            const void *const *kpf = nk_next ? kp2[!cur] : NULL, *const *vpf = nk_next ? vp2[!cur] : NULL;
            if (bf16_dot) k->att_scores_bf16(sc, qb, hd, nv, nval, kp, kpf, nk_next);
            else k->att_scores_i8(sc, row, hd, nv, nval, kp, kpf, nk_next);
            if (!nk_next) prefetch_next(j, &rows, c1, k_hi, next, kp2[!cur], vp2[!cur], 2);
            if (i8) k->att_scale(sc, nv, nval, ksc);
            if (bt->window > 0) window_mask(sc, nv, nval, vpos, c0, bt->window);
            k->att_softmax(sc, nk, nv, nval, m, l, alpha);
            if (i8) k->att_scale(sc, nv, nval, vsc);
            if (bf16_dot) k->att_pv_bf16(acc, sc, alpha, hd, nv, nval, vp, vpf, nk_next);
            else k->att_pv_i8(acc, sc, alpha, hd, nv, nval, vp, vpf, nk_next);
            continue;
        }
        k->att_scores(sc, qt, hd, nv, nval, kp, kv->dtype, row);
        prefetch_next(j, &rows, c1, k_hi, next, kp2[!cur], vp2[!cur], 2);
        if (i8) k->att_scale(sc, nv, nval, ksc);
        if (bt->window > 0) window_mask(sc, nv, nval, vpos, c0, bt->window);
        k->att_softmax(sc, nk, nv, nval, m, l, alpha);
        if (i8) k->att_scale(sc, nv, nval, vsc);
        k->att_pv(acc, sc, alpha, hd, nv, nval, vp, kv->dtype, row);
    }
}

/* Merges segment state `seg` into `tot` (nv vectors): the one formula of
 * the fixed merge order. An empty segment (m = -inf: no key of the vector in
 * it) changes nothing; the first non-empty one is copied. */
static void merge_state(const att_state *tot, const att_state *seg, int nv, int64_t hd) {
    for (int v = 0; v < nv; v++) {
        const float ms = seg->m[v], mt = tot->m[v];
        float *at = tot->acc + (size_t)v * (size_t)hd;
        const float *as = seg->acc + (size_t)v * (size_t)hd;
        if (ms == -INFINITY) continue;
        if (mt == -INFINITY) {
            memcpy(at, as, (size_t)hd * sizeof(float));
            tot->m[v] = ms;
            tot->l[v] = seg->l[v];
            continue;
        }
        const float mx = mt > ms ? mt : ms;
        const float wt = expf(mt - mx), ws = expf(ms - mx);
        tot->l[v] = tot->l[v] * wt + seg->l[v] * ws;
        tot->m[v] = mx;
        for (int64_t d = 0; d < hd; d++) at[d] = at[d] * wt + as[d] * ws;
    }
}

static void clear_state(const att_state *st, int nv, int64_t hd) {
    memset(st->acc, 0, (size_t)nv * (size_t)hd * sizeof(float));
    for (int v = 0; v < nv; v++) {
        st->m[v] = -INFINITY;
        st->l[v] = 0.0f;
    }
}

static int tile_vectors(const att_tile *t) { return (int)((t->j1 - t->j0) * (t->g1 - t->g0)); }

/* Writes the normalized result of tile t from its merged state. */
static void att_finish(const att_job *j, const att_tile *t, const att_state *st) {
    const cv_attn_batch *bt = j->bt;
    const int64_t hd = bt->head_dim, ng = t->g1 - t->g0;
    const int nv = tile_vectors(t);
    for (int v = 0; v < nv; v++) {
        const int64_t jt = t->j0 + v / ng, g = t->g0 + v % ng;
        float *o = j->out + (size_t)(bt->query_start[t->s] + jt) * (size_t)(bt->n_heads * hd) +
                   (size_t)((t->h * j->G + g) * hd);
        const float inv = st->l[v] > 0.0f ? 1.0f / st->l[v] : 0.0f;
        const float *a = st->acc + (size_t)v * (size_t)hd;
        for (int64_t d = 0; d < hd; d++) o[d] = a[d] * inv;
    }
}

static att_state partial_state(const att_job *j, int64_t unit) {
    float *p = j->partials + (size_t)unit * j->partial_floats;
    att_state st = {.m = p, .l = p + CV_ATT_TILE, .acc = p + 2 * CV_ATT_TILE};
    return st;
}

static void att_fn(void *arg, int tid, int nth) {
    att_job *j = arg;
    (void)nth;
    float *scr = j->scratch + (size_t)tid * j->scratch_floats;
    const int64_t hd = j->bt->head_dim;
    att_cursor cur = {0, 0};
    att_tile t;
    /* the thread's states: a segment's (acc after qt, m and l after the row
     * buffer) and the merged one after them */
    float *ml = scr + 3 * ATT_VF + CV_ATT_TILE + CV_ATT_TILE * CV_ATT_KCHUNK;
    const att_state own = {.acc = scr + ATT_VF, .m = ml, .l = ml + CV_ATT_TILE};
    float *tt = ml + 2 * CV_ATT_TILE;
    const att_state tot = {.acc = tt, .m = tt + ATT_VF, .l = tt + ATT_VF + CV_ATT_TILE};
    if (j->parts > 1) {
        /* split mode: units are (item, segment); the last unit of an item merges */
        const int64_t n_units = j->n_items * j->parts;
        for (;;) {
            const int64_t u = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);
            if (u >= n_units) break;
            const int64_t item = u / j->parts, seg = u % j->parts;
            locate(j, &cur, item, &t);
            const att_state st = partial_state(j, u);
            att_tile_run(j, scr, &st, &t, seg * ATT_SEG, (seg + 1) * ATT_SEG, NULL);
            if (atomic_fetch_sub_explicit(&j->counters[item], 1, memory_order_acq_rel) == 1) {
                const int nv = tile_vectors(&t);
                clear_state(&tot, nv, hd);
                for (int64_t p = 0; p < j->parts; p++) {
                    const att_state ps = partial_state(j, item * j->parts + p);
                    merge_state(&tot, &ps, nv, hd);
                }
                att_finish(j, &t, &tot);
            }
        }
        return;
    }
    /* items are claimed one ahead, so that the next one's first keys are
     * prefetched while this one ends (claims stay in increasing order) */
    att_cursor ahead = cur;
    att_tile tn;
    int64_t item = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);
    while (item < j->n_items) {
        locate(j, &cur, item, &t);
        const int64_t nxt = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);
        const att_tile *np = NULL;
        if (nxt < j->n_items) {
            locate(j, &ahead, nxt, &tn);
            np = &tn;
        }
        const int64_t keys = tile_keys(j, &t);
        if (keys <= ATT_SEG) { /* one segment: its state is the merged one */
            att_tile_run(j, scr, &tot, &t, 0, keys, np);
        } else {
            clear_state(&tot, tile_vectors(&t), hd);
            for (int64_t k0 = 0; k0 < keys; k0 += ATT_SEG) {
                att_tile_run(j, scr, &own, &t, k0, k0 + ATT_SEG, k0 + ATT_SEG >= keys ? np : NULL);
                merge_state(&tot, &own, tile_vectors(&t), hd);
            }
        }
        att_finish(j, &t, &tot);
        item = nxt;
    }
}

void cv_cpu_paged_attention(cv_backend *b, float *out, const float *q, int64_t q_stride,
                            const cv_kv_layer *cache, const cv_attn_batch *batch) {
    cv_cpu *c = cv_cpu_of(b);
    const int64_t hd = batch->head_dim;
    if (batch->n_seqs <= 0 || hd <= 0 || batch->n_kv_heads <= 0) return;
    /* head_dim past CV_ATT_TILE * CV_ATT_MAX_HD does not fit the scratch; the
     * model checks head_dim when it loads. */
    int64_t TV = (int64_t)ATT_VF / hd;
    if (TV > CV_ATT_TILE) TV = CV_ATT_TILE;
    if (TV < 1) return;
    att_job j = {.out = out, .q = q, .q_stride = q_stride, .cache = cache, .bt = batch,
                 .scratch = c->att_scratch, .scratch_floats = c->att_scratch_floats,
                 .partials = c->att_partials, .partial_floats = c->att_partial_floats,
                 .counters = c->att_counters, .kern = &c->kern};
    j.G = batch->n_heads / batch->n_kv_heads;
    j.TV = TV;
    j.GT = j.G < TV ? j.G : TV;
    j.n_gt = (j.G + j.GT - 1) / j.GT;
    j.TQ = TV / j.GT;
    atomic_init(&j.next, 0);
    int64_t n_items = 0, max_keys = 0;
    double work = 0.0; /* multiply-adds: q.k and p.v of every vector over its keys */
    for (int64_t s = 0; s < batch->n_seqs; s++) {
        n_items += seq_items(&j, s);
        const int64_t nq = batch->query_start[s + 1] - batch->query_start[s];
        if (nq > 0) {
            if (batch->context_lens[s] > max_keys) max_keys = batch->context_lens[s];
            work += 2.0 * (double)nq * (double)batch->n_heads * (double)hd *
                    ((double)batch->context_lens[s] - 0.5 * (double)(nq - 1));
        }
    }
    j.n_items = n_items;
    if (n_items == 0) return;
    /* as for the GEMM: at least ~64K multiply-adds per thread */
    const int64_t nth = cv_threads_for(c, work, 65536.0);
    j.parts = 1;
    /* Few items for the threads and contexts of several segments: threads
     * claim (item, segment) units (the same result as one thread walking the
     * segments: see the top of the file). n_items < 2 nth fits the counters;
     * the partials grow to the units, and without memory the items run whole. */
    const int64_t segs = (max_keys + ATT_SEG - 1) / ATT_SEG;
    if (nth > 1 && n_items < 2 * nth && segs >= 2 && cv_cpu_att_partials_reserve(c, (size_t)(n_items * segs)) == 0) {
        j.parts = segs;
        j.partials = c->att_partials;
        for (int64_t i = 0; i < n_items; i++)
            atomic_store_explicit(&c->att_counters[i], (int)segs, memory_order_relaxed);
    }
    const int64_t units = n_items * j.parts;
    /* items are claimed from j.next: a late worker only takes fewer */
    cv_pool_run_dynamic(c->pool, (int)(units < nth ? units : nth), att_fn, &j, 1);
}
