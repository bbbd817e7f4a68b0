/* Iteration-level scheduler: decides, at every step, which sequences run and
 * how many new tokens each computes, under a token budget and a sequence cap.
 * Policy only: queues, token budget, the admission margin that leaves room for
 * the running sequences' growth, preemption victims (the newest first; a
 * victim's KV stays reclaimable and resuming takes back what was not reused).
 * Knows nothing about devices; every block goes through the KV manager it is
 * given. */
#ifndef CV_SCHEDULER_H
#define CV_SCHEDULER_H

#include <stdint.h>
#include "../../base/common.h"
#include "kv_manager.h"
#include "sequence.h"

typedef enum cv_sched_policy {
    CV_SCHED_CONTINUOUS = 0, /* continuous batching; never-admitted sequences start in
                              * order of their virtual finish (arrival on the clock of
                              * tokens planned, plus expected work): shortest expected
                              * work first among those that arrived close together,
                              * and none waits longer than its own work behind later ones */
    CV_SCHED_PRIORITY = 1,   /* continuous, waiting queue ordered by (priority, arrival);
                              * a better-ranked waiting sequence that cannot start
                              * preempts the worst-ranked running one */
    CV_SCHED_STATIC = 2,     /* admit only when nothing runs; run the batch to completion */
    CV_SCHED_FCFS = 3        /* continuous batching, strictly in arrival order */
} cv_sched_policy;

typedef struct cv_scheduler_config {
    int64_t max_num_seqs;           /* cap on running sequences */
    int64_t max_num_batched_tokens; /* token budget per step */
    int64_t max_model_len;          /* most tokens one sequence may hold */
    int enable_chunked_prefill;
    cv_sched_policy policy;
    /* Stall-free mixed steps (chunked prefill only): while any running
     * sequence decodes, a step carries at most this many prompt tokens
     * (prefill chunks, recomputation after preemption), so the decodes' time
     * between tokens stays bounded while prompts arrive. 0: no cap. */
    int64_t max_prefill_tokens_while_decoding;
    /* Admission margin (continuous and priority policies): a waiting sequence
     * starts only when the free blocks cover its own growth and the running
     * sequences' growth to their expected lengths at the worst moment ahead:
     * each one's next token and this percentage of the expected remaining
     * output (the output tokens seen so far, running ones included, over the
     * outputs that ended by a stop; an output cut at its max_tokens is
     * censored), never beyond its max_tokens; before any stop, its
     * max_tokens. A decoding sequence that reaches its max_tokens within that
     * horizon gives its blocks back there, so the room needed is the peak of
     * the growth of those still running, not the sum of every growth. Under
     * the priority policy only the growth of sequences ranked at or above it
     * counts (the others can be preempted for it). A sequence that would run
     * alone starts as soon as its first chunk fits.
     * 0: the default, CV_SCHED_DEFAULT_RESERVE; -1: no margin, a sequence
     * starts whenever its first chunk fits (and the running ones are
     * preempted when they outgrow the pool). */
    int32_t admission_reserve;
} cv_scheduler_config;

/* Chosen by measurement (tools/admission_sweep.py; docs/dev/admission.md). */
#define CV_SCHED_DEFAULT_RESERVE 50
#define CV_SCHED_MAX_RESERVE 10000

/* The plan for one step: one plain struct, all the runner needs.
 * Arrays are owned by the scheduler and valid until the next schedule call. */
typedef struct cv_sched_output {
    int64_t n_seqs;
    cv_sequence **seqs;        /* [n_seqs] scheduled sequences */
    int32_t *num_new_tokens;   /* [n_seqs] tokens each computes this step (>= 1) */
    int64_t *start_pos;        /* [n_seqs] seq->n_computed when scheduled: first new position */
    int64_t total_tokens;      /* sum of num_new_tokens */
    cv_sequence **preempted;   /* [n_preempted] sequences preempted this step (now waiting) */
    int64_t n_preempted;
} cv_sched_output;

typedef struct cv_sched_stats {
    int64_t n_running, n_waiting;
    int64_t n_preempted_total;     /* preemptions since creation */
    int64_t n_recomputed_tokens;   /* tokens of KV computed before a preemption and computed again */
    int64_t n_resumed_tokens;      /* tokens of KV resumed sequences took back instead */
    int64_t admission_reserve_tokens; /* output tokens admission reserves per sequence now, -1: max_tokens */
    int64_t running_target;        /* running sequences admission stops at now (max_num_seqs when unset) */
    int64_t n_limited_steps;       /* steps planned with decodes held back (cv_scheduler_limit_next_decodes) */
    int64_t blocks_total;          /* usable blocks (excluding block 0) */
    int64_t blocks_used;           /* referenced by at least one sequence */
    int64_t blocks_free;           /* free (including evictable cached ones) */
    int64_t blocks_cached_free;    /* free blocks still holding a cached prefix */
    int64_t blocks_touched;        /* blocks ever handed out (their KV memory written) */
    int64_t tokens_in_kv;          /* sum over running sequences of held tokens */
    double kv_waste;               /* 1 - tokens_in_kv / (blocks_used * block_size), 0 when none used */
    int64_t prefix_queries;        /* prompt tokens looked up in the prefix cache */
    int64_t prefix_hits;           /* of which served from the cache */
    int64_t steps;
} cv_sched_stats;

typedef struct cv_scheduler cv_scheduler;

/* kv (borrowed, outliving the scheduler) holds the blocks and the prefix
 * cache; the scheduler is its only user while it lives. */
cv_scheduler *cv_scheduler_create(const cv_scheduler_config *cfg, cv_kv_manager *kv, cv_err *err);
void cv_scheduler_destroy(cv_scheduler *s);

/* Queues a new sequence (status NEW -> WAITING). Refuses (CV_ERR_INVALID,
 * message says why) a sequence that can never fit: max_total beyond
 * max_model_len or needing more blocks than the whole cache. Stamps
 * seq->arrival (add order; a fork takes its parent's). The caller keeps
 * n_tokens <= max_total and frees a sequence only after it finished and the
 * plan holding it was committed. */
int cv_scheduler_add(cv_scheduler *s, cv_sequence *seq, cv_err *err);

/* Adds child as a fork of parent (n > 1 completions), once parent's prompt is
 * computed: child shares parent's full prompt blocks (ref counts up) and
 * recomputes the rest. child holds the same prompt tokens. */
int cv_scheduler_add_fork(cv_scheduler *s, cv_sequence *child, cv_sequence *parent, cv_err *err);

/* Plans one step. Returns CV_OK (out->n_seqs may be 0 when idle). */
int cv_scheduler_schedule(cv_scheduler *s, cv_sched_output *out);

/* After the runner ran the plan: advances n_computed by num_new_tokens and
 * registers newly full blocks in the prefix cache. Call before appending
 * sampled tokens. */
void cv_scheduler_commit(cv_scheduler *s, const cv_sched_output *out);

/* Speculative decoding, after commit: the engine set q's tokens to the
 * verified ones (n_spec proposals replaced by the accepted tokens); the KV of
 * positions >= n_valid holds rejected proposals. Lowers n_computed to n_valid,
 * frees the block-table tail beyond n_tokens and caches the newly full,
 * verified blocks. Nothing for a sequence no longer running. */
void cv_scheduler_verified(cv_scheduler *s, cv_sequence *q, int64_t n_valid);

/* Removes a sequence (running or waiting) with a final status and frees its
 * blocks. The scheduler drops every reference to it. */
void cv_scheduler_finish(cv_scheduler *s, cv_sequence *seq, cv_seq_status status);

int64_t cv_scheduler_num_unfinished(const cv_scheduler *s);
int64_t cv_scheduler_num_running(const cv_scheduler *s);
/* Admissions (not the running ones' steps) stop while n sequences run, below
 * max_num_seqs; a sequence that would run alone still starts. The engine sets
 * it from its step-time model (step_cost.h); 0: no target. */
void cv_scheduler_set_running_target(cv_scheduler *s, int64_t n);
/* The next schedule plans at most n of the running sequences' decodes (n >= 1;
 * prompt work is not limited): the others wait that one step. The engine asks
 * for it to time a step of a different batch size when its step-time model
 * cannot tell the fixed cost of a step from the cost of each row. */
void cv_scheduler_limit_next_decodes(cv_scheduler *s, int64_t n);

void cv_scheduler_get_stats(const cv_scheduler *s, cv_sched_stats *st);

/* For tests: checks every invariant (queues, and through the KV manager the
 * block tables, ref counts, free list and hashes); returns
 * CV_OK or CV_ERR_STATE with a message. */
int cv_scheduler_check(const cv_scheduler *s, cv_err *err);

#endif
