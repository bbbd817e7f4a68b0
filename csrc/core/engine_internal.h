/* The engine's private state, shared by its own files only (engine.c: step
 * orchestration and the background loop; request.c: a request's life from add
 * to retire, and its events; engine_sample.c: the sampling part of a step).
 * Nothing outside csrc/core/engine*.c and request.c includes this. */
#ifndef CV_ENGINE_INTERNAL_H
#define CV_ENGINE_INTERNAL_H

#include <pthread.h>

#include "../../kernels/backend.h"
#include "../model/model.h"
#include "draft.h"
#include "engine.h"
#include "guided.h"
#include "inbox.h"
#include "output.h"
#include "prompt_logprobs.h"
#include "sequence.h"
#include "spec_state.h"
#include "step_cost.h"
#include "stop.h"
#include "worker.h"

/* Per-completion state kept by the engine beside its cv_sequence. */
typedef struct seq_state {
    cv_sequence *seq;     /* NULL before a fork creates it, or after it finished */
    cv_rng rng;
    char *text;           /* detokenized output bytes */
    size_t text_len, text_cap;
    size_t emitted;       /* bytes already sent out */
    int64_t n_out;        /* tokens generated */
    int finished;
} seq_state;

typedef struct cv_request {
    int64_t id;
    int64_t arrival_order;
    cv_request_params p;  /* pointers below are owned copies */
    int32_t *stop_token_ids;
    void *ctl_block;      /* owned arrays of p.sp.ctl */
    int64_t prompt_lp_next; /* prompt logprobs: next prompt position to emit (from 1) */
    cv_stop_set stops;
    int32_t *prompt;      /* [n_prompt] */
    int64_t n_prompt;
    seq_state *ss;        /* [p.n] */
    int n_done;
    int forked;
    int queued;           /* counted in n_queued: added, not yet scheduled */
    double arrival, first_scheduled, first_token, finished_time;
    double deadline;      /* cv_now() time past which it ends with CV_FINISH_TIMEOUT; 0: none */
    struct cv_request *prev, *next; /* active list, or inbox list */
} cv_request;

/* One sampling thread's scratch: rows of a step are sampled in parallel on
 * the backend's host workers, each with its own sampler. */
typedef struct cv_sample_worker {
    cv_sampler *sampler;
    int32_t *banned;       /* [n_eos + stop ids] (banned_cap) */
    size_t banned_cap;
} cv_sample_worker;

/* The sampling scratch of a step (engine_sample.c): a sampler per host
 * worker, and the step's logits rows. */
typedef struct cv_sample_rows {
    cv_sample_worker *samplers; /* [n_samplers]: one per host worker of the backend */
    int n_samplers;
    int64_t max_rows;           /* logits rows a step may have: max_num_seqs, more when speculating */
    int32_t *list;              /* [max_rows] first rows of the sequences sampled now */
    int32_t *token;             /* [max_rows] their tokens, by row */
    int32_t *take;              /* [max_rows] by first row: tokens its sequence accepts (1 + proposals kept) */
    cv_sample_info *info;       /* [max_rows] their logprobs, by row */
} cv_sample_rows;

struct cv_engine {
    /* fixed after create */
    int64_t vocab, max_model_len, max_num_seqs, max_tokens_step, block_size;
    cv_detok detok;
    uint64_t seed;

    cv_backend *backend;
    cv_worker worker;           /* the target model, its KV cache and KV manager */
    cv_scheduler *sched;
    cv_step_cost step_cost;     /* the step-time model behind the running target (adaptive_batch_limit) */
    int64_t steps_since_probe;  /* steps since decodes were last held back to time another batch size */
    int adaptive_batch_limit;
    cv_sample_rows rows;
    cv_spec_state spec;
    cv_prompt_lp_rows prompt_lp;
    cv_guided guided;           /* masks posted by the grammar's thread */

    /* owned by the stepping thread */
    cv_request *active;    /* doubly linked */
    int64_t n_active;
    int64_t next_seq_id;
    int64_t steps;
    int64_t n_deadlines;   /* active requests with a deadline */
    cv_engine_stats stats_live;

    cv_inbox in;           /* from any thread to the stepping one */
    cv_engine_outbox outbox; /* from the stepping thread to any other */

    /* background loop */
    pthread_t thread;
    int loop_running;
    int stop_flag;         /* under in.lock */
    int wake_fd;
    cv_err loop_err;       /* under outbox.lock */
    int loop_failed;
};

/* ---- request.c: a request's life ---- */

/* Frees r and its sequences (NULL: nothing); unlinking it is the caller's. */
void cv_request_free(cv_request *r);
/* Appends an event of completion idx carrying text[0..len). Caller holds out_lock. */
cv_event *cv_request_push_event(cv_engine *e, cv_request *r, int idx, const char *text, size_t len);
/* Which completion of its request sequence s is. */
int cv_request_completion_index(const cv_request *r, const cv_sequence *s);
/* Marks completion idx finished and emits its last event (ev_or_null, else a
 * new one), with the request's metrics when it was the last. Caller holds out_lock. */
void cv_request_finish_completion(cv_engine *e, cv_request *r, int idx, int reason, int stop_kind,
                                  int32_t stop_value, cv_event *ev_or_null);
/* Appends token t to completion idx, checks the stops and emits the event. Caller holds out_lock. */
void cv_request_accept_token(cv_engine *e, cv_request *r, int idx, int32_t t, const cv_sample_info *info);
/* The request was scheduled or finished: it no longer counts as queued. */
void cv_request_leave_queue(cv_engine *e, cv_request *r);
/* Once every completion of r finished: takes it off the active list and frees it. */
void cv_request_retire_if_done(cv_engine *e, cv_request *r);
/* Ends every completion of an active request with CV_FINISH_ABORT and retires it. */
void cv_request_abort(cv_engine *e, cv_request *r);
/* n > 1: once the first completion's prompt is computed, the others fork from it. */
void cv_request_fork_children(cv_engine *e, cv_request *r);
/* Moves added requests onto the active list (and into the scheduler) and applies queued aborts. */
void cv_drain_inbox(cv_engine *e);
/* Ends the requests past their deadline; their blocks return to the pool. */
void cv_expire_deadlines(cv_engine *e, double now);

/* ---- engine_sample.c: the sampling part of a step ---- */

/* Samplers (n_samplers, each for a vocabulary of vocab) and rows for steps of
 * at most max_rows logits rows. CV_ERR_NOMEM; free with cv_sample_rows_free
 * either way. */
int cv_sample_rows_init(cv_sample_rows *rows, int64_t max_rows, int n_samplers, int64_t vocab, cv_err *err);
void cv_sample_rows_free(cv_sample_rows *rows);

/* Prompt logprobs for this step's chunks that ask for them (events out);
 * leaves the sampling rows' logits as the forward pass made them. */
int cv_prompt_logprobs_pass(cv_engine *e, const cv_sched_output *plan, cv_err *err);
/* Applies each guided row's token mask to its logits; returns the number of guided rows. */
int64_t cv_apply_guided_masks(cv_engine *e, const cv_sched_output *plan);
/* Samples and accepts one token for every logits row whose request is guided
 * (or not, per `guided`); a sequence with proposals accepts the longest prefix
 * of them its own draws reproduce, plus the next draw. Caller holds out_lock. */
void cv_sample_batch(cv_engine *e, const cv_sched_output *plan, int guided);

#endif
