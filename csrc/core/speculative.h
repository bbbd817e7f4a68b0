/* Speculative decoding: the configuration and where proposals come from.
 * The n-gram method (prompt lookup) proposes, for a sequence whose last few
 * tokens already occurred earlier in its own prompt or output, the tokens
 * that followed that earlier occurrence. The engine appends them to the
 * sequence (seq->n_spec) before a schedule; the step verifies them in the
 * same ragged batch (one logits row per proposal + 1) and keeps the longest
 * prefix the model itself would have produced. */
#ifndef CV_SPECULATIVE_H
#define CV_SPECULATIVE_H

#include <stdint.h>
#include "../../base/common.h"

#define CV_SPEC_MAX_TOKENS 16   /* most proposals per sequence and step */
#define CV_SPEC_MAX_NGRAM 64    /* longest suffix n-gram looked up */

/* NGRAM: prompt lookup; DRAFT: a draft model's greedy tokens (draft.h) */
typedef enum cv_spec_method { CV_SPEC_NONE = 0, CV_SPEC_NGRAM = 1, CV_SPEC_DRAFT = 2 } cv_spec_method;

typedef struct cv_spec_config {
    cv_spec_method method;
    int64_t num_tokens;            /* k: proposals per sequence and step, [1, CV_SPEC_MAX_TOKENS] */
    int64_t lookup_min, lookup_max;/* NGRAM: lengths tried, longest first, 1 <= min <= max <= CV_SPEC_MAX_NGRAM */
    const char *draft_model;       /* DRAFT: the draft checkpoint's path */
    int64_t disable_by_batch_size; /* no proposals in a step while more sequences run; 0: never */
} cv_spec_config;

/* Checks every field (err->field names the one at fault, as in
 * speculative_config). CV_SPEC_NONE is always valid. */
int cv_spec_config_check(const cv_spec_config *c, cv_err *err);

/* Prompt lookup: the longest suffix of tokens[n] of length in
 * [lookup_min, lookup_max] that also occurs earlier (the latest such
 * occurrence); writes up to k tokens that followed it into out[k]. Returns
 * how many (0: no match). */
int64_t cv_spec_ngram_propose(int32_t *out, const int32_t *tokens, int64_t n, int64_t lookup_min,
                              int64_t lookup_max, int64_t k);

#endif
