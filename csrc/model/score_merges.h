/* BPE merges derived from SentencePiece scores (GGUF "llama" tokenizers carry
 * tokens and scores, no merges).
 *
 * SentencePiece's BPE encoder repeatedly joins the adjacent pair whose join is
 * the best-scoring token. The same result comes from a BPE merge list holding
 * every split (a, b) of every token t with a and b in the vocabulary, ordered
 * by t's score (best first), then by the ids of t, a and b. Only tokens of
 * type normal or user-defined, of 2 to max_token_chars characters, are split;
 * a text that occurs under several ids is known by its first id.
 *
 * Cost: one hash table of the vocabulary (vocab_table.h), then one pass over
 * each token's bytes with rolling prefix/suffix hashes, so the time is
 * linear in the tokens' bytes plus the merges found; the merges found are
 * capped by max_merges (the caller's budget), beyond which the build stops
 * with CV_ERR_FORMAT before allocating more. */
#ifndef CV_MODEL_SCORE_MERGES_H
#define CV_MODEL_SCORE_MERGES_H

#include <stddef.h>
#include <stdint.h>
#include "../../base/common.h"
#include "vocab_table.h"

typedef struct cv_score_merges {
    int32_t *left;  /* token id of each merge's left part [n] */
    int32_t *right; /* token id of each merge's right part [n] */
    int64_t n;
} cv_score_merges;

/* Fills out with the merges of tokens [n_tokens], scores [n_tokens] and types
 * [n_tokens] (NULL: all normal); seed picks the hash (any value gives the same
 * merges). More than max_merges merges, a NaN score or
 * more than INT32_MAX tokens is CV_ERR_FORMAT; CV_ERR_NOMEM when out of
 * memory. out is zeroed on error; free it with cv_score_merges_free. */
int cv_score_merges_build(cv_score_merges *out, const cv_token_text *tokens, const double *scores,
                          const int32_t *types, int64_t n_tokens, int max_token_chars, int64_t max_merges,
                          uint64_t seed, cv_err *err);
void cv_score_merges_free(cv_score_merges *m);

#endif
