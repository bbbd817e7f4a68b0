/* Logits processing and sampling (see sampler.h).
 *
 * Order of work on one row of logits:
 *   sanitize (NaN -> -inf, +inf -> FLT_MAX), keep a raw copy when logprobs are
 *   asked for, repetition / frequency / presence penalties, bans, then either
 *   argmax (greedy) or: weights exp((l - max) / T), top_k, top_p, min_p, and
 *   one uniform draw inverted over the survivors in increasing id order.
 *
 * Nothing is allocated per call: every scratch array is sized at create.
 * Penalties cost O(prompt + output): counts[] is zero between calls and only
 * the entries touched are reset. top_k uses a heap when k is small and a
 * quickselect otherwise; top_p uses a quickselect on probability mass, so
 * neither sorts the whole vocabulary. */
#include "sampler.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Up to this k, top_k keeps a heap of k entries in one pass over the logits. */
#define HEAP_MAX_K 256
/* Ranges at most this long are finished with an insertion sort. */
#define SMALL_RANGE 16

struct cv_sampler {
    int64_t vocab;
    int32_t *counts;  /* [vocab] occurrence counts / marks; all zero between calls */
    int32_t *touched; /* [vocab] distinct ids whose counts entry is non-zero */
    int32_t *cand;    /* [vocab] candidate token ids */
    float *w;         /* [vocab] by token id: exp((logit - max) / T), valid at candidates */
    float *raw;       /* [vocab] sanitized logits before processing, for logprobs */
};

/* ---- random stream ---------------------------------------------------- */

static uint64_t rotl64(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

void cv_rng_seed(cv_rng *r, uint64_t seed) {
    uint64_t x = seed;
    for (int i = 0; i < 4; i++) r->s[i] = splitmix64(&x);
}

uint64_t cv_rng_next(cv_rng *r) {
    uint64_t *s = r->s;
    uint64_t result = rotl64(s[1] * 5u, 7) * 9u;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl64(s[3], 45);
    return result;
}

double cv_rng_uniform(cv_rng *r) {
    /* top 53 bits: every value is a multiple of 2^-53 in [0, 1) */
    return (double)(cv_rng_next(r) >> 11) * (1.0 / 9007199254740992.0);
}

/* ---- parameters ------------------------------------------------------- */

void cv_sampling_params_init(cv_sampling_params *p) {
    p->temperature = 1.0f;
    p->top_p = 1.0f;
    p->min_p = 0.0f;
    p->repetition_penalty = 1.0f;
    p->presence_penalty = 0.0f;
    p->frequency_penalty = 0.0f;
    p->top_k = 0;
    p->n_logprobs = -1;
}

int cv_sampling_params_check(const cv_sampling_params *p, cv_err *err) {
    if (!p) return cv_set_err(err, CV_ERR_INVALID, "sampling params: NULL");
    /* the negated comparisons also reject NaN */
    if (!(p->temperature >= 0.0f && isfinite(p->temperature)))
        return cv_set_err(err, CV_ERR_INVALID, "temperature must be finite and >= 0, got %g",
                          (double)p->temperature);
    if (!(p->top_p > 0.0f && p->top_p <= 1.0f))
        return cv_set_err(err, CV_ERR_INVALID, "top_p must be in (0, 1], got %g", (double)p->top_p);
    if (!(p->min_p >= 0.0f && p->min_p <= 1.0f))
        return cv_set_err(err, CV_ERR_INVALID, "min_p must be in [0, 1], got %g", (double)p->min_p);
    if (!(p->repetition_penalty > 0.0f && isfinite(p->repetition_penalty)))
        return cv_set_err(err, CV_ERR_INVALID, "repetition_penalty must be finite and > 0, got %g",
                          (double)p->repetition_penalty);
    if (!(p->presence_penalty >= -2.0f && p->presence_penalty <= 2.0f))
        return cv_set_err(err, CV_ERR_INVALID, "presence_penalty must be in [-2, 2], got %g",
                          (double)p->presence_penalty);
    if (!(p->frequency_penalty >= -2.0f && p->frequency_penalty <= 2.0f))
        return cv_set_err(err, CV_ERR_INVALID, "frequency_penalty must be in [-2, 2], got %g",
                          (double)p->frequency_penalty);
    if (p->top_k < -1)
        return cv_set_err(err, CV_ERR_INVALID, "top_k must be -1, 0 (off) or >= 1, got %d",
                          (int)p->top_k);
    if (p->n_logprobs < -1 || p->n_logprobs > CV_MAX_LOGPROBS)
        return cv_set_err(err, CV_ERR_INVALID, "n_logprobs must be in [-1, %d], got %d",
                          CV_MAX_LOGPROBS, (int)p->n_logprobs);
    return CV_OK;
}

/* What the parameters mean after out-of-range values are made harmless. */
typedef struct eff_params {
    int greedy;
    float temperature; /* > 0, <= FLT_MAX */
    int64_t top_k;     /* 0: off, else 1 < top_k < vocab */
    double top_p;      /* [0, 1]; 1: off */
    float min_p;       /* [0, 1]; 0: off */
} eff_params;

static void effective(eff_params *e, const cv_sampling_params *p, int64_t vocab) {
    float t = p->temperature;
    e->greedy = !(t > 0.0f) || p->top_k == 1; /* NaN temperature: greedy */
    e->temperature = t > FLT_MAX ? FLT_MAX : t;
    e->top_k = (p->top_k > 0 && (int64_t)p->top_k < vocab) ? p->top_k : 0;
    double tp = p->top_p;
    e->top_p = !(tp < 1.0) ? 1.0 : (tp < 0.0 ? 0.0 : tp);
    float mp = p->min_p;
    e->min_p = !(mp > 0.0f) ? 0.0f : (mp > 1.0f ? 1.0f : mp);
}

/* ---- create / destroy ------------------------------------------------- */

cv_sampler *cv_sampler_create(int64_t vocab_size) {
    if (vocab_size <= 0 || vocab_size > INT32_MAX) return NULL;
    size_t n = (size_t)vocab_size;
    cv_sampler *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->vocab = vocab_size;
    s->counts = calloc(n, sizeof *s->counts);
    s->touched = malloc(n * sizeof *s->touched);
    s->cand = malloc(n * sizeof *s->cand);
    s->w = malloc(n * sizeof *s->w);
    s->raw = malloc(n * sizeof *s->raw);
    if (!s->counts || !s->touched || !s->cand || !s->w || !s->raw) {
        cv_sampler_destroy(s);
        return NULL;
    }
    return s;
}

void cv_sampler_destroy(cv_sampler *s) {
    if (!s) return;
    free(s->counts);
    free(s->touched);
    free(s->cand);
    free(s->w);
    free(s->raw);
    free(s);
}

/* ---- processing ------------------------------------------------------- */

static void sanitize(float *x /* [n] */, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        float v = x[i];
        if (v != v) x[i] = -INFINITY;
        else if (v == INFINITY) x[i] = FLT_MAX;
    }
}

/* Keeps a penalized logit out of +inf, so that later max-subtraction gives no NaN. */
static float clamp_top(float v) { return v > FLT_MAX ? FLT_MAX : v; }

static void apply_penalties(cv_sampler *s, float *logits /* [vocab] */, const cv_sampling_params *p,
                            const int32_t *prompt, int64_t n_prompt,
                            const int32_t *output, int64_t n_output,
                            const int32_t *banned, int64_t n_banned) {
    const int64_t V = s->vocab;
    int32_t *counts = s->counts, *touched = s->touched;
    int64_t nt = 0;
    float rep = p->repetition_penalty;
    if (rep > 0.0f && isfinite(rep) && rep != 1.0f) {
        /* each distinct token of prompt and output once */
        for (int pass = 0; pass < 2; pass++) {
            const int32_t *ids = pass ? output : prompt;
            int64_t n = pass ? n_output : n_prompt;
            if (!ids) continue;
            for (int64_t i = 0; i < n; i++) {
                int32_t t = ids[i];
                if (t < 0 || t >= V || counts[t]) continue;
                counts[t] = 1;
                touched[nt++] = t;
            }
        }
        for (int64_t i = 0; i < nt; i++) {
            int32_t t = touched[i];
            float l = logits[t];
            logits[t] = clamp_top(l > 0.0f ? l / rep : l * rep);
            counts[t] = 0;
        }
    }
    float freq = p->frequency_penalty, pres = p->presence_penalty;
    if (!isfinite(freq)) freq = 0.0f;
    if (!isfinite(pres)) pres = 0.0f;
    if ((freq != 0.0f || pres != 0.0f) && output) {
        nt = 0;
        for (int64_t i = 0; i < n_output; i++) {
            int32_t t = output[i];
            if (t < 0 || t >= V) continue;
            if (counts[t] == 0) touched[nt++] = t;
            if (counts[t] < INT32_MAX) counts[t]++;
        }
        for (int64_t i = 0; i < nt; i++) {
            int32_t t = touched[i];
            float l = logits[t];
            l -= freq * (float)counts[t];
            l -= pres;
            logits[t] = clamp_top(l);
            counts[t] = 0;
        }
    }
    if (banned)
        for (int64_t i = 0; i < n_banned; i++)
            if (banned[i] >= 0 && banned[i] < V) logits[banned[i]] = -INFINITY;
}

/* Lowest id among the largest values (all -inf: 0). */
static int32_t argmax(const float *x /* [n] */, int64_t n) {
    int64_t best = 0;
    float bv = x[0];
    for (int64_t i = 1; i < n; i++)
        if (x[i] > bv) { bv = x[i]; best = i; }
    return (int32_t)best;
}

/* Total order used by every selection: larger key first, lower id on ties. */
static int better(const float *key /* [vocab] */, int32_t a, int32_t b) {
    return key[a] > key[b] || (key[a] == key[b] && a < b);
}

static void swap_ids(int32_t *c, int64_t i, int64_t j) {
    int32_t t = c[i];
    c[i] = c[j];
    c[j] = t;
}

static void insertion_sort(int32_t *c /* [n] */, int64_t n, const float *key) {
    for (int64_t i = 1; i < n; i++) {
        int32_t x = c[i];
        int64_t j = i;
        for (; j > 0 && better(key, x, c[j - 1]); j--) c[j] = c[j - 1];
        c[j] = x;
    }
}

/* Partitions c[lo..hi) (hi - lo >= 3) around a median-of-three pivot: better
 * ids first, then the pivot, then worse ones. Returns the pivot's index. */
static int64_t partition(int32_t *c, int64_t lo, int64_t hi, const float *key) {
    int64_t mid = lo + (hi - lo) / 2, last = hi - 1;
    if (better(key, c[mid], c[lo])) swap_ids(c, mid, lo);
    if (better(key, c[last], c[lo])) swap_ids(c, last, lo);
    if (better(key, c[last], c[mid])) swap_ids(c, last, mid);
    swap_ids(c, mid, last); /* median as pivot at the end; c[lo] beats it */
    int32_t pivot = c[last];
    int64_t i = lo;
    for (int64_t j = lo; j < last; j++)
        if (better(key, c[j], pivot)) swap_ids(c, i++, j);
    swap_ids(c, i, last);
    return i;
}

/* Reorders c[0..n) so that c[0..k) holds the k best (0 < k < n). */
static void select_best(int32_t *c, int64_t n, int64_t k, const float *key) {
    int64_t lo = 0, hi = n;
    while (lo < k && k < hi && hi - lo > SMALL_RANGE) {
        int64_t p = partition(c, lo, hi, key);
        if (p >= k) hi = p;
        else lo = p + 1;
    }
    if (lo < k && k < hi) insertion_sort(c + lo, hi - lo, key);
}

/* Heap of the k best finite logits, the worst at the root. Returns its size. */
static int64_t heap_top_k(int32_t *heap /* [k] */, const float *l /* [vocab] */, int64_t vocab,
                          int64_t k) {
    int64_t n = 0;
    for (int64_t id = 0; id < vocab; id++) {
        float v = l[id];
        if (v == -INFINITY) continue;
        int64_t i;
        if (n < k) {
            /* sift up: a later id loses ties, so only a strictly larger value rises */
            i = n++;
            while (i > 0) {
                int64_t parent = (i - 1) / 2;
                if (!better(l, heap[parent], (int32_t)id)) break;
                heap[i] = heap[parent];
                i = parent;
            }
            heap[i] = (int32_t)id;
            continue;
        }
        if (!(v > l[heap[0]])) continue;
        /* replace the root and sift down */
        i = 0;
        for (;;) {
            int64_t ch = 2 * i + 1;
            if (ch >= n) break;
            if (ch + 1 < n && better(l, heap[ch], heap[ch + 1])) ch++; /* the worse child */
            if (!better(l, (int32_t)id, heap[ch])) break;
            heap[i] = heap[ch];
            i = ch;
        }
        heap[i] = (int32_t)id;
    }
    return n;
}

/* Keeps the smallest best-first prefix of c[0..n) whose weight is at least
 * top_p of the total; returns its length (>= 1). Quickselect on mass, so the
 * prefix comes out unsorted and nothing outside the boundary range is sorted. */
static int64_t top_p_prefix(int32_t *c, int64_t n, const float *w, double top_p) {
    double total = 0.0;
    for (int64_t i = 0; i < n; i++) total += w[c[i]];
    double need = top_p * total;
    if (!(need > 0.0)) {
        int64_t best = 0;
        for (int64_t i = 1; i < n; i++)
            if (better(w, c[i], c[best])) best = i;
        swap_ids(c, 0, best);
        return 1;
    }
    /* invariant: c[0..lo) beat everything after them, their mass is below the
     * target, and need is what is still missing; the boundary is in [lo, hi) */
    int64_t lo = 0, hi = n;
    while (hi - lo > SMALL_RANGE) {
        int64_t p = partition(c, lo, hi, w);
        double mass = 0.0;
        for (int64_t i = lo; i < p; i++) mass += w[c[i]];
        if (mass >= need) {
            hi = p;
        } else if (mass + w[c[p]] >= need) {
            return p + 1;
        } else {
            need -= mass + w[c[p]];
            lo = p + 1;
        }
    }
    insertion_sort(c + lo, hi - lo, w);
    for (int64_t i = lo; i < hi; i++) {
        need -= w[c[i]];
        if (need <= 0.0) return i + 1;
    }
    return hi > 0 ? hi : 1; /* rounding left a sliver: keep the whole range */
}

/* Fills s->cand[0..n) with the tokens a draw may pick and s->w at them;
 * returns n (0 when every logit is -inf). *id_order says whether cand is
 * ascending by id. */
static int64_t build_support(cv_sampler *s, const float *l /* [vocab] */, const eff_params *e,
                             int *id_order) {
    const int64_t V = s->vocab;
    int32_t *cand = s->cand;
    float *w = s->w;
    const float t = e->temperature;
    int64_t n = 0;
    float m;
    *id_order = 0;
    if (e->top_k > 0 && e->top_k <= HEAP_MAX_K) {
        n = heap_top_k(cand, l, V, e->top_k);
        if (n == 0) return 0;
        m = l[cand[0]];
        for (int64_t i = 1; i < n; i++) m = l[cand[i]] > m ? l[cand[i]] : m;
        for (int64_t i = 0; i < n; i++) w[cand[i]] = expf((l[cand[i]] - m) / t);
    } else {
        m = -INFINITY;
        for (int64_t i = 0; i < V; i++) m = l[i] > m ? l[i] : m;
        if (m == -INFINITY) return 0;
        /* min_p only drops a tail below a threshold, so without top_p between
         * them it can be applied while building (top_k of a top segment is
         * the segment's own top_k) */
        const float cut = e->top_p >= 1.0 ? e->min_p : 0.0f;
        for (int64_t i = 0; i < V; i++) {
            if (l[i] == -INFINITY) continue;
            float wi = expf((l[i] - m) / t);
            if (wi < cut) continue;
            w[i] = wi;
            cand[n++] = (int32_t)i;
        }
        *id_order = 1;
        if (e->top_k > 0 && e->top_k < n) {
            select_best(cand, n, e->top_k, l);
            n = e->top_k;
            *id_order = 0;
        }
    }
    if (e->top_p < 1.0) {
        n = top_p_prefix(cand, n, w, e->top_p);
        *id_order = 0;
    }
    if (e->min_p > 0.0f) {
        /* the best token has weight 1, so the threshold is min_p itself */
        int64_t j = 0;
        for (int64_t i = 0; i < n; i++)
            if (!(w[cand[i]] < e->min_p)) cand[j++] = cand[i];
        n = j;
    }
    return n;
}

static int cmp_id(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* Inverts the CDF of w over cand[0..n) taken in increasing id order at u. */
static int32_t draw(cv_sampler *s, int64_t n, int id_order, double u) {
    int32_t *cand = s->cand;
    const float *w = s->w;
    if (n <= 0) return 0;
    if (n == 1) return cand[0];
    double total = 0.0;
    for (int64_t i = 0; i < n; i++) total += w[cand[i]];
    const double target = u * total;
    double cum = 0.0;
    int32_t last_pos = cand[0]; /* last id seen with weight > 0: the answer if rounding runs out */
    if (!id_order && n * 64 > s->vocab) {
        /* many survivors: mark them and walk the vocabulary, cheaper than sorting */
        int32_t *mark = s->counts;
        int32_t found = -1;
        for (int64_t i = 0; i < n; i++) mark[cand[i]] = 1;
        for (int64_t id = 0; id < s->vocab; id++) {
            if (!mark[id]) continue;
            mark[id] = 0; /* keep counts[] all zero between calls */
            if (found >= 0) continue;
            float wi = w[id];
            if (wi > 0.0f) last_pos = (int32_t)id;
            cum += wi;
            if (cum > target) found = (int32_t)id;
        }
        return found >= 0 ? found : last_pos;
    }
    if (!id_order) {
        if (n <= SMALL_RANGE) {
            for (int64_t i = 1; i < n; i++) {
                int32_t x = cand[i];
                int64_t j = i;
                for (; j > 0 && cand[j - 1] > x; j--) cand[j] = cand[j - 1];
                cand[j] = x;
            }
        } else {
            qsort(cand, (size_t)n, sizeof *cand, cmp_id);
        }
    }
    for (int64_t i = 0; i < n; i++) {
        float wi = w[cand[i]];
        if (wi > 0.0f) last_pos = cand[i];
        cum += wi;
        if (cum > target) return cand[i];
    }
    return last_pos;
}

static void fill_logprobs(cv_sample_info *info, const float *raw /* [vocab] */, int64_t vocab,
                          int32_t token, int32_t n_logprobs) {
    float m = -INFINITY;
    for (int64_t i = 0; i < vocab; i++) m = raw[i] > m ? raw[i] : m;
    double lse;
    if (m == -INFINITY) {
        lse = INFINITY; /* every logprob -inf, and no inf - inf */
    } else {
        double sum = 0.0;
        for (int64_t i = 0; i < vocab; i++) sum += expf(raw[i] - m);
        lse = (double)m + log(sum);
    }
    info->logprob = (float)((double)raw[token] - lse);
    int64_t k = n_logprobs > CV_MAX_LOGPROBS ? CV_MAX_LOGPROBS : n_logprobs;
    if (k > vocab) k = vocab;
    int64_t n = 0;
    /* sorted insertion: k is at most 20 and most values lose to the last entry */
    for (int64_t i = 0; i < vocab && k > 0; i++) {
        if (n == k && !(raw[i] > raw[info->top_ids[n - 1]])) continue;
        int64_t j = n < k ? n++ : k - 1;
        while (j > 0 && raw[i] > raw[info->top_ids[j - 1]]) {
            info->top_ids[j] = info->top_ids[j - 1];
            j--;
        }
        info->top_ids[j] = (int32_t)i;
    }
    info->n_top = (int32_t)n;
    for (int64_t j = 0; j < n; j++)
        info->top_logprobs[j] = (float)((double)raw[info->top_ids[j]] - lse);
}

int32_t cv_sampler_sample(cv_sampler *s, float *logits, const cv_sampling_params *p,
                          const int32_t *prompt, int64_t n_prompt,
                          const int32_t *output, int64_t n_output,
                          const int32_t *banned, int64_t n_banned,
                          cv_rng *rng, cv_sample_info *info) {
    if (!s || !logits || !p) return -1;
    const int64_t V = s->vocab;
    eff_params e;
    effective(&e, p, V);
    if (!e.greedy && !rng) return -1;
    if (info) {
        info->logprob = 0.0f;
        info->n_top = 0;
    }
    sanitize(logits, V);
    const int want_lp = info && p->n_logprobs >= 0;
    if (want_lp) memcpy(s->raw, logits, (size_t)V * sizeof *logits);
    apply_penalties(s, logits, p, prompt, n_prompt, output, n_output, banned, n_banned);
    int32_t token;
    if (e.greedy) {
        token = argmax(logits, V);
    } else {
        /* draw first: one draw per token whatever the support turns out to be */
        double u = cv_rng_uniform(rng);
        int id_order;
        int64_t n = build_support(s, logits, &e, &id_order);
        token = draw(s, n, id_order, u);
    }
    if (want_lp) fill_logprobs(info, s->raw, V, token, p->n_logprobs);
    return token;
}

void cv_sampler_process(cv_sampler *s, float *out, float *logits, const cv_sampling_params *p,
                        const int32_t *prompt, int64_t n_prompt,
                        const int32_t *output, int64_t n_output,
                        const int32_t *banned, int64_t n_banned) {
    if (!s || !out || !logits || !p) return;
    const int64_t V = s->vocab;
    eff_params e;
    effective(&e, p, V);
    sanitize(logits, V);
    apply_penalties(s, logits, p, prompt, n_prompt, output, n_output, banned, n_banned);
    for (int64_t i = 0; i < V; i++) out[i] = -INFINITY;
    if (e.greedy) {
        int32_t t = argmax(logits, V);
        out[t] = logits[t];
        return;
    }
    int id_order;
    int64_t n = build_support(s, logits, &e, &id_order);
    for (int64_t i = 0; i < n; i++) out[s->cand[i]] = logits[s->cand[i]] / e.temperature;
}
