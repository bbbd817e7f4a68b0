/* Logits processing and sampling (see sampler.h).
 *
 * Order of work on one row of logits:
 *   sanitize (NaN -> -inf, +inf -> FLT_MAX), keep a raw copy when logprobs are
 *   asked for, logit controls (bias, allowed ids, bad words), repetition / frequency / presence penalties, bans, then either
 *   argmax (greedy) or: weights exp((l - max) / T), top_k, top_p, min_p, and
 *   one uniform draw inverted over the survivors in increasing id order.
 *
 * Nothing is allocated per call: every scratch array is sized at create.
 * Penalties cost O(prompt + output): counts[] is zero between calls and only
 * the entries touched are reset. The passes over the whole vocabulary (max,
 * exp, sums) are written in fixed-width lanes so that the compiler vectorizes
 * them. top_k uses a heap that skips blocks below its worst entry when k is
 * small and a quickselect on the values otherwise; top_p drops a tail that
 * provably lies outside the nucleus, then quickselects on probability mass;
 * nothing sorts the whole vocabulary. */
#include "sampler.h"

#include "../../base/common.h" /* CV_VECTOR_CLONES */

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Up to this k, top_k keeps a heap of k entries in one pass over the logits;
 * above it, a quickselect on a copy of the values finds the k-th largest. */
#define HEAP_MAX_K 256
/* Ranges at most this long are finished with an insertion sort. */
#define SMALL_RANGE 16
/* Weights are summed per block of this many ids, so a draw over the whole
 * vocabulary walks block sums first. */
#define BLOCK 64
/* Below this, exp(x) (< 1.7e-38) counts as 0: such a weight is never drawn. */
#define EXP_MIN -87.0f

struct cv_sampler {
    int64_t vocab;
    int32_t *counts;  /* [vocab] occurrence counts / marks; all zero between calls */
    int32_t *touched; /* [vocab] distinct ids whose counts entry is non-zero */
    int32_t *cand;    /* [vocab] candidate token ids */
    float *w;         /* [vocab] by token id: exp((logit - max) / T) */
    float *raw;       /* [vocab] sanitized logits before processing, for logprobs */
    float *vals;      /* [vocab] scratch copy of logits for the top_k threshold search */
    double *bsum;     /* [ceil(vocab / BLOCK)] sums of w per block of ids */
};

static float clamp_top(float v);

/* ---- random stream ---------------------------------------------------- */

static uint64_t rotl64(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

uint64_t cv_splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

void cv_rng_seed(cv_rng *r, uint64_t seed) {
    uint64_t x = seed;
    for (int i = 0; i < 4; i++) r->s[i] = cv_splitmix64(&x);
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
    p->n_logprobs = CV_NO_LOGPROBS;
    memset(&p->ctl, 0, sizeof p->ctl);
}

int cv_sampling_params_check(const cv_sampling_params *p, cv_err *err) {
    if (!p) return cv_set_err(err, CV_ERR_INVALID, "sampling params: NULL");
    /* the negated comparisons also reject NaN */
    if (!(p->temperature >= 0.0f && isfinite(p->temperature)))
        return cv_set_field_err(err, CV_ERR_INVALID, "temperature",
                                "temperature must be finite and >= 0, got %g", (double)p->temperature);
    if (!(p->top_p > 0.0f && p->top_p <= 1.0f))
        return cv_set_field_err(err, CV_ERR_INVALID, "top_p", "top_p must be in (0, 1], got %g",
                                (double)p->top_p);
    if (!(p->min_p >= 0.0f && p->min_p <= 1.0f))
        return cv_set_field_err(err, CV_ERR_INVALID, "min_p", "min_p must be in [0, 1], got %g",
                                (double)p->min_p);
    if (!(p->repetition_penalty > 0.0f && isfinite(p->repetition_penalty)))
        return cv_set_field_err(err, CV_ERR_INVALID, "repetition_penalty",
                                "repetition_penalty must be finite and > 0, got %g",
                                (double)p->repetition_penalty);
    if (!(p->presence_penalty >= -2.0f && p->presence_penalty <= 2.0f))
        return cv_set_field_err(err, CV_ERR_INVALID, "presence_penalty",
                                "presence_penalty must be in [-2, 2], got %g", (double)p->presence_penalty);
    if (!(p->frequency_penalty >= -2.0f && p->frequency_penalty <= 2.0f))
        return cv_set_field_err(err, CV_ERR_INVALID, "frequency_penalty",
                                "frequency_penalty must be in [-2, 2], got %g",
                                (double)p->frequency_penalty);
    if (p->top_k < -1)
        return cv_set_field_err(err, CV_ERR_INVALID, "top_k", "top_k must be -1, 0 (off) or >= 1, got %d",
                                (int)p->top_k);
    if (p->n_logprobs != CV_NO_LOGPROBS && (p->n_logprobs < 0 || p->n_logprobs > CV_MAX_LOGPROBS))
        return cv_set_field_err(err, CV_ERR_INVALID, "logprobs", "logprobs must be in [0, %d], got %d",
                                CV_MAX_LOGPROBS, (int)p->n_logprobs);
    return cv_logit_controls_check(&p->ctl, err);
}

/* ---- logit controls --------------------------------------------------- */

int cv_logit_controls_check(const cv_logit_controls *c, cv_err *err) {
    if (c->n_bias < 0 || (c->n_bias > 0 && (!c->bias_ids || !c->bias_values)))
        return cv_set_field_err(err, CV_ERR_INVALID, "logit_bias", "logit_bias: bad table");
    for (int32_t i = 0; i < c->n_bias; i++) {
        if (c->bias_ids[i] < 0)
            return cv_set_field_err(err, CV_ERR_INVALID, "logit_bias",
                                    "logit_bias keys must be token ids >= 0, got %d", c->bias_ids[i]);
        float v = c->bias_values[i];
        if (!(v >= -CV_MAX_LOGIT_BIAS && v <= CV_MAX_LOGIT_BIAS))
            return cv_set_field_err(err, CV_ERR_INVALID, "logit_bias",
                                    "logit_bias values must be in [-100, 100], got %g for token %d",
                                    (double)v, c->bias_ids[i]);
    }
    if (c->has_allowed && (c->n_allowed < 1 || !c->allowed_ids))
        return cv_set_field_err(err, CV_ERR_INVALID, "allowed_token_ids",
                                "allowed_token_ids must not be empty");
    for (int32_t i = 0; c->has_allowed && i < c->n_allowed; i++)
        if (c->allowed_ids[i] < 0)
            return cv_set_field_err(err, CV_ERR_INVALID, "allowed_token_ids",
                                    "allowed_token_ids must be token ids >= 0, got %d", c->allowed_ids[i]);
    if (c->n_bad_words < 0 || (c->n_bad_words > 0 && (!c->bad_word_start || !c->bad_word_tokens)))
        return cv_set_field_err(err, CV_ERR_INVALID, "bad_words", "bad_words: bad list");
    if (c->n_bad_words > 2 * CV_MAX_BAD_WORDS)
        return cv_set_field_err(err, CV_ERR_INVALID, "bad_words",
                                "bad_words gives %d token sequences; at most %d (%d words) are allowed",
                                (int)c->n_bad_words, 2 * CV_MAX_BAD_WORDS, CV_MAX_BAD_WORDS);
    for (int32_t w = 0; w < c->n_bad_words; w++) {
        if (c->bad_word_start[w + 1] <= c->bad_word_start[w])
            return cv_set_field_err(err, CV_ERR_INVALID, "bad_words",
                                    "bad_words[%d] is empty (it has no tokens)", w);
        for (int32_t j = c->bad_word_start[w]; j < c->bad_word_start[w + 1]; j++)
            if (c->bad_word_tokens[j] < 0)
                return cv_set_field_err(err, CV_ERR_INVALID, "bad_words", "bad_words: token id %d < 0",
                                        c->bad_word_tokens[j]);
    }
    return CV_OK;
}

int cv_logit_controls_check_vocab(const cv_logit_controls *c, int64_t vocab, cv_err *err) {
    for (int32_t i = 0; i < c->n_bias; i++)
        if (c->bias_ids[i] >= vocab)
            return cv_set_field_err(err, CV_ERR_INVALID, "logit_bias",
                                    "logit_bias key %d is outside the vocabulary [0, %lld)", c->bias_ids[i],
                                    (long long)vocab);
    for (int32_t i = 0; c->has_allowed && i < c->n_allowed; i++)
        if (c->allowed_ids[i] >= vocab)
            return cv_set_field_err(err, CV_ERR_INVALID, "allowed_token_ids",
                                    "allowed_token_ids contains %d, outside the vocabulary [0, %lld)",
                                    c->allowed_ids[i], (long long)vocab);
    int32_t n_tok = c->n_bad_words > 0 ? c->bad_word_start[c->n_bad_words] : 0;
    for (int32_t j = 0; j < n_tok; j++)
        if (c->bad_word_tokens[j] >= vocab)
            return cv_set_field_err(err, CV_ERR_INVALID, "bad_words",
                                    "bad_words: token id %d is outside the vocabulary [0, %lld)",
                                    c->bad_word_tokens[j], (long long)vocab);
    return CV_OK;
}

int cv_logit_controls_check_allowed(const cv_logit_controls *c, int64_t vocab, const int32_t *banned_a,
                                    int64_t n_a, const int32_t *banned_b, int64_t n_b, cv_err *err) {
    if (!c->has_allowed || c->n_allowed < 1 || vocab < 1) return CV_OK;
    unsigned char *banned = calloc((size_t)vocab, 1);
    if (!banned) return cv_set_err(err, CV_ERR_NOMEM, "out of memory checking allowed_token_ids");
    for (int64_t i = 0; i < n_a; i++)
        if (banned_a[i] >= 0 && banned_a[i] < vocab) banned[banned_a[i]] = 1;
    for (int64_t i = 0; i < n_b; i++)
        if (banned_b[i] >= 0 && banned_b[i] < vocab) banned[banned_b[i]] = 1;
    for (int32_t w = 0; w < c->n_bad_words; w++) {
        int32_t t = c->bad_word_tokens[c->bad_word_start[w]];
        if (c->bad_word_start[w + 1] - c->bad_word_start[w] == 1 && t >= 0 && t < vocab) banned[t] = 1;
    }
    int any = 0;
    for (int32_t i = 0; i < c->n_allowed && !any; i++)
        any = c->allowed_ids[i] >= 0 && c->allowed_ids[i] < vocab && !banned[c->allowed_ids[i]];
    free(banned);
    if (any) return CV_OK;
    return cv_set_field_err(err, CV_ERR_INVALID, "allowed_token_ids",
                            "every token in allowed_token_ids is banned at the first token (by bad_words, or "
                            "by min_tokens holding off EOS and the stop tokens): no token could be sampled");
}

int cv_logit_controls_copy(cv_logit_controls *dst, const cv_logit_controls *src, void **block) {
    *dst = *src;
    *block = NULL;
    int32_t n_tok = src->n_bad_words > 0 ? src->bad_word_start[src->n_bad_words] : 0;
    int32_t n_start = src->n_bad_words > 0 ? src->n_bad_words + 1 : 0;
    size_t n_i32 = (size_t)src->n_bias + (size_t)(src->has_allowed ? src->n_allowed : 0) +
                   (size_t)n_start + (size_t)n_tok;
    size_t n_f = (size_t)src->n_bias;
    if (n_i32 + n_f == 0) return CV_OK;
    char *b = malloc(n_i32 * sizeof(int32_t) + n_f * sizeof(float));
    if (!b) return CV_ERR_NOMEM;
    int32_t *ip = (int32_t *)b;
    float *fp = (float *)(ip + n_i32);
#define CV_TAKE(field, n)                                              \
    do {                                                               \
        if ((n) > 0) memcpy(ip, src->field, (size_t)(n) * sizeof *ip); \
        dst->field = ip;                                               \
        ip += (n);                                                     \
    } while (0)
    CV_TAKE(bias_ids, src->n_bias);
    CV_TAKE(allowed_ids, src->has_allowed ? src->n_allowed : 0);
    CV_TAKE(bad_word_start, n_start);
    CV_TAKE(bad_word_tokens, n_tok);
#undef CV_TAKE
    if (n_f) memcpy(fp, src->bias_values, n_f * sizeof *fp);
    dst->bias_values = fp;
    *block = b;
    return CV_OK;
}

/* Applies c to logits[V]: bias, then the allowed set (counts[] marks the
 * allowed ids and is left all zero), then the bad words against the output. */
static void apply_logit_controls(cv_sampler *s, float *logits, const cv_logit_controls *c,
                                 const int32_t *output, int64_t n_output) {
    const int64_t V = s->vocab;
    for (int32_t i = 0; i < c->n_bias; i++) {
        int32_t t = c->bias_ids[i];
        if (t >= 0 && t < V && logits[t] > -INFINITY) logits[t] = clamp_top(logits[t] + c->bias_values[i]);
    }
    if (c->has_allowed && c->n_allowed > 0) {
        int32_t *mark = s->counts;
        for (int32_t i = 0; i < c->n_allowed; i++)
            if (c->allowed_ids[i] >= 0 && c->allowed_ids[i] < V) mark[c->allowed_ids[i]] = 1;
        for (int64_t t = 0; t < V; t++) {
            if (!mark[t]) logits[t] = -INFINITY;
            mark[t] = 0;
        }
    }
    for (int32_t w = 0; w < c->n_bad_words; w++) {
        const int32_t *tok = c->bad_word_tokens + c->bad_word_start[w];
        int64_t len = c->bad_word_start[w + 1] - c->bad_word_start[w];
        if (len < 1 || len - 1 > n_output) continue;
        int match = 1;
        for (int64_t j = 0; j < len - 1 && match; j++)
            match = output[n_output - (len - 1) + j] == tok[j];
        if (match && tok[len - 1] >= 0 && tok[len - 1] < V) logits[tok[len - 1]] = -INFINITY;
    }
}

/* What the parameters mean after out-of-range values are made harmless. */
typedef struct eff_params {
    int greedy;
    float temperature; /* in [FLT_MIN, FLT_MAX] */
    int64_t top_k;     /* 0: off, else 1 < top_k < vocab */
    double top_p;      /* [0, 1]; 1: off */
    float min_p;       /* [0, 1]; 0: off */
} eff_params;

static void effective(eff_params *e, const cv_sampling_params *p, int64_t vocab) {
    float t = p->temperature;
    e->greedy = !(t > 0.0f) || p->top_k == 1; /* NaN temperature: greedy */
    /* kept where 1 / T is finite, so no 0 * inf appears in the weights */
    e->temperature = t > FLT_MAX ? FLT_MAX : (t < FLT_MIN ? FLT_MIN : t);
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
    size_t nb = (n + BLOCK - 1) / BLOCK;
    cv_sampler *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->vocab = vocab_size;
    s->counts = calloc(n, sizeof *s->counts);
    s->touched = malloc(n * sizeof *s->touched);
    s->cand = malloc(n * sizeof *s->cand);
    s->w = malloc(n * sizeof *s->w);
    s->raw = malloc(n * sizeof *s->raw);
    s->vals = malloc(n * sizeof *s->vals);
    s->bsum = malloc(nb * sizeof *s->bsum);
    if (!s->counts || !s->touched || !s->cand || !s->w || !s->raw || !s->vals || !s->bsum) {
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
    free(s->vals);
    free(s->bsum);
    free(s);
}

/* ---- vectorizable passes ---------------------------------------------- */

/* Largest value of x[0..n) (NaN-free), in eight lanes. */
CV_VECTOR_CLONES static float max_value(const float *x /* [n] */, int64_t n) {
    float lane[8];
    int64_t i = 0;
    for (int j = 0; j < 8; j++) lane[j] = -INFINITY;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) lane[j] = x[i + j] > lane[j] ? x[i + j] : lane[j];
    float m = -INFINITY;
    for (int j = 0; j < 8; j++) m = lane[j] > m ? lane[j] : m;
    for (; i < n; i++) m = x[i] > m ? x[i] : m;
    return m;
}

/* NaN -> -inf, +inf -> FLT_MAX in place, returning the largest value after
 * it: a slice at a time, sanitized and then its maximum taken while it is in
 * L1 (two loops that vectorize; one loop doing both did not), so a row that a
 * large vocabulary makes a megabyte is read from memory once. */
#define SANITIZE_SLICE 1024
CV_VECTOR_CLONES static float sanitize_max(float *x /* [n] */, int64_t n) {
    float m = -INFINITY;
    for (int64_t c = 0; c < n; c += SANITIZE_SLICE) {
        const int64_t end = c + SANITIZE_SLICE < n ? c + SANITIZE_SLICE : n;
        for (int64_t i = c; i < end; i++) {
            float v = x[i];
            v = v != v ? -INFINITY : v;
            x[i] = v > FLT_MAX ? FLT_MAX : v;
        }
        const float ms = max_value(x + c, end - c);
        m = ms > m ? ms : m;
    }
    return m;
}

/* Lowest id among the largest values (all -inf: 0): the maximum m (NaN:
 * not known yet), then the first block of 16 holding it (a test that
 * vectorizes), then its id. */
CV_VECTOR_CLONES static int32_t argmax(const float *x /* [n] */, int64_t n, float known_max) {
    const float m = known_max == known_max ? known_max : max_value(x, n);
    int64_t b = 0;
    for (; b + 16 <= n; b += 16) {
        int hit = 0;
        for (int j = 0; j < 16; j++) hit |= x[b + j] == m;
        if (hit) break;
    }
    for (int64_t i = b; i < n; i++)
        if (x[i] == m) return (int32_t)i;
    return 0;
}

/* exp(x) for x <= 0, within about 1e-7 relative, 0 below EXP_MIN; plain
 * arithmetic so that loops over it vectorize. x = n ln2 + r with |r| <= ln2/2
 * (ln2 split in two so n * hi is exact), exp(r) by its Taylor series to r^7,
 * 2^n built in the exponent bits. */
static inline float exp_nonpos(float x) {
    float xc = x < EXP_MIN ? EXP_MIN : (x > 0.0f ? 0.0f : x);
    float n = (xc * 1.44269504f + 12582912.0f) - 12582912.0f; /* round to nearest */
    float r = xc - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { int32_t i; float f; } two_n;
    two_n.i = ((int32_t)n + 127) << 23; /* n in [-126, 0]: a normal float */
    float y = p * two_n.f;
    return x < EXP_MIN ? 0.0f : y;
}

/* w[i] = exp((l[i] - m) * inv_t), 0 where that is below cut; bsum gets the
 * sums per block. Returns the total. */
CV_VECTOR_CLONES static double dense_weights(float *restrict w /* [n] */, double *restrict bsum /* [n/BLOCK] */,
                            const float *restrict l /* [n] */, int64_t n, float m, float inv_t,
                            float cut) {
    for (int64_t i = 0; i < n; i++) {
        float e = exp_nonpos((l[i] - m) * inv_t);
        w[i] = e < cut ? 0.0f : e;
    }
    double total = 0.0;
    for (int64_t b = 0; b * BLOCK < n; b++) {
        int64_t lo = b * BLOCK, hi = lo + BLOCK < n ? lo + BLOCK : n;
        float lane[8] = {0};
        int64_t i = lo;
        for (; i + 8 <= hi; i += 8)
            for (int j = 0; j < 8; j++) lane[j] += w[i + j];
        double sum = 0.0;
        for (int j = 0; j < 8; j++) sum += lane[j];
        for (; i < hi; i++) sum += w[i];
        bsum[b] = sum;
        total += sum;
    }
    return total;
}

/* sum of exp(x[i] - m) over x[0..n) */
CV_VECTOR_CLONES static double sum_exp(const float *x /* [n] */, int64_t n, float m) {
    float lane[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) lane[j] += exp_nonpos(x[i + j] - m);
    double sum = 0.0;
    for (int j = 0; j < 8; j++) sum += lane[j];
    for (; i < n; i++) sum += exp_nonpos(x[i] - m);
    return sum;
}

/* Whether any of x[0..16) exceeds thr (an OR of compares, vectorized). */
static int any_above16(const float *x /* [16] */, float thr) {
    int any = 0;
    for (int j = 0; j < 16; j++) any |= x[j] > thr;
    return any;
}

/* ---- penalties -------------------------------------------------------- */

/* Keeps a penalized logit out of +inf, so that later max-subtraction gives no NaN. */
static float clamp_top(float v) { return v > FLT_MAX ? FLT_MAX : v; }

/* Whether the logit controls or the penalties may change any logit (then
 * the maximum taken while sanitizing is taken again after them). */
static int may_change_logits(const cv_sampling_params *p, const int32_t *output, const int32_t *banned,
                             int64_t n_banned) {
    const cv_logit_controls *c = &p->ctl;
    const float rep = p->repetition_penalty, freq = p->frequency_penalty, pres = p->presence_penalty;
    return c->n_bias > 0 || c->has_allowed || c->n_bad_words > 0 ||
           (rep > 0.0f && isfinite(rep) && rep != 1.0f) ||
           (output && ((isfinite(freq) && freq != 0.0f) || (isfinite(pres) && pres != 0.0f))) ||
           (banned && n_banned > 0);
}

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

/* ---- selection -------------------------------------------------------- */

/* Total order used by every selection of ids: larger key first, lower id on ties. */
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

/* The value of rank r (0: the largest) of a[0..n), which it reorders. */
static float kth_largest(float *a /* [n] */, int64_t n, int64_t r) {
    int64_t lo = 0, hi = n - 1;
    while (hi - lo >= SMALL_RANGE) {
        int64_t mid = lo + (hi - lo) / 2;
        float x = a[lo], y = a[mid], z = a[hi];
        float pv = x > y ? (y > z ? y : (x > z ? z : x)) : (x > z ? x : (y > z ? z : y));
        int64_t i = lo, j = hi;
        /* Hoare: a[lo..j] >= pv >= a[i..hi], and everything between equals pv */
        while (i <= j) {
            while (a[i] > pv) i++;
            while (a[j] < pv) j--;
            if (i <= j) {
                float t = a[i];
                a[i] = a[j];
                a[j] = t;
                i++;
                j--;
            }
        }
        if (r <= j) hi = j;
        else if (r >= i) lo = i;
        else return pv;
    }
    for (int64_t i = lo + 1; i <= hi; i++) {
        float x = a[i];
        int64_t j = i;
        for (; j > lo && a[j - 1] < x; j--) a[j] = a[j - 1];
        a[j] = x;
    }
    return a[r];
}

/* Heap of the k best finite logits, the worst at the root. Blocks of 16 ids
 * with nothing above the root are skipped with one vectorized test. Returns
 * the heap's size. */
static int64_t heap_top_k(int32_t *heap /* [k] */, const float *l /* [vocab] */, int64_t vocab,
                          int64_t k) {
    int64_t n = 0;
    for (int64_t b = 0; b < vocab; b += 16) {
        int64_t end = b + 16 < vocab ? b + 16 : vocab;
        if (n == k && end - b == 16 && !any_above16(l + b, l[heap[0]])) continue;
        for (int64_t id = b; id < end; id++) {
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
    }
    return n;
}

/* Maximum of each block of 16 values: bm[b] = max x[16b .. 16b+16). */
CV_VECTOR_CLONES static void block_max16(float *restrict bm /* [n / 16] */, const float *restrict x /* [n] */,
                        int64_t n) {
    for (int64_t b = 0; b < n / 16; b++) {
        const float *v = x + 16 * b;
        float a[8];
        for (int j = 0; j < 8; j++) a[j] = v[j] > v[j + 8] ? v[j] : v[j + 8];
        for (int j = 0; j < 4; j++) a[j] = a[j] > a[j + 4] ? a[j] : a[j + 4];
        for (int j = 0; j < 2; j++) a[j] = a[j] > a[j + 2] ? a[j] : a[j + 2];
        bm[b] = a[0] > a[1] ? a[0] : a[1];
    }
}

/* The k best finite logits into cand by threshold: the k-th largest value,
 * then every id above it and the lowest ids equal to it. Returns k, or 0 when
 * no more than k logits are finite (top_k is then a no-op).
 * The k-th largest block maximum is a lower bound of the k-th largest value
 * (k blocks each hold a value at least that large), so the quickselect runs
 * only on the values at or above it, usually a few times k. */
static int64_t threshold_top_k(cv_sampler *s, const float *l /* [vocab] */, int64_t k) {
    const int64_t V = s->vocab;
    float *vals = s->vals;
    int64_t n_finite = 0;
    for (int64_t i = 0; i < V; i++) n_finite += l[i] > -INFINITY;
    if (n_finite <= k) return 0;
    float bound = -INFINITY;
    if (k <= V / 16) {
        block_max16(vals, l, V);
        bound = kth_largest(vals, V / 16, k - 1);
    }
    int64_t nv = 0;
    if (bound > -INFINITY) {
        for (int64_t i = 0; i < V; i++) {
            vals[nv] = l[i]; /* branch-free compaction: nv <= i */
            nv += l[i] >= bound;
        }
    }
    if (nv < k) { /* no usable bound: select among all values */
        memcpy(vals, l, (size_t)V * sizeof *l);
        nv = V;
    }
    float thr = kth_largest(vals, nv, k - 1);
    int64_t above = 0;
    for (int64_t i = 0; i < V; i++) above += l[i] > thr;
    int64_t ties = k - above, n = 0;
    for (int64_t i = 0; i < V; i++) {
        if (l[i] > thr) s->cand[n++] = (int32_t)i;
        else if (l[i] == thr && ties > 0) {
            s->cand[n++] = (int32_t)i;
            ties--;
        }
    }
    return n;
}

/* Keeps the smallest best-first prefix of c[0..n) whose weight reaches need;
 * returns its length (>= 1). Quickselect on mass: the prefix comes out
 * unsorted and only the range around the boundary is ever sorted. */
static int64_t top_p_prefix(int32_t *c, int64_t n, const float *w, double need) {
    if (n <= 1) return n;
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

/* Candidates for the nucleus from dense weights: drops tails of the order
 * (all weights below some tau) whose mass stays below `budget` (the
 * (1 - top_p) share of the total), since no such tail reaches into the
 * nucleus. Tokens below tau hold less than count * tau, so tau = what is left
 * of the budget / count, repeated while it shrinks the set (0.999 leaves room
 * for rounding). Sums run in lanes and compactions without branches, so each
 * round is a few cheap passes. Returns the count in cand. */
static int64_t nucleus_candidates(int32_t *cand /* [vocab] */, const float *w /* [vocab] */,
                                  int64_t vocab, double total, double budget) {
    budget *= 0.999;
    /* tau > 0 since top_p < 1 and total >= 1, so -inf logits (w = 0) drop out */
    float tau = (float)(budget / (double)vocab);
    float lane[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= vocab; i += 8)
        for (int j = 0; j < 8; j++) lane[j] += w[i + j] >= tau ? w[i + j] : 0.0f;
    double kept = 0.0;
    for (int j = 0; j < 8; j++) kept += lane[j];
    for (; i < vocab; i++) kept += w[i] >= tau ? w[i] : 0.0f;
    int64_t n = 0;
    for (i = 0; i < vocab; i++) {
        cand[n] = (int32_t)i; /* n <= i */
        n += w[i] >= tau;
    }
    double left = budget - (total - kept);
    for (int round = 0; round < 8 && left > 0.0 && n > 1; round++) {
        tau = (float)(left / (double)n);
        float drop[4] = {0};
        for (i = 0; i + 4 <= n; i += 4)
            for (int j = 0; j < 4; j++) {
                float wi = w[cand[i + j]];
                drop[j] += wi < tau ? wi : 0.0f;
            }
        double dropped = (double)drop[0] + drop[1] + drop[2] + drop[3];
        for (; i < n; i++) dropped += w[cand[i]] < tau ? w[cand[i]] : 0.0f;
        int64_t m = 0;
        for (i = 0; i < n; i++) {
            cand[m] = cand[i];
            m += w[cand[i]] >= tau;
        }
        left -= dropped;
        int shrunk = m < n - n / 8;
        n = m;
        if (!shrunk) break;
    }
    return n;
}

/* The tokens a draw may pick. Dense: w (and bsum) hold the weights of every
 * id, 0 where excluded. Sparse: cand[0..n) holds them, w valid there. */
typedef struct support {
    int dense;
    int64_t n;    /* sparse: candidates; dense: 1, or 0 when every logit is -inf */
    double total; /* dense: the sum of w */
    int id_order; /* sparse: cand ascending by id */
    float cut;    /* dense: the min_p threshold folded into w */
} support;

static void build_support(support *sup, cv_sampler *s, const float *l /* [vocab] */,
                          const eff_params *e, float known_max /* NaN: not known */) {
    const int64_t V = s->vocab;
    int32_t *cand = s->cand;
    float *w = s->w;
    const float inv_t = 1.0f / e->temperature;
    memset(sup, 0, sizeof *sup);
    int64_t n = 0;
    if (e->top_k > 0 && e->top_k <= HEAP_MAX_K) {
        n = heap_top_k(cand, l, V, e->top_k);
        if (n == 0) return; /* every logit -inf */
    } else if (e->top_k > 0) {
        n = threshold_top_k(s, l, e->top_k);
        sup->id_order = n > 0; /* gathered in id order */
    }
    if (n > 0) {
        float m = l[cand[0]];
        for (int64_t i = 1; i < n; i++) m = l[cand[i]] > m ? l[cand[i]] : m;
        for (int64_t i = 0; i < n; i++) w[cand[i]] = exp_nonpos((l[cand[i]] - m) * inv_t);
        if (e->top_p < 1.0) {
            double total = 0.0;
            for (int64_t i = 0; i < n; i++) total += w[cand[i]];
            n = top_p_prefix(cand, n, w, e->top_p * total);
            sup->id_order = 0;
        }
    } else {
        /* the whole vocabulary (top_k off, or no more finite logits than k) */
        float m = known_max == known_max ? known_max : max_value(l, V);
        if (m == -INFINITY) return;
        /* min_p only drops a tail below a threshold, so without top_p before
         * it, it folds into the weights */
        float cut = e->top_p < 1.0 ? 0.0f : e->min_p;
        double total = dense_weights(w, s->bsum, l, V, m, inv_t, cut);
        if (e->top_p >= 1.0) {
            sup->dense = 1;
            sup->n = 1;
            sup->total = total;
            sup->cut = cut;
            return;
        }
        n = nucleus_candidates(cand, w, V, total, (1.0 - e->top_p) * total);
        n = top_p_prefix(cand, n, w, e->top_p * total);
    }
    if (e->min_p > 0.0f) {
        /* the best token has weight 1, so the threshold is min_p itself */
        int64_t j = 0;
        for (int64_t i = 0; i < n; i++) {
            cand[j] = cand[i]; /* branch-free compaction */
            j += !(w[cand[i]] < e->min_p);
        }
        n = j;
    }
    sup->n = n;
}

static int cmp_id(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* Last id in [0, vocab) with a positive weight: the answer when rounding lets
 * the running sum fall short of the target. */
static int32_t last_positive(const float *w, int64_t vocab) {
    for (int64_t i = vocab - 1; i > 0; i--)
        if (w[i] > 0.0f) return (int32_t)i;
    return 0;
}

/* Inverts the CDF of the support taken in increasing id order at u. */
static int32_t draw(cv_sampler *s, const support *sup, double u) {
    int32_t *cand = s->cand;
    const float *w = s->w;
    const int64_t V = s->vocab;
    double cum = 0.0;
    if (sup->n <= 0) return 0;
    if (sup->dense) {
        const double target = u * sup->total;
        int64_t nb = (V + BLOCK - 1) / BLOCK, b = 0;
        for (; b < nb && !(cum + s->bsum[b] > target); b++) cum += s->bsum[b];
        for (int64_t i = b * BLOCK; i < V; i++) {
            cum += w[i];
            if (cum > target && w[i] > 0.0f) return (int32_t)i;
        }
        return last_positive(w, V);
    }
    int64_t n = sup->n;
    if (n == 1) return cand[0];
    double total = 0.0;
    for (int64_t i = 0; i < n; i++) total += w[cand[i]];
    const double target = u * total;
    int32_t last_pos = cand[0];
    if (!sup->id_order && n * 64 > V) {
        /* many survivors: mark them and walk the vocabulary, cheaper than sorting */
        int32_t *mark = s->counts;
        int32_t found = -1;
        for (int64_t i = 0; i < n; i++) mark[cand[i]] = 1;
        for (int64_t id = 0; id < V; id++) {
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
    if (!sup->id_order) {
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

/* ---- logprobs --------------------------------------------------------- */

static int64_t count_above(const float *a, int64_t n, float x) {
    int64_t c = 0;
    for (int64_t i = 0; i < n; i++) c += a[i] > x;
    return c;
}

static void fill_logprobs(cv_sample_info *info, const float *raw /* [vocab] */, int64_t vocab,
                          int32_t token, int32_t n_logprobs, float m /* max_value(raw) */) {
    /* all -inf: lse = +inf makes every logprob -inf without inf - inf */
    double lse = m == -INFINITY ? INFINITY : (double)m + log(sum_exp(raw, vocab, m));
    info->logprob = (float)((double)raw[token] - lse);
    int64_t k = n_logprobs > CV_MAX_LOGPROBS ? CV_MAX_LOGPROBS : n_logprobs;
    if (k > vocab) k = vocab;
    int32_t *top = info->top_ids;
    int64_t n = 0;
    /* sorted insertion into at most 20 entries; once full, blocks with
     * nothing above the last entry are skipped */
    for (int64_t b = 0; b < vocab && k > 0; b += 16) {
        int64_t end = b + 16 < vocab ? b + 16 : vocab;
        if (n == k && end - b == 16 && !any_above16(raw + b, raw[top[n - 1]])) continue;
        for (int64_t i = b; i < end; i++) {
            if (n == k && !(raw[i] > raw[top[n - 1]])) continue;
            int64_t j = n < k ? n++ : k - 1;
            for (; j > 0 && raw[i] > raw[top[j - 1]]; j--) top[j] = top[j - 1];
            top[j] = (int32_t)i;
        }
    }
    info->n_top = (int32_t)n;
    for (int64_t j = 0; j < n; j++) info->top_logprobs[j] = (float)((double)raw[top[j]] - lse);
    info->rank = 0;
    for (int64_t j = 0; j < n && !info->rank; j++)
        if (top[j] == token) info->rank = j + 1;
    if (!info->rank) info->rank = 1 + count_above(raw, vocab, raw[token]);
}

void cv_logprobs_of(float *logits, int64_t vocab, int32_t token, int32_t n_top, cv_sample_info *info) {
    const float m = sanitize_max(logits, vocab);
    fill_logprobs(info, logits, vocab, token, n_top < 0 ? 0 : n_top, m);
}

/* ---- entry points ----------------------------------------------------- */

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
        info->no_token = 0;
    }
    const float raw_max = sanitize_max(logits, V);
    const int want_lp = info && p->n_logprobs >= 0;
    if (want_lp) memcpy(s->raw, logits, (size_t)V * sizeof *logits);
    const float m = may_change_logits(p, output, banned, n_banned) ? NAN : raw_max;
    apply_logit_controls(s, logits, &p->ctl, output, output ? n_output : 0);
    apply_penalties(s, logits, p, prompt, n_prompt, output, n_output, banned, n_banned);
    int32_t token;
    if (e.greedy) {
        token = argmax(logits, V, m);
    } else {
        /* draw first: one draw per token whatever the support turns out to be */
        double u = cv_rng_uniform(rng);
        support sup;
        build_support(&sup, s, logits, &e, m);
        token = draw(s, &sup, u);
    }
    if (want_lp) fill_logprobs(info, s->raw, V, token, p->n_logprobs, raw_max);
    /* only a token at -inf when every one is: nothing was left to choose */
    if (info) info->no_token = logits[token] == -INFINITY;
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
    const float raw_max = sanitize_max(logits, V);
    const float m = may_change_logits(p, output, banned, n_banned) ? NAN : raw_max;
    apply_logit_controls(s, logits, &p->ctl, output, output ? n_output : 0);
    apply_penalties(s, logits, p, prompt, n_prompt, output, n_output, banned, n_banned);
    for (int64_t i = 0; i < V; i++) out[i] = -INFINITY;
    if (e.greedy) {
        int32_t t = argmax(logits, V, m);
        out[t] = logits[t];
        return;
    }
    support sup;
    build_support(&sup, s, logits, &e, m);
    if (sup.dense) {
        /* every finite logit, less what min_p zeroed (weights that underflow
         * to 0 stay in the support: they are merely too small to draw) */
        for (int64_t i = 0; i < V; i++)
            if (logits[i] > -INFINITY && (sup.cut == 0.0f || s->w[i] > 0.0f))
                out[i] = logits[i] / e.temperature;
        return;
    }
    for (int64_t i = 0; i < sup.n; i++) out[s->cand[i]] = logits[s->cand[i]] / e.temperature;
}

/* ------------------------------------------------------------------------- */
/* Guided decoding: the grammar's token mask */

void cv_sampler_apply_token_mask(float *logits, int64_t vocab, const uint32_t *mask) {
    for (int64_t w = 0; w * 32 < vocab; w++) {
        uint32_t m = mask[w];
        if (m == UINT32_MAX) continue;
        int64_t end = (w + 1) * 32 < vocab ? (w + 1) * 32 : vocab;
        for (int64_t t = w * 32; t < end; t++)
            if (!((m >> (t - w * 32)) & 1u)) logits[t] = -INFINITY;
    }
}
