#include "engine.h"
#include "../../kernels/quant_format.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../../kernels/backend.h"
#include "../model/model.h"
#include "kv_cache.h"
#include "output.h"
#include "runner.h"
#include "sequence.h"
#include "stop.h"
#include "token_mask.h"

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
    int aborted_queued;
    int queued;           /* counted in n_queued: added, not yet scheduled */
    double arrival, first_scheduled, first_token, finished_time;
    double deadline;      /* cv_now() time past which it ends with CV_FINISH_TIMEOUT; 0: none */
    struct cv_request *prev, *next; /* active list, or inbox list */
} cv_request;

struct cv_engine {
    /* fixed after create */
    int64_t vocab, max_model_len, max_num_seqs, max_tokens_step, block_size;
    cv_detok detok;
    uint64_t seed;

    cv_backend *backend;
    cv_model *model;
    cv_kv_cache kv;
    cv_scheduler *sched;
    cv_runner runner;
    cv_forward_ws ws;
    int ws_ready;
    cv_sampler *sampler;
    int32_t *pl_rows;      /* [max_num_seqs] prompt-logprob rows of one LM-head group */
    cv_request **pl_req;   /* [max_num_seqs] their requests */
    int64_t *pl_pos;       /* [max_num_seqs] the prompt position each row predicts */
    int32_t *banned;       /* [16 + max stop ids] scratch */
    size_t banned_cap;
    /* guided decoding: masks posted by the grammar's thread */
    cv_mask_box masks;
    int masks_ready;
    uint32_t *mask_scratch; /* [masks.words] */
    uint8_t *mask_failed;   /* [max_tokens_step] this step's guided rows left without a mask */
    int mask_wait;          /* synchronous steps wait for masks too */

    /* owned by the stepping thread */
    cv_request *active;    /* doubly linked */
    int64_t n_active;
    int64_t next_seq_id;
    int64_t steps;
    int64_t n_deadlines;   /* active requests with a deadline */
    cv_engine_stats stats_live;

    /* inbox */
    pthread_mutex_t in_lock;
    pthread_cond_t in_cond;
    cv_request *in_head, *in_tail;
    int64_t *aborts; size_t n_aborts, cap_aborts;
    int64_t n_inbox;
    int64_t arrival_counter;
    int64_t max_queued;    /* 0: no limit */
    int64_t n_queued;      /* requests added and not yet scheduled (the inbox included) */
    int64_t n_rejected;

    /* outbox */
    pthread_mutex_t out_lock;
    cv_outbox outbox;
    cv_engine_stats stats_snapshot;
    int tracing;
    cv_trace_entry *trace; size_t n_trace, cap_trace;

    /* background loop */
    pthread_t thread;
    int loop_running;
    int stop_flag;
    int wake_fd;
    cv_err loop_err;
    int loop_failed;
};

/* ------------------------------------------------------------------------- */

static void request_free(cv_request *r) {
    if (!r) return;
    if (r->ss) {
        for (int i = 0; i < r->p.n; i++) {
            cv_sequence_free(r->ss[i].seq);
            free(r->ss[i].text);
        }
        free(r->ss);
    }
    cv_stop_set_free(&r->stops);
    free(r->stop_token_ids);
    free(r->ctl_block);
    free(r->prompt);
    free(r);
}

/* ------------------------------------------------------------------------- */
/* Outbox */

static cv_event *push_event(cv_engine *e, cv_request *r, int idx, const char *text, size_t len) {
    /* caller holds out_lock */
    return cv_outbox_push(&e->outbox, r->id, idx, text, len);
}

static void fill_request_metrics(cv_event *ev, const cv_request *r) {
    ev->request_finished = 1;
    ev->arrival = r->arrival;
    ev->first_scheduled = r->first_scheduled;
    ev->first_token = r->first_token;
    ev->finished_time = r->finished_time;
    ev->n_prompt = r->n_prompt;
    ev->n_cached_prompt = r->ss[0].seq ? r->ss[0].seq->n_cached_prompt : 0;
}

size_t cv_engine_take_events(cv_engine *e, cv_event **events, char **text) {
    pthread_mutex_lock(&e->out_lock);
    size_t n = cv_outbox_take(&e->outbox, events, text);
    pthread_mutex_unlock(&e->out_lock);
    return n;
}

/* ------------------------------------------------------------------------- */
/* Creation */

/* The default KV cache: on a device, gpu_memory_utilization of its free memory
 * (weights and activations are already allocated); on the CPU a quarter of the
 * available memory, at most 4 GiB. Never more than max_num_seqs full-length
 * sequences need, never less than one. */
static size_t default_kv_bytes(cv_engine *e, size_t per_token, double gpu_util) {
    size_t share = 0, free_b = 0, total_b = 0;
    if (e->backend->mem_info && e->backend->mem_info(e->backend, &free_b, &total_b) == 0) {
        share = (size_t)((double)free_b * (gpu_util > 0 && gpu_util <= 1 ? gpu_util : 0.9));
    } else {
        long pages = sysconf(_SC_AVPHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
        size_t avail = (pages > 0 && psz > 0) ? (size_t)pages * (size_t)psz : 0;
        share = avail / 4;
        if (share > ((size_t)4 << 30)) share = (size_t)4 << 30;
    }
    size_t want = per_token * (size_t)e->max_model_len * (size_t)e->max_num_seqs;
    size_t minimum = per_token * (size_t)(e->max_model_len + 2 * e->block_size);
    size_t kv = share < want ? share : want;
    return kv < minimum ? minimum : kv;
}

int cv_engine_create(cv_engine **out, const cv_engine_config *cfg, cv_err *err) {
    int rc = CV_OK;
    cv_engine *e = calloc(1, sizeof *e);
    *out = NULL;
    if (!e) return cv_set_err(err, CV_ERR_NOMEM, "out of memory");
    pthread_mutex_init(&e->in_lock, NULL);
    pthread_cond_init(&e->in_cond, NULL);
    pthread_mutex_init(&e->out_lock, NULL);
    e->wake_fd = -1;
    e->seed = cfg->seed;
    e->max_queued = cfg->max_queued_requests;
    if (cfg->max_queued_requests < 0 || cfg->max_prefill_tokens_while_decoding < 0) {
        rc = cv_set_err(err, CV_ERR_INVALID,
                        "max_queued_requests (%lld) and max_prefill_tokens_while_decoding (%lld) "
                        "must be >= 0 (0: no limit)",
                        (long long)cfg->max_queued_requests,
                        (long long)cfg->max_prefill_tokens_while_decoding);
        goto fail;
    }

    if (cfg->block_size < 1 || cfg->block_size > 1024) {
        rc = cv_set_err(err, CV_ERR_INVALID, "block_size must be in [1, 1024], got %lld",
                        (long long)cfg->block_size);
        goto fail;
    }
    if (cfg->max_num_seqs < 1) {
        rc = cv_set_err(err, CV_ERR_INVALID, "max_num_seqs must be >= 1, got %lld",
                        (long long)cfg->max_num_seqs);
        goto fail;
    }
    if (cfg->use_cuda) {
        e->backend = cv_cuda_backend_create(0, err);
    } else {
        e->backend = cv_cpu_backend_create(cfg->num_threads, 0, err);
    }
    if (!e->backend) { rc = err ? err->code : CV_ERR_STATE; if (rc >= 0) rc = CV_ERR_STATE; goto fail; }
    if ((rc = cv_model_load_quantized(&e->model, cfg->model_path, e->backend, cfg->dtype,
                                       cv_dtype_is_quant(cfg->quantization) ? cfg->quantization : CV_DTYPE_INVALID,
                                       cfg->cancel, err)))
        goto fail;

    const cv_model_config *mc = &e->model->cfg;
    e->vocab = mc->vocab_size;
    e->max_model_len = cfg->max_model_len > 0 ? cfg->max_model_len : mc->max_pos;
    if (e->max_model_len > mc->max_pos) {
        rc = cv_set_err(err, CV_ERR_INVALID,
                        "max_model_len %lld exceeds the model's max_position_embeddings %lld",
                        (long long)e->max_model_len, (long long)mc->max_pos);
        goto fail;
    }
    e->max_num_seqs = cfg->max_num_seqs;
    e->block_size = cfg->block_size;
    e->max_tokens_step = cfg->max_num_batched_tokens > 0 ? cfg->max_num_batched_tokens : 2048;
    if (!cfg->enable_chunked_prefill && e->max_tokens_step < e->max_model_len) {
        if (cfg->max_num_batched_tokens > 0) {
            rc = cv_set_err(err, CV_ERR_INVALID,
                            "max_num_batched_tokens (%lld) must be >= max_model_len (%lld) when "
                            "enable_chunked_prefill is False",
                            (long long)e->max_tokens_step, (long long)e->max_model_len);
            goto fail;
        }
        e->max_tokens_step = e->max_model_len;
    }
    if (e->max_tokens_step < e->max_num_seqs) e->max_tokens_step = e->max_num_seqs;

    /* Activations before the KV cache, which takes a share of what is left. */
    int64_t max_blocks_per_seq = (e->max_model_len + e->block_size - 1) / e->block_size + 1;
    if ((rc = cv_forward_ws_init(&e->ws, e->model, e->max_tokens_step, e->max_num_seqs,
                                 max_blocks_per_seq, err)))
        goto fail;
    e->ws_ready = 1;

    /* KV cache */
    /* "auto": the activation dtype, except bf16 under quantized weights (their
     * activations are fp32; bf16 keys and values halve the cache at a rounding
     * error far below the weights' own). */
    cv_dtype kvt = cfg->kv_dtype;
    if (kvt == CV_DTYPE_INVALID)
        kvt = cv_dtype_is_quant(cv_engine_matrix_dtype(e)) ? CV_BF16 : e->model->dtype;
    size_t per_token = cv_kv_bytes_per_token(mc->n_layers, mc->n_kv_heads, mc->head_dim, kvt);
    size_t kv = cfg->kv_cache_bytes ? cfg->kv_cache_bytes
                                     : default_kv_bytes(e, per_token, cfg->gpu_memory_utilization);
    if ((rc = cv_kv_cache_create(&e->kv, e->backend, mc->n_layers, mc->n_kv_heads, mc->head_dim, kvt,
                                 e->block_size, kv, cfg->cancel, err)))
        goto fail;

    cv_scheduler_config sc = {
        .num_blocks = e->kv.num_blocks, .block_size = e->block_size, .max_num_seqs = e->max_num_seqs,
        .max_num_batched_tokens = e->max_tokens_step, .max_model_len = e->max_model_len,
        .enable_prefix_caching = cfg->enable_prefix_caching,
        .enable_chunked_prefill = cfg->enable_chunked_prefill, .policy = cfg->policy,
        .max_prefill_tokens_while_decoding = cfg->max_prefill_tokens_while_decoding,
    };
    e->sched = cv_scheduler_create(&sc, err);
    if (!e->sched) { rc = err ? err->code : CV_ERR_STATE; goto fail; }
    if ((rc = cv_runner_init(&e->runner, e->max_tokens_step, e->max_num_seqs, max_blocks_per_seq,
                             e->block_size, err)))
        goto fail;
    e->pl_rows = malloc((size_t)e->max_num_seqs * sizeof *e->pl_rows);
    e->pl_req = malloc((size_t)e->max_num_seqs * sizeof *e->pl_req);
    e->pl_pos = malloc((size_t)e->max_num_seqs * sizeof *e->pl_pos);
    if (!e->pl_rows || !e->pl_req || !e->pl_pos) {
        rc = cv_set_err(err, CV_ERR_NOMEM, "out of memory for the prompt-logprob rows");
        goto fail;
    }
    e->sampler = cv_sampler_create(e->vocab);
    if (!e->sampler) { rc = cv_set_err(err, CV_ERR_NOMEM, "out of memory for the sampler"); goto fail; }

    if ((rc = cv_detok_init(&e->detok, e->vocab, cfg, mc, err))) goto fail;
    if (cv_mask_box_init(&e->masks, e->vocab)) { rc = cv_set_err(err, CV_ERR_NOMEM, "out of memory"); goto fail; }
    e->masks_ready = 1;
    e->mask_scratch = malloc((size_t)e->masks.words * sizeof *e->mask_scratch);
    e->mask_failed = calloc((size_t)e->max_tokens_step, 1);
    if (!e->mask_scratch || !e->mask_failed) {
        rc = cv_set_err(err, CV_ERR_NOMEM, "out of memory for token masks");
        goto fail;
    }
    e->stats_live.num_blocks = e->kv.num_blocks;
    e->stats_live.block_size = e->block_size;
    e->stats_live.max_model_len = e->max_model_len;
    e->stats_live.max_num_seqs = e->max_num_seqs;
    e->stats_live.max_num_batched_tokens = e->max_tokens_step;
    e->stats_live.kv_cache_bytes = e->kv.bytes;
    cv_scheduler_get_stats(e->sched, &e->stats_live.sched);
    e->stats_snapshot = e->stats_live;
    *out = e;
    return CV_OK;

fail:
    cv_engine_destroy(e);
    return rc ? rc : CV_ERR_STATE;
}

void cv_engine_destroy(cv_engine *e) {
    if (!e) return;
    cv_engine_stop_loop(e);
    cv_request *r = e->active;
    while (r) { cv_request *nx = r->next; request_free(r); r = nx; }
    r = e->in_head;
    while (r) { cv_request *nx = r->next; request_free(r); r = nx; }
    /* Sequences were freed with their requests; the scheduler holds no memory of them. */
    cv_scheduler_destroy(e->sched);
    cv_sampler_destroy(e->sampler);
    cv_runner_free(&e->runner);
    if (e->ws_ready) cv_forward_ws_free(&e->ws, e->model);
    cv_kv_cache_free(&e->kv, e->backend);
    cv_model_free(e->model);
    if (e->backend) e->backend->destroy(e->backend);
    cv_detok_free(&e->detok);
    free(e->banned);
    if (e->masks_ready) cv_mask_box_free(&e->masks);
    free(e->mask_scratch);
    free(e->mask_failed);
    free(e->pl_rows);
    free(e->pl_req);
    free(e->pl_pos);
    free(e->aborts);
    cv_outbox_free(&e->outbox);
    free(e->trace);
    pthread_mutex_destroy(&e->in_lock);
    pthread_cond_destroy(&e->in_cond);
    pthread_mutex_destroy(&e->out_lock);
    free(e);
}

/* ------------------------------------------------------------------------- */
/* Requests in */

int cv_request_params_check(const cv_request_params *p, cv_err *err) {
    if (!p) return cv_set_err(err, CV_ERR_INVALID, "request params: NULL");
    if (p->n < 1 || p->n > CV_MAX_N)
        return cv_set_field_err(err, CV_ERR_INVALID, "n", "n must be in [1, %d], got %d", CV_MAX_N, p->n);
    if (p->max_tokens != CV_MAX_TOKENS_REST && p->max_tokens < 1)
        return cv_set_field_err(err, CV_ERR_INVALID, "max_tokens", "max_tokens must be >= 1, got %lld",
                                (long long)p->max_tokens);
    if (p->min_tokens < 0)
        return cv_set_field_err(err, CV_ERR_INVALID, "min_tokens", "min_tokens must be >= 0, got %lld",
                                (long long)p->min_tokens);
    if (p->max_tokens != CV_MAX_TOKENS_REST && p->min_tokens > p->max_tokens)
        return cv_set_field_err(err, CV_ERR_INVALID, "min_tokens",
                                "min_tokens (%lld) must be <= max_tokens (%lld)", (long long)p->min_tokens,
                                (long long)p->max_tokens);
    int rc = cv_sampling_params_check(&p->sp, err);
    if (rc) return rc;
    if (p->prompt_logprobs != CV_NO_LOGPROBS && (p->prompt_logprobs < 0 || p->prompt_logprobs > CV_MAX_LOGPROBS))
        return cv_set_field_err(err, CV_ERR_INVALID, "prompt_logprobs", "prompt_logprobs must be in [0, %d], got %d",
                                CV_MAX_LOGPROBS, (int)p->prompt_logprobs);
    if (p->best_of != 0 && (p->best_of < p->n || p->best_of > CV_MAX_N))
        return cv_set_field_err(err, CV_ERR_INVALID, "best_of", "best_of must be in [n, %d] (n = %d), got %d",
                                CV_MAX_N, p->n, p->best_of);
    if (p->n_stop < 0 || (p->n_stop > 0 && (!p->stop || !p->stop_lens)))
        return cv_set_field_err(err, CV_ERR_INVALID, "stop", "stop: bad list");
    for (int i = 0; i < p->n_stop; i++)
        if (p->stop_lens[i] == 0)
            return cv_set_field_err(err, CV_ERR_INVALID, "stop", "stop must not contain an empty string");
    if (p->n_stop_token_ids < 0 || (p->n_stop_token_ids > 0 && !p->stop_token_ids))
        return cv_set_field_err(err, CV_ERR_INVALID, "stop_token_ids", "stop_token_ids: bad list");
    for (int i = 0; i < p->n_stop_token_ids; i++)
        if (p->stop_token_ids[i] < 0)
            return cv_set_field_err(err, CV_ERR_INVALID, "stop_token_ids",
                                    "stop_token_ids must be >= 0, got %d", p->stop_token_ids[i]);
    if (!(p->timeout >= 0.0 && p->timeout <= 1e9)) /* also refuses NaN */
        return cv_set_field_err(err, CV_ERR_INVALID, "timeout",
                                "timeout must be in (0, 1e9] seconds (0: none), got %g", p->timeout);
    return CV_OK;
}

/* max_tokens with CV_MAX_TOKENS_REST resolved against the context. */
static int64_t resolved_max_tokens(const cv_engine *e, int64_t n_prompt, const cv_request_params *p) {
    return p->max_tokens == CV_MAX_TOKENS_REST ? e->max_model_len - n_prompt : p->max_tokens;
}

int cv_engine_check_request(cv_engine *e, const int32_t *prompt, int64_t n_prompt,
                            const cv_request_params *p, cv_err *err) {
    int rc = cv_request_params_check(p, err);
    if (rc) return rc;
    if (n_prompt < 1 || !prompt) return cv_set_field_err(err, CV_ERR_INVALID, "prompt", "the prompt is empty");
    for (int64_t i = 0; i < n_prompt; i++)
        if (prompt[i] < 0 || prompt[i] >= e->vocab)
            return cv_set_field_err(err, CV_ERR_INVALID, "prompt",
                                    "prompt token id %d is outside the vocabulary [0, %lld) (at index %lld)",
                                    prompt[i], (long long)e->vocab, (long long)i);
    if (n_prompt > e->max_model_len)
        return cv_set_field_err(err, CV_ERR_INVALID, "prompt",
                                "the prompt has %lld tokens, more than max_model_len (%lld)",
                                (long long)n_prompt, (long long)e->max_model_len);
    int64_t max_tokens = resolved_max_tokens(e, n_prompt, p);
    if (max_tokens < 1)
        return cv_set_field_err(err, CV_ERR_INVALID, "prompt",
                                "the prompt has %lld tokens and leaves no room to generate within "
                                "max_model_len (%lld)", (long long)n_prompt, (long long)e->max_model_len);
    if (max_tokens > e->max_model_len - n_prompt)
        return cv_set_field_err(err, CV_ERR_INVALID, "max_tokens",
                                "prompt (%lld tokens) + max_tokens (%lld) exceeds max_model_len (%lld)",
                                (long long)n_prompt, (long long)max_tokens, (long long)e->max_model_len);
    int64_t need = (n_prompt + max_tokens + e->block_size - 1) / e->block_size;
    if (need > e->kv.num_blocks - 1)
        return cv_set_field_err(err, CV_ERR_INVALID, "max_tokens",
                                "the request needs %lld KV blocks but the whole cache holds %lld; "
                                "raise kv_cache_memory or lower max_tokens",
                                (long long)need, (long long)(e->kv.num_blocks - 1));
    for (int i = 0; i < p->n_stop_token_ids; i++)
        if (p->stop_token_ids[i] >= e->vocab)
            return cv_set_field_err(err, CV_ERR_INVALID, "stop_token_ids",
                                    "stop_token_ids contains %d, outside the vocabulary [0, %lld)",
                                    p->stop_token_ids[i], (long long)e->vocab);
    return cv_logit_controls_check_vocab(&p->sp.ctl, e->vocab, err);
}

int cv_engine_add_request(cv_engine *e, int64_t request_id, const int32_t *prompt, int64_t n_prompt,
                          const cv_request_params *p, cv_err *err) {
    int rc = cv_engine_check_request(e, prompt, n_prompt, p, err);
    if (rc) return rc;

    cv_request *r = calloc(1, sizeof *r);
    if (!r) return cv_set_err(err, CV_ERR_NOMEM, "out of memory");
    r->id = request_id;
    r->p = *p;
    r->p.max_tokens = resolved_max_tokens(e, n_prompt, p);
    r->p.stop = NULL;
    r->p.stop_lens = NULL;
    r->p.stop_token_ids = NULL;
    memset(&r->p.sp.ctl, 0, sizeof r->p.sp.ctl);
    /* best_of: every candidate runs as a completion and carries its logprobs */
    if (p->best_of > p->n) {
        r->p.n = p->best_of;
        if (r->p.sp.n_logprobs == CV_NO_LOGPROBS) r->p.sp.n_logprobs = 0;
    }
    r->prompt_lp_next = 1;
    r->arrival = cv_now();
    if (p->timeout > 0) r->deadline = r->arrival + p->timeout;
    r->n_prompt = n_prompt;
    r->prompt = malloc((size_t)n_prompt * sizeof(int32_t));
    r->ss = calloc((size_t)r->p.n, sizeof *r->ss);
    if (!r->prompt || !r->ss) goto nomem;
    if (cv_logit_controls_copy(&r->p.sp.ctl, &p->sp.ctl, &r->ctl_block)) goto nomem;
    memcpy(r->prompt, prompt, (size_t)n_prompt * sizeof(int32_t));
    if (p->n_stop_token_ids > 0) {
        r->stop_token_ids = malloc((size_t)p->n_stop_token_ids * sizeof(int32_t));
        if (!r->stop_token_ids) goto nomem;
        memcpy(r->stop_token_ids, p->stop_token_ids, (size_t)p->n_stop_token_ids * sizeof(int32_t));
    }
    if (p->n_stop > 0) {
        int src = cv_stop_set_init(&r->stops, p->stop, p->stop_lens, p->n_stop);
        if (src == CV_ERR_INVALID) {
            request_free(r);
            return cv_set_err(err, CV_ERR_INVALID, "stop strings must not be empty");
        }
        if (src) goto nomem;
    }
    if (p->guided && cv_mask_box_open(&e->masks, request_id, p->n)) goto nomem;
    pthread_mutex_lock(&e->in_lock);
    if (e->max_queued > 0 && e->n_queued >= e->max_queued) {
        int64_t queued = e->n_queued;
        e->n_rejected++;
        pthread_mutex_unlock(&e->in_lock);
        request_free(r);
        return cv_set_err(err, CV_ERR_OVERLOADED,
                          "the engine is overloaded: %lld requests already wait to be scheduled "
                          "(max_queued_requests=%lld); retry later",
                          (long long)queued, (long long)e->max_queued);
    }
    e->n_queued++;
    r->queued = 1;
    r->arrival_order = e->arrival_counter++;
    if (e->in_tail) e->in_tail->next = r; else e->in_head = r;
    r->prev = e->in_tail;
    e->in_tail = r;
    e->n_inbox++;
    pthread_cond_signal(&e->in_cond);
    pthread_mutex_unlock(&e->in_lock);
    return CV_OK;
nomem:
    request_free(r);
    return cv_set_err(err, CV_ERR_NOMEM, "out of memory for a request");
}

int cv_engine_abort(cv_engine *e, int64_t request_id) {
    int rc = CV_OK;
    pthread_mutex_lock(&e->in_lock);
    if (cv_grow((void **)&e->aborts, &e->cap_aborts, e->n_aborts + 1, sizeof *e->aborts))
        e->aborts[e->n_aborts++] = request_id;
    else
        rc = CV_ERR_NOMEM;
    pthread_cond_signal(&e->in_cond);
    pthread_mutex_unlock(&e->in_lock);
    cv_mask_box_cancel(&e->masks, request_id); /* a sampler waiting on its mask gives up */
    return rc;
}

int cv_engine_set_token_mask(cv_engine *e, int64_t request_id, int32_t seq_index, int64_t pos,
                             const uint32_t *mask) {
    return cv_mask_box_put(&e->masks, request_id, seq_index, pos, mask);
}

int64_t cv_engine_token_mask_words(cv_engine *e) { return e->masks.words; }

void cv_engine_set_mask_wait(cv_engine *e, int on) { e->mask_wait = on; }

int64_t cv_engine_num_unfinished(cv_engine *e) {
    pthread_mutex_lock(&e->in_lock);
    int64_t n = e->n_inbox + e->n_active;
    pthread_mutex_unlock(&e->in_lock);
    return n;
}

/* ------------------------------------------------------------------------- */
/* Step */

static void active_remove(cv_engine *e, cv_request *r) {
    if (r->prev) r->prev->next = r->next; else e->active = r->next;
    if (r->next) r->next->prev = r->prev;
    r->prev = r->next = NULL;
    pthread_mutex_lock(&e->in_lock);
    e->n_active--;
    pthread_mutex_unlock(&e->in_lock);
}

/* Marks completion idx finished, emits its last event, and retires the request
 * when it was the last one. Caller holds out_lock. */
static void finish_seq(cv_engine *e, cv_request *r, int idx, int reason, int stop_kind,
                       int32_t stop_value, cv_event *ev_or_null) {
    seq_state *st = &r->ss[idx];
    if (st->finished) return;
    st->finished = 1;
    r->n_done++;
    if (st->seq) {
        cv_seq_status status = reason == CV_FINISH_STOP     ? CV_SEQ_FINISHED_STOPPED
                               : reason == CV_FINISH_LENGTH ? CV_SEQ_FINISHED_LENGTH
                                                            : CV_SEQ_FINISHED_ABORTED;
        cv_scheduler_finish(e->sched, st->seq, status);
    }
    cv_event *ev = ev_or_null;
    if (!ev) {
        /* flush whatever text is left */
        ev = push_event(e, r, idx, st->text + st->emitted, st->text_len - st->emitted);
        st->emitted = st->text_len;
    }
    if (!ev) return; /* out of memory for the event: the request still finishes */
    ev->finished = 1;
    ev->finish_reason = reason;
    ev->stop_kind = stop_kind;
    ev->stop_value = stop_value;
    if (r->n_done == r->p.n) {
        r->finished_time = cv_now();
        fill_request_metrics(ev, r);
        if (reason == CV_FINISH_ABORT) e->stats_live.requests_aborted++;
        else if (reason == CV_FINISH_TIMEOUT) e->stats_live.requests_timed_out++;
        else e->stats_live.requests_finished++;
    }
}

/* The request was scheduled or finished: it no longer counts as queued. */
static void leave_queue(cv_engine *e, cv_request *r) {
    if (!r->queued) return;
    r->queued = 0;
    pthread_mutex_lock(&e->in_lock);
    e->n_queued--;
    pthread_mutex_unlock(&e->in_lock);
}

static void retire_if_done(cv_engine *e, cv_request *r) {
    if (r->n_done == r->p.n) {
        leave_queue(e, r);
        if (r->deadline > 0) e->n_deadlines--;
        active_remove(e, r);
        if (r->p.guided) cv_mask_box_close(&e->masks, r->id);
        request_free(r);
    }
}

/* Ends every completion of r with reason (CV_FINISH_ABORT or CV_FINISH_TIMEOUT). */
static void end_request(cv_engine *e, cv_request *r, int reason) {
    r->forked = 1; /* no forks after an abort */
    pthread_mutex_lock(&e->out_lock);
    for (int i = 0; i < r->p.n; i++) finish_seq(e, r, i, reason, CV_STOP_NONE, -1, NULL);
    pthread_mutex_unlock(&e->out_lock);
    retire_if_done(e, r);
}

static void abort_request(cv_engine *e, cv_request *r) { end_request(e, r, CV_FINISH_ABORT); }

/* Ends the requests past their deadline; their blocks return to the pool. */
static void expire_deadlines(cv_engine *e, double now) {
    if (e->n_deadlines == 0) return;
    cv_request *r = e->active;
    while (r) {
        cv_request *nx = r->next;
        if (r->deadline > 0 && now >= r->deadline) end_request(e, r, CV_FINISH_TIMEOUT);
        r = nx;
    }
}

static int text_append(seq_state *st, const char *b, size_t n) {
    if (!cv_grow((void **)&st->text, &st->text_cap, st->text_len + n + 1, 1)) return CV_ERR_NOMEM;
    memcpy(st->text + st->text_len, b, n);
    st->text_len += n;
    return CV_OK;
}

static int new_sequence(cv_engine *e, cv_request *r, int idx, cv_sequence **out) {
    cv_sequence *s = cv_sequence_create(e->next_seq_id++, r->prompt, r->n_prompt, r->p.max_tokens);
    if (!s) return CV_ERR_NOMEM;
    s->arrival = r->arrival_order;
    s->priority = r->p.priority;
    s->owner = r;
    s->skip_prefix_cache = r->p.prompt_logprobs != CV_NO_LOGPROBS;
    /* Each completion gets its own stream: seeded requests are reproducible
     * whatever else shares the batch. */
    uint64_t x = r->p.has_seed ? r->p.seed : e->seed ^ ((uint64_t)r->arrival_order * 0x2545f4914f6cdd1dULL);
    x += (uint64_t)idx * 0x632be59bd9b4e019ULL;
    cv_rng_seed(&r->ss[idx].rng, cv_splitmix64(&x));
    r->ss[idx].seq = s;
    *out = s;
    return CV_OK;
}

static void drain_inbox(cv_engine *e) {
    pthread_mutex_lock(&e->in_lock);
    cv_request *head = e->in_head;
    e->in_head = e->in_tail = NULL;
    int64_t moved = e->n_inbox;
    e->n_inbox = 0;
    e->n_active += moved;
    int64_t *aborts = e->aborts;
    size_t n_aborts = e->n_aborts;
    e->aborts = NULL;
    e->n_aborts = e->cap_aborts = 0;
    pthread_mutex_unlock(&e->in_lock);

    while (head) {
        cv_request *r = head;
        head = head->next;
        r->prev = NULL;
        r->next = e->active;
        if (e->active) e->active->prev = r;
        e->active = r;
        if (r->deadline > 0) e->n_deadlines++;
        cv_sequence *s = NULL;
        cv_err err;
        if (new_sequence(e, r, 0, &s) || cv_scheduler_add(e->sched, s, &err)) {
            abort_request(e, r); /* validated at add: only out of memory lands here */
        }
    }
    for (size_t i = 0; i < n_aborts; i++) {
        for (cv_request *r = e->active; r; r = r->next) {
            if (r->id == aborts[i]) { abort_request(e, r); break; }
        }
    }
    free(aborts);
}

/* n > 1: once the first completion's prompt is computed, the others fork from it. */
static void fork_children(cv_engine *e, cv_request *r) {
    cv_sequence *parent = r->ss[0].seq;
    r->forked = 1;
    for (int i = 1; i < r->p.n; i++) {
        cv_sequence *c = NULL;
        cv_err err;
        if (new_sequence(e, r, i, &c) || cv_scheduler_add_fork(e->sched, c, parent, &err)) {
            pthread_mutex_lock(&e->out_lock);
            finish_seq(e, r, i, CV_FINISH_ABORT, CV_STOP_NONE, -1, NULL);
            pthread_mutex_unlock(&e->out_lock);
        }
    }
}

/* Appends token t to completion idx, checks the stops and emits the event.
 * Caller holds out_lock. */
static void accept_token(cv_engine *e, cv_request *r, int idx, int32_t t, const cv_sample_info *info) {
    seq_state *st = &r->ss[idx];
    cv_sequence *s = st->seq;
    const cv_request_params *p = &r->p;
    int32_t prev = s->n_tokens > 0 ? s->tokens[s->n_tokens - 1] : -1;
    if (cv_sequence_append(s, t)) {
        finish_seq(e, r, idx, CV_FINISH_ABORT, CV_STOP_NONE, -1, NULL);
        return;
    }
    st->n_out++;
    e->stats_live.generation_tokens++;

    int reason = CV_FINISH_NONE, stop_kind = CV_STOP_NONE;
    int32_t stop_value = -1;
    /* min_tokens already kept EOS and the stop tokens out of the sampler. */
    for (int i = 0; i < p->n_stop_token_ids && !reason; i++)
        if (r->stop_token_ids[i] == t) { reason = CV_FINISH_STOP; stop_kind = CV_STOP_TOKEN; stop_value = t; }
    if (!reason && !p->ignore_eos && cv_detok_is_eos(&e->detok, t)) reason = CV_FINISH_STOP;

    if (!reason) {
        /* Detokenize on bytes; stop tokens and EOS add no text. */
        const char *b;
        size_t n;
        cv_detok_piece(&e->detok, prev, t, p->skip_special_tokens, &b, &n);
        if (n > 0) {
            size_t old = st->text_len;
            if (text_append(st, b, n)) {
                finish_seq(e, r, idx, CV_FINISH_ABORT, CV_STOP_NONE, -1, NULL);
                return;
            }
            if (r->stops.n > 0 && st->n_out >= p->min_tokens) {
                size_t at = 0;
                int k = cv_stop_find(&r->stops, st->text, st->text_len, old, &at);
                if (k >= 0) {
                    st->text_len = p->include_stop_str ? at + r->stops.len[k] : at;
                    if (st->emitted > st->text_len) st->emitted = st->text_len;
                    reason = CV_FINISH_STOP;
                    stop_kind = CV_STOP_STRING;
                    stop_value = k;
                }
            }
        }
    }
    if (!reason && (st->n_out >= p->max_tokens || s->n_tokens >= e->max_model_len))
        reason = CV_FINISH_LENGTH;

    size_t visible = st->text_len;
    if (!reason && r->stops.n > 0) visible -= cv_stop_holdback(&r->stops, st->text, st->text_len);
    if (visible < st->emitted) visible = st->emitted;
    cv_event *ev = push_event(e, r, idx, st->text + st->emitted, visible - st->emitted);
    if (ev) {
        st->emitted = visible;
        ev->token = t;
        if (info && p->sp.n_logprobs >= 0) {
            ev->logprob = info->logprob;
            ev->n_top = info->n_top;
            memcpy(ev->top_ids, info->top_ids, sizeof ev->top_ids);
            memcpy(ev->top_logprobs, info->top_logprobs, sizeof ev->top_logprobs);
        } else if (info) {
            ev->logprob = info->logprob;
        }
    }
    if (reason) finish_seq(e, r, idx, reason, stop_kind, stop_value, ev);
}

/* Which completion of its request sequence s is. */
static int completion_index(const cv_request *r, const cv_sequence *s) {
    for (int k = 0; k < r->p.n; k++)
        if (r->ss[k].seq == s) return k;
    return 0;
}

/* The tokens min_tokens still holds off for completion st (EOS unless
 * ignore_eos, and the stop tokens), in e->banned; returns how many. */
static int64_t banned_tokens(cv_engine *e, const cv_request *r, const seq_state *st) {
    if (st->n_out >= r->p.min_tokens) return 0;
    size_t need = (size_t)(e->detok.n_eos + r->p.n_stop_token_ids);
    if (!cv_grow((void **)&e->banned, &e->banned_cap, need, sizeof *e->banned)) return 0;
    int64_t n = 0;
    if (!r->p.ignore_eos)
        for (int i = 0; i < e->detok.n_eos; i++) e->banned[n++] = e->detok.eos_ids[i];
    for (int i = 0; i < r->p.n_stop_token_ids; i++) e->banned[n++] = r->stop_token_ids[i];
    return n;
}

/* Guided decoding: applies each guided row's mask (its completion's next
 * position) to its logits, in place; the background loop waits for masks not
 * posted yet, without holding out_lock (the grammar's thread takes the events
 * that let it compute them). A row without a mask (cancelled, or not
 * posted before a synchronous step) is marked failed.
 * Returns the number of guided rows. */
static int64_t apply_guided_masks(cv_engine *e, const cv_sched_output *plan) {
    const cv_batch *bt = &e->runner.batch;
    int64_t n_guided = 0;
    for (int64_t row = 0; row < bt->n_logits; row++)
        n_guided += ((cv_request *)plan->seqs[e->runner.sample_plan_index[row]]->owner)->p.guided != 0;
    if (n_guided == 0) return 0;
    for (int64_t row = 0; row < bt->n_logits; row++) {
        cv_sequence *s = plan->seqs[e->runner.sample_plan_index[row]];
        cv_request *r = s->owner;
        if (!r->p.guided) continue;
        int idx = completion_index(r, s);
        e->mask_failed[row] = (uint8_t)(cv_mask_box_take(&e->masks, r->id, idx, r->ss[idx].n_out,
                                                         e->loop_running || e->mask_wait, e->mask_scratch) != 0);
        if (!e->mask_failed[row])
            cv_sampler_apply_token_mask(e->ws.logits_host + row * e->vocab, e->vocab, e->mask_scratch);
    }
    return n_guided;
}

/* Samples one token for every logits row of the step whose request is guided
 * (or not, per `guided`) and accepts it (stops, detokenization, events).
 * Caller holds out_lock. */
static void sample_batch(cv_engine *e, const cv_sched_output *plan, int guided) {
    const cv_batch *bt = &e->runner.batch;
    for (int64_t row = 0; row < bt->n_logits; row++) {
        cv_sequence *s = plan->seqs[e->runner.sample_plan_index[row]];
        cv_request *r = s->owner;
        if ((r->p.guided != 0) != guided) continue;
        int idx = completion_index(r, s);
        seq_state *st = &r->ss[idx];
        if (st->finished) continue;
        float *logits = e->ws.logits_host + row * e->vocab;
        if (guided && e->mask_failed[row]) {
            finish_seq(e, r, idx, CV_FINISH_ABORT, CV_STOP_NONE, -1, NULL);
            continue;
        }
        int64_t n_banned = banned_tokens(e, r, st);
        cv_sample_info info;
        int32_t t = cv_sampler_sample(e->sampler, logits, &r->p.sp, s->tokens, r->n_prompt,
                                      s->tokens + r->n_prompt, s->n_tokens - r->n_prompt, e->banned,
                                      n_banned, &st->rng, &info);
        if (r->first_token == 0) r->first_token = cv_now();
        accept_token(e, r, idx, t, &info);
    }
}

/* ---- prompt logprobs (issue 17) ---- */

/* Runs the LM head on the n grouped rows and emits one prompt event per row. */
static int flush_prompt_rows(cv_engine *e, int64_t n, cv_err *err) {
    if (n == 0) return CV_OK;
    int rc = cv_model_logits(e->model, &e->ws, e->pl_rows, n, e->runner.batch.n_tokens, err);
    if (rc) return rc;
    pthread_mutex_lock(&e->out_lock);
    for (int64_t k = 0; k < n; k++) {
        cv_request *r = e->pl_req[k];
        int64_t pos = e->pl_pos[k];
        cv_sample_info info;
        cv_logprobs_of(e->ws.logits_host + k * e->vocab, e->vocab, r->prompt[pos], r->p.prompt_logprobs, &info);
        cv_event *ev = push_event(e, r, 0, NULL, 0);
        if (!ev) continue; /* out of memory for the event: the request still runs */
        ev->prompt_pos = pos;
        ev->token = r->prompt[pos];
        ev->logprob = info.logprob;
        ev->n_top = info.n_top;
        memcpy(ev->top_ids, info.top_ids, sizeof ev->top_ids);
        memcpy(ev->top_logprobs, info.top_logprobs, sizeof ev->top_logprobs);
    }
    pthread_mutex_unlock(&e->out_lock);
    return CV_OK;
}

/* The logprob of every prompt token this step's chunks predict, for requests
 * that ask for them: row p of a chunk predicts prompt token p + 1. Only those
 * rows go through the LM head again (in groups of max_num_seqs), after the
 * layers ran once for the whole ragged batch; the sampling rows' logits are
 * then recomputed, since the groups overwrote them. Positions already sent
 * (a preempted sequence recomputes its prompt) are skipped. */
static int prompt_logprobs_pass(cv_engine *e, const cv_sched_output *plan, cv_err *err) {
    const cv_batch *bt = &e->runner.batch;
    int64_t n = 0, total = 0;
    int rc;
    for (int64_t i = 0; i < plan->n_seqs; i++) {
        const cv_sequence *s = plan->seqs[i];
        cv_request *r = s->owner;
        if (r->p.prompt_logprobs == CV_NO_LOGPROBS || s != r->ss[0].seq) continue;
        int64_t start = plan->start_pos[i], end = start + plan->num_new_tokens[i];
        if (end > r->n_prompt - 1) end = r->n_prompt - 1;
        int64_t from = start > r->prompt_lp_next - 1 ? start : r->prompt_lp_next - 1;
        for (int64_t pos = from; pos < end; pos++) {
            e->pl_rows[n] = bt->query_start[i] + (int32_t)(pos - start);
            e->pl_req[n] = r;
            e->pl_pos[n] = pos + 1;
            r->prompt_lp_next = pos + 2;
            if (++n == e->max_num_seqs) {
                if ((rc = flush_prompt_rows(e, n, err))) return rc;
                total += n;
                n = 0;
            }
        }
    }
    if ((rc = flush_prompt_rows(e, n, err))) return rc;
    total += n;
    if (total > 0 && bt->n_logits > 0)
        return cv_model_logits(e->model, &e->ws, bt->logits_rows, bt->n_logits, bt->n_tokens, err);
    return CV_OK;
}

static void record_trace(cv_engine *e, const cv_sched_output *plan, double t0, double t1) {
    if (!e->tracing) return;
    if (!cv_grow((void **)&e->trace, &e->cap_trace, e->n_trace + (size_t)plan->n_seqs, sizeof *e->trace))
        return;
    for (int64_t i = 0; i < plan->n_seqs; i++) {
        cv_request *r = plan->seqs[i]->owner;
        int idx = completion_index(r, plan->seqs[i]);
        cv_trace_entry *te = &e->trace[e->n_trace++];
        te->step = e->steps;
        te->t0 = t0;
        te->t1 = t1;
        te->request_id = r->id;
        te->seq_index = idx;
        te->n_new = plan->num_new_tokens[i];
        /* a decode: the prompt computed and one new token (as the scheduler counts it) */
        te->n_prompt_work = (plan->start_pos[i] >= plan->seqs[i]->n_prompt && te->n_new == 1) ? 0 : te->n_new;
    }
}

static int engine_step(cv_engine *e, cv_err *err) {
    double t0 = cv_now();
    drain_inbox(e);
    expire_deadlines(e, t0);
    cv_sched_output plan;
    int rc = cv_scheduler_schedule(e->sched, &plan);
    if (rc < 0) return cv_set_err(err, rc, "scheduler failed");
    double t1 = cv_now();
    if (plan.n_seqs == 0) {
        pthread_mutex_lock(&e->out_lock);
        cv_scheduler_get_stats(e->sched, &e->stats_live.sched);
        e->stats_snapshot = e->stats_live;
        pthread_mutex_unlock(&e->out_lock);
        return 0;
    }
    for (int64_t i = 0; i < plan.n_seqs; i++) {
        cv_request *r = plan.seqs[i]->owner;
        if (r->first_scheduled == 0) {
            r->first_scheduled = t1;
            leave_queue(e, r);
        }
        if (plan.start_pos[i] < plan.seqs[i]->n_prompt) {
            int64_t end = plan.start_pos[i] + plan.num_new_tokens[i];
            if (end > plan.seqs[i]->n_prompt) end = plan.seqs[i]->n_prompt;
            e->stats_live.prompt_tokens_computed += end - plan.start_pos[i];
        }
    }
    if ((rc = cv_runner_build(&e->runner, &plan, err))) return rc;
    double t1b = cv_now();
    if ((rc = cv_model_forward(e->model, &e->ws, e->kv.layers, &e->runner.batch, err))) return rc;
    if ((rc = prompt_logprobs_pass(e, &plan, err))) return rc;
    double t2 = cv_now();
    cv_scheduler_commit(e->sched, &plan);

    /* Forks first: the children take the prompt only, before the parent's new token. */
    for (int64_t i = 0; i < plan.n_seqs; i++) {
        cv_request *r = plan.seqs[i]->owner;
        if (r->p.n > 1 && !r->forked && plan.seqs[i] == r->ss[0].seq &&
            plan.seqs[i]->n_computed >= r->n_prompt)
            fork_children(e, r);
    }

    /* Unconstrained rows first: they never wait on a grammar. */
    pthread_mutex_lock(&e->out_lock);
    sample_batch(e, &plan, 0);
    pthread_mutex_unlock(&e->out_lock);
    if (apply_guided_masks(e, &plan) > 0) {
        pthread_mutex_lock(&e->out_lock);
        sample_batch(e, &plan, 1);
        pthread_mutex_unlock(&e->out_lock);
    }
    pthread_mutex_lock(&e->out_lock);
    double t3 = cv_now();
    record_trace(e, &plan, t0, t3);
    e->steps++;
    e->stats_live.steps = e->steps;
    e->stats_live.time_schedule += t1 - t0;
    e->stats_live.time_build += t1b - t1;
    e->stats_live.time_forward += t2 - t1b;
    e->stats_live.time_sample += t3 - t2;
    e->stats_live.time_step += t3 - t0;
    pthread_mutex_unlock(&e->out_lock);

    /* Retire finished requests (their sequences left the scheduler already). */
    cv_request *r = e->active;
    while (r) {
        cv_request *nx = r->next;
        retire_if_done(e, r);
        r = nx;
    }
    pthread_mutex_lock(&e->out_lock);
    cv_scheduler_get_stats(e->sched, &e->stats_live.sched);
    e->stats_snapshot = e->stats_live;
    pthread_mutex_unlock(&e->out_lock);
    return (int)plan.n_seqs;
}

int cv_engine_step(cv_engine *e, cv_err *err) {
    /* loop_running changes only on the thread that owns the engine, the caller's */
    if (e->loop_running)
        return cv_set_err(err, CV_ERR_STATE, "cannot step the engine while its background loop runs");
    return engine_step(e, err);
}

/* ------------------------------------------------------------------------- */
/* Background loop */

static void *loop_main(void *arg) {
    cv_engine *e = arg;
    cv_set_thread_name("cv-engine");
    for (;;) {
        pthread_mutex_lock(&e->in_lock);
        while (!e->stop_flag && e->n_inbox == 0 && e->n_aborts == 0 && e->n_active == 0)
            pthread_cond_wait(&e->in_cond, &e->in_lock);
        int stop = e->stop_flag;
        pthread_mutex_unlock(&e->in_lock);
        if (stop) break;
        cv_err err;
        int rc = engine_step(e, &err);
        if (rc < 0) {
            /* A failed step fails every request; the loop goes on serving new ones. */
            pthread_mutex_lock(&e->out_lock);
            e->loop_err = err;
            e->loop_failed = 1;
            pthread_mutex_unlock(&e->out_lock);
            cv_request *r = e->active;
            while (r) { cv_request *nx = r->next; abort_request(e, r); r = nx; }
        }
        pthread_mutex_lock(&e->out_lock);
        int have = e->outbox.n_ev > 0;
        pthread_mutex_unlock(&e->out_lock);
        if (have && e->wake_fd >= 0) {
            uint64_t one = 1;
            ssize_t w;
            do { w = write(e->wake_fd, &one, sizeof one); } while (w < 0 && errno == EINTR);
        }
    }
    return NULL;
}

int cv_engine_start_loop(cv_engine *e, int wake_fd, cv_err *err) {
    if (e->loop_running) return cv_set_err(err, CV_ERR_STATE, "the engine loop is already running");
    e->wake_fd = wake_fd;
    e->stop_flag = 0;
    if (pthread_create(&e->thread, NULL, loop_main, e) != 0)
        return cv_set_err(err, CV_ERR_NOMEM, "cannot start the engine thread");
    e->loop_running = 1;
    return CV_OK;
}

void cv_engine_stop_loop(cv_engine *e) {
    if (!e->loop_running) return;
    pthread_mutex_lock(&e->in_lock);
    e->stop_flag = 1;
    pthread_cond_signal(&e->in_cond);
    pthread_mutex_unlock(&e->in_lock);
    cv_mask_box_set_stop(&e->masks, 1); /* a sampler waiting on a mask gives up */
    pthread_join(e->thread, NULL);
    cv_mask_box_set_stop(&e->masks, 0);
    e->loop_running = 0;
}

int cv_engine_loop_error(cv_engine *e, cv_err *err) {
    pthread_mutex_lock(&e->out_lock);
    int rc = e->loop_failed ? e->loop_err.code : CV_OK;
    if (e->loop_failed && err) *err = e->loop_err;
    e->loop_failed = 0;
    pthread_mutex_unlock(&e->out_lock);
    return rc;
}

void cv_engine_get_stats(cv_engine *e, cv_engine_stats *st) {
    pthread_mutex_lock(&e->out_lock);
    *st = e->stats_snapshot;
    pthread_mutex_unlock(&e->out_lock);
    pthread_mutex_lock(&e->in_lock);
    st->num_queued = e->n_queued;
    st->requests_rejected = e->n_rejected;
    pthread_mutex_unlock(&e->in_lock);
}

const void *cv_engine_model_config(cv_engine *e) { return &e->model->cfg; }
int64_t cv_engine_vocab_size(cv_engine *e) { return e->vocab; }

void cv_engine_weight_info(cv_engine *e, size_t *bytes, int64_t *n_params, cv_dtype *dtype,
                           cv_dtype *kv_dtype) {
    *bytes = e->model->weight_bytes;
    *n_params = e->model->n_params;
    *dtype = e->model->dtype;
    *kv_dtype = e->kv.layers[0].dtype;
}

size_t cv_engine_embed_bytes(cv_engine *e) { return e->model->embed.bytes; }

cv_dtype cv_engine_matrix_dtype(cv_engine *e) {
    return e->model->cfg.n_layers > 0 ? e->model->layers[0].w_gate_up.dtype : e->model->lm_head.dtype;
}

void cv_engine_set_trace(cv_engine *e, int on) {
    pthread_mutex_lock(&e->out_lock);
    e->tracing = on;
    pthread_mutex_unlock(&e->out_lock);
}

size_t cv_engine_take_trace(cv_engine *e, cv_trace_entry **entries) {
    pthread_mutex_lock(&e->out_lock);
    size_t n = e->n_trace;
    *entries = e->trace;
    e->trace = NULL;
    e->n_trace = e->cap_trace = 0;
    pthread_mutex_unlock(&e->out_lock);
    return n;
}
