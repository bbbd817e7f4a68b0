/* The engine: one step = schedule, run, sample, then append tokens, check
 * stops, free finished sequences and emit outputs.
 *
 * Threads: the engine state is owned by whichever thread calls cv_engine_step
 * (the caller in synchronous use, or the engine's own background thread).
 * cv_engine_add_request and cv_engine_abort may be called from any thread: they
 * only touch an inbox under a lock. Outputs go to an outbox under another lock.
 * The owner's calls (step, set_mask_wait, start/stop_loop, destroy) are made by
 * one thread at a time; step and set_mask_wait fail with CV_ERR_BUSY while the
 * background loop runs, and start_loop while it already does. */
#ifndef CV_ENGINE_H
#define CV_ENGINE_H

#include <stddef.h>
#include <stdint.h>
#include "../../base/common.h"
#include "engine_config.h"
#include "sampler.h"
#include "scheduler.h"
#include "speculative.h"

#define CV_MAX_N 1024                   /* completions per request */
#define CV_MAX_TOKENS_REST INT64_MIN    /* max_tokens: the rest of the context */

typedef struct cv_request_params {
    int32_t n;                      /* completions, [1, CV_MAX_N] */
    int64_t max_tokens;             /* >= 1, or CV_MAX_TOKENS_REST */
    int64_t min_tokens;             /* [0, max_tokens] */
    cv_sampling_params sp;
    int has_seed; uint64_t seed;
    int n_stop; const char *const *stop; const size_t *stop_lens;
    int include_stop_str;
    int n_stop_token_ids; const int32_t *stop_token_ids;
    int ignore_eos;
    int skip_special_tokens;
    int32_t priority;
    int64_t lora_id;                /* the adapter's id (> 0; keys its prefix-cache blocks), 0: none */
    int32_t lora_slot;              /* its slot (cv_engine_lora_load); read only when lora_id != 0 */
    double timeout;                 /* seconds from arrival to finish; 0: none */
    int accepted;                   /* the caller accepted it earlier and held it (waiting for an
                                     * adapter slot), counted against the queue then: a full
                                     * queue does not refuse it now */
    /* Guided decoding: each completion samples under a token mask posted with
     * cv_engine_set_token_mask for its next output position. */
    int guided;
    /* ---- prompt logprobs and best_of ---- */
    int32_t prompt_logprobs;        /* CV_NO_LOGPROBS: none; 0..CV_MAX_LOGPROBS: each prompt token's
                                     * logprob plus that many top tokens (the request then skips
                                     * the prefix cache: a cached prefix has no logits) */
    int32_t best_of;                /* 0: n; else [n, CV_MAX_N] completions run, the caller keeps
                                     * the n with the highest cumulative logprob (events carry
                                     * every token's logprob) */
} cv_request_params;

enum { CV_FINISH_NONE = 0, CV_FINISH_STOP = 1, CV_FINISH_LENGTH = 2, CV_FINISH_ABORT = 3,
       CV_FINISH_TIMEOUT = 4 /* past its deadline: aborted, blocks freed */,
       CV_FINISH_NO_TOKEN = 5 /* its constraints left no token to sample: an error */ };
enum { CV_STOP_NONE = 0, CV_STOP_TOKEN = 1, CV_STOP_STRING = 2 };

/* One output of one step for one sequence. */
typedef struct cv_event {
    int64_t request_id;
    int32_t seq_index;      /* completion index in [0, n) */
    int32_t token;          /* sampled token, -1 when none (abort) */
    float logprob;
    int32_t n_top;
    int32_t top_ids[CV_MAX_LOGPROBS];
    float top_logprobs[CV_MAX_LOGPROBS];
    int64_t rank;           /* the token's rank under the raw logits (1: most likely), 0: none */
    size_t text_off, text_len; /* newly visible bytes, in the outbox text arena */
    int finished;           /* this sequence is done */
    int finish_reason;      /* CV_FINISH_* */
    int stop_kind;          /* CV_STOP_* */
    int32_t stop_value;     /* the stop token id or stop string index */
    int request_finished;   /* every sequence of the request is done */
    /* request metrics, set when request_finished */
    double arrival, first_scheduled, first_token, finished_time;
    int64_t n_prompt, n_cached_prompt;
    /* prompt logprobs: > 0 for an event that carries prompt token `token` at
     * this position (logprob, top) and nothing else */
    int64_t prompt_pos;
} cv_event;

typedef struct cv_engine_stats {
    cv_sched_stats sched;
    int64_t num_blocks, block_size, max_model_len, max_num_seqs, max_num_batched_tokens;
    int64_t request_room;            /* cv_engine_request_room */
    size_t kv_cache_bytes;
    int64_t prompt_tokens_computed;  /* prompt tokens run through the model */
    int64_t generation_tokens;       /* tokens sampled */
    int64_t requests_finished, requests_aborted;
    int64_t requests_timed_out;      /* finished past their deadline (also not in requests_finished) */
    int64_t requests_rejected;       /* refused at add: the queue was full */
    int64_t num_queued;              /* requests added but not yet scheduled */
    int64_t steps;
    /* speculative decoding: proposals verified, and of them accepted (the
     * model produced the same token), in all and by position in the proposal */
    int64_t spec_proposed, spec_accepted;
    int64_t spec_proposed_at[CV_SPEC_MAX_TOKENS], spec_accepted_at[CV_SPEC_MAX_TOKENS];
    int64_t spec_steps_disabled;     /* steps without proposals: more than disable_by_batch_size ran */
    int64_t spec_draft_tokens;       /* tokens the draft model computed (its catch-ups and proposals) */
    int64_t spec_draft_blocks_used;  /* KV blocks of the draft model's cache in use */
    /* seconds, cumulative: scheduling (with inbox), batch building, the model's
     * kernels, sampling and stop checks, and the whole step */
    double time_schedule, time_build, time_forward, time_sample, time_step;
    double time_propose;             /* of time_schedule: making proposals (the draft model's passes) */
} cv_engine_stats;

typedef struct cv_engine cv_engine;

int cv_engine_create(cv_engine **out, const cv_engine_config *cfg, cv_err *err);
/* Stops the background loop if any and frees everything. */
void cv_engine_destroy(cv_engine *e);

/* The checks that need no engine: every field's range (sampling included).
 * On failure err->field names the field (SamplingParams' names). */
int cv_request_params_check(const cv_request_params *p, cv_err *err);

/* Every check cv_engine_add_request makes, without queueing: the params, then
 * the prompt against the vocabulary, the context (max_model_len) and the KV
 * cache, and stop_token_ids against the vocabulary. Any thread. */
/* Tokens one sequence can hold, prompt and output: the context, or the whole
 * KV cache if smaller (one block stays free for the scheduler). */
int64_t cv_engine_request_room(const cv_engine *e);

int cv_engine_check_request(cv_engine *e, const int32_t *prompt, int64_t n_prompt,
                            const cv_request_params *p, cv_err *err);

/* Validates (cv_engine_check_request) and queues a request (any thread). The
 * prompt is copied. CV_ERR_OVERLOADED when max_queued_requests requests
 * already wait to be scheduled for the first time. */
int cv_engine_add_request(cv_engine *e, int64_t request_id, const int32_t *prompt, int64_t n_prompt,
                          const cv_request_params *p, cv_err *err);
/* Queues an abort (any thread); unknown ids are ignored at the next step. */
int cv_engine_abort(cv_engine *e, int64_t request_id);

/* LoRA (enable_lora): loads an adapter into slot (see cv_lora_pool_load),
 * or empties it. The caller never changes a slot a queued or running
 * request uses, and never calls these while a step runs on another thread
 * for that slot. check: a request's lora_slot/lora_id are usable. */
int cv_engine_lora_load(cv_engine *e, int64_t slot, int64_t rank, float scale, int64_t n_pairs,
                        const int32_t *layers, const int32_t *modules, const float *const *a,
                        const float *const *b, cv_err *err);
int cv_engine_lora_unload(cv_engine *e, int64_t slot, cv_err *err);
int cv_engine_lora_check(const cv_engine *e, int32_t slot, int64_t lora_id, cv_err *err);
/* (out, in) of a module's matrix (a cv_lora_module), and the slots (0: LoRA off). */
void cv_engine_lora_shape(const cv_engine *e, int module, int64_t *out, int64_t *in);
int64_t cv_engine_lora_slots(const cv_engine *e, int64_t *max_rank);
/* The dtype the adapter slots hold (CV_DTYPE_INVALID where LoRA is off). */
cv_dtype cv_engine_lora_dtype(const cv_engine *e);

/* Guided decoding: posts the mask (vocab_size bits, as uint32 words, bit t
 * set = token t allowed) for output position pos (tokens generated so far) of
 * completion seq_index of a guided request. mask NULL ends that completion
 * (aborted: its grammar failed). Any thread. Returns CV_OK when stored, 1 when
 * no such guided completion is live (it finished: nothing to do).
 * Synchronous stepping needs the mask posted before the step that samples
 * that position (otherwise the completion is aborted); the background loop
 * waits for it, so it can be computed while the next forward pass runs. */
int cv_engine_set_token_mask(cv_engine *e, int64_t request_id, int32_t seq_index, int64_t pos,
                             const uint32_t *mask);
/* Synchronous stepping: when on, cv_engine_step waits for guided masks as the
 * background loop does (the caller posts them from another thread while the
 * step's forward pass runs). Set only between steps, by the stepping thread;
 * CV_ERR_BUSY while the background loop runs. */
int cv_engine_set_mask_wait(cv_engine *e, int on, cv_err *err);
/* uint32 words in one token mask: (vocab_size + 31) / 32. */
int64_t cv_engine_token_mask_words(cv_engine *e);

/* Runs one step; returns the number of sequences that ran (0 when idle) or a
 * negative error; CV_ERR_BUSY while the background loop runs. */
int cv_engine_step(cv_engine *e, cv_err *err);
/* Requests queued or running. */
int64_t cv_engine_num_unfinished(cv_engine *e);
/* Requests added and not yet scheduled (what max_queued_requests bounds), now. */
int64_t cv_engine_num_queued(cv_engine *e);

/* Moves the pending events out: *events (and the text arena they index into)
 * become the caller's (free with free()). */
size_t cv_engine_take_events(cv_engine *e, cv_event **events, char **text);

/* Starts/stops the background loop; after each step with outputs it writes an
 * 8-byte 1 to wake_fd (an eventfd or pipe). Stop waits for the current step. */
int cv_engine_start_loop(cv_engine *e, int wake_fd, cv_err *err);
void cv_engine_stop_loop(cv_engine *e);
/* Sets a message from the background loop's failure, if any (returns its code). */
int cv_engine_loop_error(cv_engine *e, cv_err *err);

void cv_engine_get_stats(cv_engine *e, cv_engine_stats *st);
/* For tests: the scheduler's and block pool's invariants (cv_scheduler_check).
 * CV_ERR_BUSY while the background loop runs. */
int cv_engine_check_invariants(cv_engine *e, cv_err *err);
const void *cv_engine_model_config(cv_engine *e); /* const cv_model_config * */
int64_t cv_engine_vocab_size(cv_engine *e);
/* Bytes of the prepared weights, the checkpoint's parameter count, the
 * weights' dtype and the KV cache's dtype. */
void cv_engine_weight_info(cv_engine *e, size_t *bytes, int64_t *n_params, cv_dtype *dtype,
                           cv_dtype *kv_dtype);
/* Bytes of the token embedding table held apart from the LM head (a decode
 * step reads only a few rows; 0 when a tied embedding is read from the LM
 * head), the dtype the layers' matrices are kept in (q4_1 for a Q4_1 GGUF),
 * and the LM head's. */
size_t cv_engine_embed_bytes(cv_engine *e);
cv_dtype cv_engine_matrix_dtype(cv_engine *e);
cv_dtype cv_engine_lm_head_dtype(cv_engine *e);

/* Step trace for the slot timeline: when on, each step records its scheduled
 * (request id, seq index, new tokens). */
void cv_engine_set_trace(cv_engine *e, int on);
/* n_prompt_work: of n_new, the tokens that are prompt work (a prefill chunk or a
 * recomputation after preemption), 0 for a decode. */
typedef struct cv_trace_entry {
    int64_t step; double t0, t1; int64_t request_id; int32_t seq_index, n_new, n_prompt_work;
} cv_trace_entry;
size_t cv_engine_take_trace(cv_engine *e, cv_trace_entry **entries);

#endif
