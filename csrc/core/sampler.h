/* Logits processing and sampling, with a random stream per sequence.
 * Same seed -> same tokens, whatever else shares the batch. */
#ifndef CV_SAMPLER_H
#define CV_SAMPLER_H

#include <stdint.h>
#include "../../base/common.h"

#define CV_MAX_LOGPROBS 20
#define CV_NO_LOGPROBS INT32_MIN /* n_logprobs: none wanted */

/* ---- logit controls (logit_bias, allowed_token_ids, bad_words) ---------- */
#define CV_MAX_LOGIT_BIAS 100.0f /* |bias| limit, OpenAI's */
/* bad_words per request; each word becomes up to two token sequences (as
 * written and with a leading space), so n_bad_words <= 2 * CV_MAX_BAD_WORDS.
 * Every sampled token checks every sequence, and the words are tokenized
 * before the request is queued: the cap bounds both. */
#define CV_MAX_BAD_WORDS 1024

/* Per-request edits of the logits before sampling; all zero: none. The arrays
 * are borrowed (the engine keeps owned copies, cv_logit_controls_copy). */
typedef struct cv_logit_controls {
    int32_t n_bias;                 /* logit_bias: logits[bias_ids[i]] += bias_values[i] */
    const int32_t *bias_ids;
    const float *bias_values;       /* [-CV_MAX_LOGIT_BIAS, CV_MAX_LOGIT_BIAS] */
    int has_allowed;                /* allowed_token_ids given: every other token -> -inf */
    int32_t n_allowed;              /* >= 1 when has_allowed */
    const int32_t *allowed_ids;
    int32_t n_bad_words;            /* bad_words, as token sequences: word w is */
    const int32_t *bad_word_start;  /* bad_word_tokens[bad_word_start[w] .. bad_word_start[w+1]) */
    const int32_t *bad_word_tokens; /* its last token is banned when the output ends with the rest */
} cv_logit_controls;

typedef struct cv_sampling_params {
    float temperature;        /* 0: greedy (argmax) */
    float top_p;              /* (0, 1] */
    float min_p;              /* [0, 1] */
    float repetition_penalty; /* > 0; 1: off. Applies to prompt and output tokens */
    float presence_penalty;   /* [-2, 2]; applies to output tokens */
    float frequency_penalty;  /* [-2, 2]; applies to output tokens */
    int32_t top_k;            /* 0 or -1: off */
    int32_t n_logprobs;       /* CV_NO_LOGPROBS: none; 0..CV_MAX_LOGPROBS: sampled token plus that many top tokens */
    cv_logit_controls ctl;    /* applied after the raw copy for logprobs, before penalties */
} cv_sampling_params;

/* splitmix64: advances *x and returns the next output. */
uint64_t cv_splitmix64(uint64_t *x);

/* xoshiro256** stream; cv_rng_seed fills the state with four splitmix64
 * outputs of seed. */
typedef struct cv_rng { uint64_t s[4]; } cv_rng;
void cv_rng_seed(cv_rng *r, uint64_t seed);
uint64_t cv_rng_next(cv_rng *r);
double cv_rng_uniform(cv_rng *r); /* [0, 1) */

typedef struct cv_sample_info {
    float logprob;                         /* log-softmax of the raw logits at the chosen token */
    int32_t n_top;
    int32_t top_ids[CV_MAX_LOGPROBS];      /* most likely tokens under the raw logits */
    float top_logprobs[CV_MAX_LOGPROBS];
    int64_t rank;                          /* the chosen token's rank under the raw logits (1: the
                                            * most likely): its place in top_ids, else 1 + the
                                            * tokens above it */
    int32_t no_token;                      /* 1: the controls, bans and mask left every token at -inf,
                                            * so the token returned (0) is no choice at all */
} cv_sample_info;

typedef struct cv_sampler cv_sampler;

/* Scratch for one vocabulary size; not shared between threads. */
cv_sampler *cv_sampler_create(int64_t vocab_size);
void cv_sampler_destroy(cv_sampler *s);

/* Chooses the next token from logits[vocab] (modified in place).
 * prompt/output: the sequence's tokens, for penalties.
 * banned[n_banned]: tokens forced to -inf (min_tokens holding off EOS/stop ids).
 * info (may be NULL) receives logprobs when p->n_logprobs >= 0.
 * NaN logits count as -inf, +inf as FLT_MAX. A non-greedy call takes exactly
 * one cv_rng_uniform draw and inverts the CDF over the surviving tokens in
 * increasing id order, so the token depends only on the logits, params and u.
 * Every token at -inf -> token 0, with info->no_token set: callers must not
 * take it as a sample. Returns -1 only when s, logits or p is NULL,
 * or rng is NULL for a non-greedy draw. */
int32_t cv_sampler_sample(cv_sampler *s, float *logits, const cv_sampling_params *p,
                          const int32_t *prompt, int64_t n_prompt,
                          const int32_t *output, int64_t n_output,
                          const int32_t *banned, int64_t n_banned,
                          cv_rng *rng, cv_sample_info *info);

/* Guided decoding: logits[t] = -inf for every token t whose bit (bit t%32 of
 * mask[t/32]) is clear; mask has (vocab + 31) / 32 words. Applied before
 * cv_sampler_sample, only to constrained sequences. */
void cv_sampler_apply_token_mask(float *logits, int64_t vocab, const uint32_t *mask);

/* Neutral parameters: temperature 1, top_p 1, top_k off, min_p 0, penalties off,
 * no logprobs. */
void cv_sampling_params_init(cv_sampling_params *p);

/* Checks every field's range; returns CV_OK or CV_ERR_INVALID with err->field
 * set to the field (SamplingParams' name: "logprobs" for n_logprobs). cv_sampler_sample itself never fails on bad values
 * (it treats NaN/out-of-range fields as "off"), so callers check first. */
int cv_sampling_params_check(const cv_sampling_params *p, cv_err *err);

/* Ranges that need no vocabulary (err->field: "logit_bias", "allowed_token_ids",
 * "bad_words"); cv_sampling_params_check calls it. */
int cv_logit_controls_check(const cv_logit_controls *c, cv_err *err);
/* Every token id of c below vocab. */
int cv_logit_controls_check_vocab(const cv_logit_controls *c, int64_t vocab, cv_err *err);
/* Deep copy of src's arrays into *dst (one allocation, *block, to free()). */
/* Whether any of allowed_token_ids survives the first token's bans: a bad word of
 * one token, or banned_a[n_a] / banned_b[n_b] (min_tokens holding off EOS and the
 * stop tokens). None left: CV_ERR_INVALID naming "allowed_token_ids" (a request
 * that could only ever sample a token outside its constraints). */
int cv_logit_controls_check_allowed(const cv_logit_controls *c, int64_t vocab, const int32_t *banned_a,
                                    int64_t n_a, const int32_t *banned_b, int64_t n_b, cv_err *err);
int cv_logit_controls_copy(cv_logit_controls *dst, const cv_logit_controls *src, void **block);

/* Logprobs of token (and the n_top most likely tokens, n_top <= CV_MAX_LOGPROBS)
 * under the log-softmax of logits[vocab] (sanitized in place: NaN -> -inf). */
void cv_logprobs_of(float *logits, int64_t vocab, int32_t token, int32_t n_top,
                    cv_sample_info *info);

/* Test hook: runs the same processing as cv_sampler_sample without drawing and
 * writes the log-weights the draw would use to out[vocab]: logit / temperature
 * at the tokens that survive penalties, bans, top_k, top_p and min_p, -inf
 * elsewhere, so softmax(out) is the sampling distribution. Greedy parameters
 * leave only the argmax finite (its processed logit). logits is modified in place. */
void cv_sampler_process(cv_sampler *s, float *out, float *logits, const cv_sampling_params *p,
                        const int32_t *prompt, int64_t n_prompt,
                        const int32_t *output, int64_t n_output,
                        const int32_t *banned, int64_t n_banned);

#endif
