/* Speculative decoding with a draft model: a second, smaller model with the
 * target's vocabulary proposes the next k tokens of each decoding sequence by
 * greedy decoding; the target verifies them in its own batched step
 * (engine_sample.c).
 *
 * The draft runs on a model worker of its own (worker.h: its model, forward
 * workspace, runner, paged KV cache and KV manager), on the target's backend.
 * Each sequence it proposes for has a draft-side cv_sequence (a copy of the
 * tokens it has computed, and a block table in the draft's KV manager). Before proposing, that copy is compared with the target's
 * tokens: the draft KV stays valid for their common prefix, so a rejected
 * proposal rolls back by itself (its positions are recomputed) and nothing
 * outside this file tracks draft state. A sequence the draft is not asked
 * about in a round (finished, preempted, or the batch too large to
 * speculate) gives its draft blocks back.
 *
 * Greedy proposals are point masses, so the target's rejection rule (accept d
 * with probability p(d), else draw from p without d) keeps every output
 * distributed exactly as without speculation. */
#ifndef CV_DRAFT_H
#define CV_DRAFT_H

#include <stdatomic.h>
#include <stdint.h>
#include "../../kernels/backend.h"
#include "../../base/common.h"
#include "sequence.h"

typedef struct cv_draft cv_draft;

typedef struct cv_draft_config {
    const char *path;           /* the draft checkpoint */
    cv_dtype dtype, quantization; /* as the target's config */
    int64_t target_vocab;       /* the draft's must equal it */
    int64_t max_model_len;      /* the target's */
    int64_t max_seqs;           /* sequences proposed for in one round */
    int64_t max_tokens;         /* tokens one draft pass may compute */
    int64_t block_size;
    int64_t max_k;              /* most proposals per sequence */
    size_t kv_bytes_cap;        /* its KV cache at most this (at least one full sequence); 0: no cap */
} cv_draft_config;

/* Loads the draft and sizes its KV cache for max_seqs sequences of
 * max_model_len tokens. Errors name the field "model". */
int cv_draft_create(cv_draft **out, const cv_draft_config *cfg, cv_backend *b, const atomic_int *cancel,
                    cv_err *err);
void cv_draft_destroy(cv_draft *d);

/* Proposes for seqs[n] (decoding target sequences, n <= max_seqs): up to
 * want[i] tokens into out[i * max_k ...], their count into got[i] (0 when the
 * draft could not: no KV blocks, or the context is past the draft's). Draft
 * state of sequences not in seqs is released first. */
int cv_draft_propose(cv_draft *d, cv_sequence *const *seqs, const int64_t *want, int64_t n, int32_t *out,
                     int64_t *got, cv_err *err);

/* Releases every sequence's draft state (speculation is off this step). */
void cv_draft_release_all(cv_draft *d);

/* Tokens the draft has run through its model, in all. */
int64_t cv_draft_tokens_computed(const cv_draft *d);
/* KV blocks its sequences hold now. */
int64_t cv_draft_blocks_used(const cv_draft *d);
/* For tests: the draft pool's checker, with every block's reference count
 * against the draft sequences' block tables. */
int cv_draft_check(const cv_draft *d, cv_err *err);

#endif
