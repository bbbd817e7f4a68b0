/* One sequence: the unit the scheduler, KV manager and runner work on.
 * A request with n completions owns n sequences. Owned by the engine (or the
 * test harness); the scheduler only links it into its queues. */
#ifndef CV_SEQUENCE_H
#define CV_SEQUENCE_H

#include <stdint.h>
#include "../../base/common.h"

/* Ordered so that "finished" is one comparison: status >= CV_SEQ_FINISHED_STOPPED. */
typedef enum cv_seq_status {
    CV_SEQ_NEW = 0,              /* created, not yet added to the scheduler */
    CV_SEQ_WAITING = 1,          /* in the waiting queue */
    CV_SEQ_RUNNING = 2,          /* in the running set */
    CV_SEQ_FINISHED_STOPPED = 10,/* EOS, stop token or stop string */
    CV_SEQ_FINISHED_LENGTH = 11, /* max_tokens or max_model_len */
    CV_SEQ_FINISHED_ABORTED = 12 /* aborted by the user */
} cv_seq_status;

#define CV_SEQ_IS_FINISHED(s) ((s) >= CV_SEQ_FINISHED_STOPPED)

/* The KV blocks a sequence holds: position p lives in block table[p / block_size].
 * Private to the KV manager (kv_manager.c), which alone writes it. */
typedef struct cv_seq_blocks {
    int32_t *table;         /* [cap] block ids */
    int64_t n;              /* blocks held */
    int64_t cap;
    int64_t n_cached;       /* leading full blocks already registered in the prefix cache */
    uint64_t last_key;      /* prefix-cache key of block n_cached - 1 (0: none) */
    /* After a preemption (n == 0): table[0..n_kept) are the blocks it let go,
     * gen[j] the generation table[j] had then; they held kept_computed tokens
     * of KV, intact in every block whose generation is unchanged. */
    uint64_t *gen;          /* [cap] */
    int64_t n_kept;
    int64_t kept_computed;
} cv_seq_blocks;

typedef struct cv_sequence {
    int64_t seq_id;         /* unique per engine */
    int64_t arrival;        /* arrival order: FCFS order and preemption victim choice */
    int64_t wait_key;       /* continuous policy: its place among the never-admitted (scheduler.c) */
    int32_t priority;       /* lower value first under the priority policy */

    int32_t *tokens;        /* [cap_tokens]: prompt then generated tokens */
    int64_t n_tokens;       /* tokens held */
    int64_t cap_tokens;     /* capacity of tokens */
    int64_t n_prompt;       /* prompt tokens */
    int64_t max_total;      /* n_prompt + max_tokens: the most tokens it will ever hold */

    int64_t n_computed;     /* tokens whose KV is in the cache */
    cv_seq_blocks blocks;   /* written only by the KV manager; others read it */

    cv_seq_status status;
    int64_t n_cached_prompt;/* prompt tokens served from the prefix cache at first admission */
    int64_t n_preemptions;

    void *owner;            /* engine's per-request data; opaque to the scheduler */
    int skip_prefix_cache;  /* never take cached blocks (prompt logprobs need every row's logits) */
    int32_t lora_slot;      /* the worker's adapter slot it runs under, -1: the base model */
    int64_t lora_id;        /* its adapter's id (0: none): roots its prefix-cache keys */
    /* Speculative decoding: the last n_spec tokens are proposals, not yet
     * verified. Nonzero only from the engine's proposal, before a schedule,
     * to that step's verification; the scheduler trims or drops them (they
     * never cause a preemption) and never caches a block holding one. */
    int64_t n_spec;

    /* scheduler-private links */
    struct cv_sequence *q_prev, *q_next;
    int64_t sched_index;    /* position in the running array, -1 when not running */
    int64_t heap_index;     /* position in the waiting heap, -1 when not in it */
    int64_t planned_step;   /* the scheduler step that last planned it */
} cv_sequence;

/* Creates a sequence holding a copy of prompt[n_prompt]; max_tokens more may
 * be appended. Returns NULL on allocation failure. */
cv_sequence *cv_sequence_create(int64_t seq_id, const int32_t *prompt, int64_t n_prompt,
                                int64_t max_tokens);
void cv_sequence_free(cv_sequence *s);
/* Appends one generated token (capacity grows as needed). Returns CV_OK or CV_ERR_NOMEM. */
int cv_sequence_append(cv_sequence *s, int32_t token);

#endif
