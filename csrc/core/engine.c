/* The engine's orchestration: create and destroy, one step (schedule, build
 * the batch, forward, sample, retire), the background loop that steps on its
 * own thread, and stats, model facts and the step trace. A request's life is
 * in request.c, the sampling part of a step in engine_sample.c. */
#include "engine_internal.h"
#include "../../base/quant_format.h"

#include <errno.h>
#include <stdlib.h>
#include <unistd.h>

/* ------------------------------------------------------------------------- */
/* Creation */

/* The default KV cache: on a device, gpu_memory_utilization of its free memory
 * (weights and activations are already allocated); on the CPU a quarter of the
 * available memory, at most 4 GiB. Never more than kv_sequences full-length
 * sequences need, never less than one. */
static size_t default_kv_bytes(cv_engine *e, size_t per_token, double gpu_util, int64_t kv_sequences) {
    size_t share = 0, free_b = 0, total_b = 0;
    if (e->backend->mem_info && e->backend->mem_info(e->backend, &free_b, &total_b) == 0) {
        share = (size_t)((double)free_b * (gpu_util > 0 && gpu_util <= 1 ? gpu_util : 0.9));
    } else {
        long pages = sysconf(_SC_AVPHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
        size_t avail = (pages > 0 && psz > 0) ? (size_t)pages * (size_t)psz : 0;
        share = avail / 4;
        if (share > ((size_t)4 << 30)) share = (size_t)4 << 30;
    }
    size_t want = per_token * (size_t)e->max_model_len * (size_t)kv_sequences;
    size_t minimum = per_token * (size_t)(e->max_model_len + 2 * e->block_size);
    size_t kv = share < want ? share : want;
    return kv < minimum ? minimum : kv;
}

/* The sizes a step works within, from the config and the model: the context,
 * the sequences, the tokens and the logits rows of one step. */
static int size_steps(cv_engine *e, const cv_engine_config *cfg, const cv_model_config *mc, cv_err *err) {
    e->vocab = mc->vocab_size;
    e->max_model_len = cfg->max_model_len > 0 ? cfg->max_model_len : mc->max_pos;
    if (e->max_model_len > mc->max_pos)
        return cv_set_field_err(err, CV_ERR_INVALID, "max_model_len",
                                "max_model_len %lld exceeds the model's context of %lld tokens (its "
                                "max_position_embeddings, or its sliding_window when smaller)",
                                (long long)e->max_model_len, (long long)mc->max_pos);
    e->max_num_seqs = cfg->max_num_seqs;
    e->block_size = cfg->block_size;
    e->max_tokens_step = cfg->max_num_batched_tokens > 0 ? cfg->max_num_batched_tokens : 2048;
    if (!cfg->enable_chunked_prefill && e->max_tokens_step < e->max_model_len) {
        if (cfg->max_num_batched_tokens > 0)
            return cv_set_field_err(err, CV_ERR_INVALID, "max_num_batched_tokens",
                                    "max_num_batched_tokens (%lld) must be >= max_model_len (%lld) when "
                                    "enable_chunked_prefill is False",
                                    (long long)e->max_tokens_step, (long long)e->max_model_len);
        e->max_tokens_step = e->max_model_len;
    }
    if (e->max_tokens_step < e->max_num_seqs) e->max_tokens_step = e->max_num_seqs;
    /* a speculating sequence wants a logits row per proposal + 1 */
    e->rows.max_rows = e->max_num_seqs;
    if (cfg->spec.method != CV_SPEC_NONE) {
        int64_t want = e->max_num_seqs * (cfg->spec.num_tokens + 1);
        e->rows.max_rows = want < e->max_tokens_step ? want : e->max_tokens_step;
        if (e->rows.max_rows < e->max_num_seqs) e->rows.max_rows = e->max_num_seqs;
    }
    return CV_OK;
}

/* The stats a new engine reports before its first step. */
static void first_stats(cv_engine *e) {
    e->stats_live.num_blocks = e->worker.kv.num_blocks;
    e->stats_live.block_size = e->block_size;
    e->stats_live.max_model_len = e->max_model_len;
    e->stats_live.request_room = cv_engine_request_room(e);
    e->stats_live.max_num_seqs = e->max_num_seqs;
    e->stats_live.max_num_batched_tokens = e->max_tokens_step;
    e->stats_live.kv_cache_bytes = e->worker.kv.bytes;
    cv_scheduler_get_stats(e->sched, &e->stats_live.sched);
    e->outbox.stats = e->stats_live;
}

int cv_engine_create(cv_engine **out, const cv_engine_config *cfg, cv_err *err) {
    int rc = CV_OK;
    cv_engine *e = calloc(1, sizeof *e);
    *out = NULL;
    if (!e) return cv_set_err(err, CV_ERR_NOMEM, "out of memory");
    e->wake_fd = -1;
    if ((rc = cv_engine_config_check(cfg, err)) ||
        (rc = cv_inbox_init(&e->in, cfg->max_queued_requests > 0 ? cfg->max_queued_requests : 0, err)) ||
        (rc = cv_engine_outbox_init(&e->outbox, err)))
        goto fail;
    e->seed = cfg->seed;
    if (cfg->use_cuda) {
        e->backend = cv_cuda_backend_create(0, err);
    } else {
        e->backend = cv_cpu_backend_create(cfg->num_threads > 0 ? (int)cfg->num_threads : 0, 0, err);
        if (e->backend) cv_backend_set_exact_activations(e->backend, cfg->exact_activations);
    }
    if (!e->backend) { rc = err ? err->code : CV_ERR_STATE; if (rc >= 0) rc = CV_ERR_STATE; goto fail; }
    if ((rc = cv_worker_load(&e->worker, e->backend, cfg->model_path, cfg->dtype, cfg->quantization, cfg->cancel,
                             err)))
        goto fail;

    const cv_model_config *mc = &e->worker.model->cfg;
    if ((rc = size_steps(e, cfg, mc, err))) goto fail;

    /* Activations before the KV cache, which takes a share of what is left. */
    if ((rc = cv_worker_init_compute(&e->worker, e->max_tokens_step, e->max_num_seqs, e->rows.max_rows,
                                     e->max_model_len, e->block_size, err)))
        goto fail;

    if (cfg->enable_lora) {
        const cv_dtype ldt = cfg->lora_dtype != CV_DTYPE_INVALID ? cfg->lora_dtype
                                                                 : cv_lora_auto_dtype(e->worker.model); /* "auto" */
        if ((rc = cv_worker_init_lora(&e->worker, cfg->max_loras, cfg->max_lora_rank, e->max_tokens_step,
                                      e->max_num_seqs, ldt, err)))
            goto fail;
    }

    /* KV cache ("auto": cv_worker_auto_kv_dtype) */
    cv_dtype kvt = cfg->kv_dtype;
    if (kvt == CV_DTYPE_INVALID) kvt = cv_worker_auto_kv_dtype(&e->worker);
    size_t per_token = cv_kv_bytes_per_token(mc->n_layers, mc->n_kv_heads, mc->head_dim, kvt);
    size_t kv = cfg->kv_cache_bytes > 0 ? (size_t)cfg->kv_cache_bytes
                                         : default_kv_bytes(e, per_token, cfg->gpu_memory_utilization,
                                                            cv_engine_config_kv_sequences(cfg));
    if ((rc = cv_worker_init_cache(&e->worker, kvt, e->block_size, kv, cfg->enable_prefix_caching, cfg->cancel,
                                   err)))
        goto fail;

    cv_scheduler_config sc = {
        .max_num_seqs = e->max_num_seqs,
        .max_num_batched_tokens = e->max_tokens_step, .max_model_len = e->max_model_len,
        .enable_chunked_prefill = cfg->enable_chunked_prefill, .policy = cfg->policy,
        .max_prefill_tokens_while_decoding = cv_engine_config_prefill_cap(cfg),
        /* the config's 0 is "no margin", the scheduler's -1; unset is the scheduler's default */
        .admission_reserve = cfg->admission_reserve == CV_CONFIG_AUTO ? 0
                             : cfg->admission_reserve == 0            ? -1
                                                                      : (int32_t)cfg->admission_reserve,
    };
    e->sched = cv_scheduler_create(&sc, e->worker.blocks, err);
    if (!e->sched) { rc = err ? err->code : CV_ERR_STATE; goto fail; }
    e->adaptive_batch_limit = cfg->adaptive_batch_limit && cfg->policy != CV_SCHED_STATIC;
    int n_samplers = e->backend->host_parallel && e->backend->host_workers > 1 ? e->backend->host_workers : 1;
    if (n_samplers > e->max_num_seqs) n_samplers = (int)e->max_num_seqs;
    cv_draft_config dc = {
        .dtype = cfg->dtype, .quantization = cfg->quantization, .target_vocab = e->vocab,
        .max_model_len = e->max_model_len, .max_tokens = e->max_tokens_step, .block_size = e->block_size,
        .kv_bytes_cap = e->worker.kv.bytes,
    };
    if ((rc = cv_prompt_lp_rows_init(&e->prompt_lp, e->max_num_seqs, err)) ||
        (rc = cv_sample_rows_init(&e->rows, e->rows.max_rows, n_samplers, e->vocab, err)) ||
        (rc = cv_spec_state_init(&e->spec, &cfg->spec, e->max_num_seqs, dc, e->backend, cfg->cancel, err)) ||
        (rc = cv_detok_init(&e->detok, e->vocab, cfg, mc, err)) ||
        (rc = cv_guided_init(&e->guided, e->vocab, e->max_tokens_step, err)))
        goto fail;
    first_stats(e);
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
    while (r) { cv_request *nx = r->next; cv_request_free(r); r = nx; }
    r = e->in.head;
    while (r) { cv_request *nx = r->next; cv_request_free(r); r = nx; }
    /* Sequences were freed with their requests; the scheduler holds no memory of them. */
    cv_scheduler_destroy(e->sched);
    cv_sample_rows_free(&e->rows);
    cv_spec_state_free(&e->spec);
    cv_worker_free(&e->worker);
    if (e->backend) e->backend->destroy(e->backend);
    cv_detok_free(&e->detok);
    cv_guided_free(&e->guided);
    cv_prompt_lp_rows_free(&e->prompt_lp);
    cv_inbox_free(&e->in);
    cv_engine_outbox_free(&e->outbox);
    free(e);
}

/* ------------------------------------------------------------------------- */
/* Step */

static void record_trace(cv_engine *e, const cv_sched_output *plan, double t0, double t1) {
    if (!e->outbox.tracing) return;
    cv_engine_outbox *o = &e->outbox;
    if (!cv_grow((void **)&o->trace, &o->cap_trace, o->n_trace + (size_t)plan->n_seqs, sizeof *o->trace)) return;
    for (int64_t i = 0; i < plan->n_seqs; i++) {
        cv_request *r = plan->seqs[i]->owner;
        int idx = cv_request_completion_index(r, plan->seqs[i]);
        cv_trace_entry *te = &o->trace[o->n_trace++];
        te->step = e->steps;
        te->t0 = t0;
        te->t1 = t1;
        te->request_id = r->id;
        te->seq_index = idx;
        te->n_new = plan->num_new_tokens[i];
        /* a decode: the prompt computed and one new token (as the scheduler counts it) */
        te->n_prompt_work =
            (plan->start_pos[i] >= plan->seqs[i]->n_prompt && te->n_new == 1 + e->spec.plan_spec[i]) ? 0 : te->n_new;
    }
}

/* Whether sequence s of request r may get proposals now: it decodes (its
 * prompt computed, one token to compute) and has room for at least one
 * proposal and the token after it. Returns how many it may take. */
static int64_t proposal_room(const cv_engine *e, const cv_request *r, int i) {
    const cv_sequence *s = r->ss[i].seq;
    if (!s || r->ss[i].finished || s->status != CV_SEQ_RUNNING || s->n_spec != 0 || s->n_computed < s->n_prompt ||
        s->n_tokens - s->n_computed != 1)
        return 0;
    int64_t k = s->max_total - s->n_tokens - 1;
    return k > e->spec.cfg.num_tokens ? e->spec.cfg.num_tokens : k;
}

static void append_proposals(cv_sequence *s, const int32_t *t, int64_t m) {
    for (int64_t j = 0; j < m; j++) {
        if (cv_sequence_append(s, t[j])) break; /* out of memory: fewer proposals */
        s->n_spec++;
    }
}

/* Speculative decoding: appends proposals to every running sequence that
 * decodes, unless the batch is larger than disable_by_batch_size. The
 * scheduler keeps those it can plan. A failure of the draft model fails the
 * step. */
static int propose(cv_engine *e, cv_err *err) {
    cv_spec_state *sp = &e->spec;
    if (sp->cfg.method == CV_SPEC_NONE) return CV_OK;
    if (sp->cfg.disable_by_batch_size > 0 && cv_scheduler_num_running(e->sched) > sp->cfg.disable_by_batch_size) {
        e->stats_live.spec_steps_disabled++;
        cv_draft_release_all(sp->draft);
        return CV_OK;
    }
    int64_t n = 0;
    for (cv_request *r = e->active; r; r = r->next) {
        if (r->p.guided) continue; /* its masks are posted one position at a time */
        for (int i = 0; i < r->p.n; i++) {
            int64_t k = proposal_room(e, r, i);
            if (k <= 0) continue;
            cv_sequence *s = r->ss[i].seq;
            if (sp->cfg.method == CV_SPEC_NGRAM) {
                append_proposals(s, sp->proposals,
                                 cv_spec_ngram_propose(sp->proposals, s->tokens, s->n_tokens, sp->cfg.lookup_min,
                                                       sp->cfg.lookup_max, k));
            } else if (n < sp->draft_max_seqs) {
                sp->draft_seqs[n] = s;
                sp->draft_want[n++] = k;
            }
        }
    }
    if (sp->cfg.method != CV_SPEC_DRAFT) return CV_OK;
    int64_t before = cv_draft_tokens_computed(sp->draft);
    int rc = cv_draft_propose(sp->draft, sp->draft_seqs, sp->draft_want, n, sp->proposals, sp->draft_got, err);
    e->stats_live.spec_draft_tokens += cv_draft_tokens_computed(sp->draft) - before;
    if (rc) return rc;
    for (int64_t i = 0; i < n; i++)
        append_proposals(sp->draft_seqs[i], sp->proposals + i * sp->cfg.num_tokens, sp->draft_got[i]);
    return CV_OK;
}

/* One step into the step-time model, and the running target it implies; the
 * last target stands while the model cannot pin the knee down. */
static void observe_step_cost(cv_engine *e, const cv_sched_output *plan, double seconds) {
    int64_t decode = 0, context = 0;
    for (int64_t i = 0; i < plan->n_seqs; i++)
        if (plan->start_pos[i] >= plan->seqs[i]->n_prompt) {
            decode += plan->num_new_tokens[i];
            context += plan->start_pos[i];
        }
    cv_step_cost_observe(&e->step_cost, decode, plan->total_tokens - decode, context, seconds);
    const int64_t knee = cv_step_cost_knee(&e->step_cost, e->max_num_seqs);
    if (knee > 0) {
        cv_scheduler_set_running_target(e->sched, knee);
        e->steps_since_probe = 0;
    } else if (++e->steps_since_probe >= CV_STEP_COST_PROBE_EVERY && decode >= CV_STEP_COST_PROBE_MIN_DECODES &&
               cv_scheduler_num_unfinished(e->sched) > cv_scheduler_num_running(e->sched)) {
        /* only while requests wait: the knee decides admissions, nothing else */
        cv_scheduler_limit_next_decodes(e->sched, decode / 2);
        e->steps_since_probe = 0;
    }
}

static int engine_step(cv_engine *e, cv_err *err) {
    double t0 = cv_now();
    cv_drain_inbox(e);
    cv_expire_deadlines(e, t0);
    double tp = cv_now();
    int rc = propose(e, err);
    if (rc) return rc;
    e->stats_live.time_propose += cv_now() - tp;
    cv_sched_output plan;
    rc = cv_scheduler_schedule(e->sched, &plan);
    if (rc < 0) return cv_set_err(err, rc, "scheduler failed");
    double t1 = cv_now();
    if (plan.n_seqs == 0) {
        pthread_mutex_lock(&e->outbox.lock);
        cv_scheduler_get_stats(e->sched, &e->stats_live.sched);
        e->outbox.stats = e->stats_live;
        pthread_mutex_unlock(&e->outbox.lock);
        return 0;
    }
    for (int64_t i = 0; i < plan.n_seqs; i++) {
        cv_request *r = plan.seqs[i]->owner;
        if (r->first_scheduled == 0) {
            r->first_scheduled = t1;
            cv_request_leave_queue(e, r);
        }
        if (plan.start_pos[i] < plan.seqs[i]->n_prompt) {
            int64_t end = plan.start_pos[i] + plan.num_new_tokens[i];
            if (end > plan.seqs[i]->n_prompt) end = plan.seqs[i]->n_prompt;
            e->stats_live.prompt_tokens_computed += end - plan.start_pos[i];
        }
    }
    for (int64_t i = 0; i < plan.n_seqs; i++) e->spec.plan_spec[i] = (int32_t)plan.seqs[i]->n_spec;
    /* Adapter slots are loaded by other threads between steps, never under the
     * device work (which waits for nothing the loading thread holds). */
    cv_lora_pool_lock(&e->worker.lora);
    rc = cv_worker_prepare(&e->worker, &plan, err);
    double t1b = cv_now();
    if (!rc) rc = cv_worker_forward(&e->worker, err);
    if (!rc) rc = cv_prompt_logprobs_pass(e, &plan, err);
    cv_lora_pool_unlock(&e->worker.lora);
    if (rc) return rc;
    double t2 = cv_now();
    cv_scheduler_commit(e->sched, &plan);

    /* Forks first: the children take the prompt only, before the parent's new token. */
    for (int64_t i = 0; i < plan.n_seqs; i++) {
        cv_request *r = plan.seqs[i]->owner;
        if (r->p.n > 1 && !r->forked && plan.seqs[i] == r->ss[0].seq &&
            plan.seqs[i]->n_computed >= r->n_prompt)
            cv_request_fork_children(e, r);
    }

    /* Unconstrained rows first: they never wait on a grammar. */
    pthread_mutex_lock(&e->outbox.lock);
    cv_sample_batch(e, &plan, 0);
    pthread_mutex_unlock(&e->outbox.lock);
    if (cv_apply_guided_masks(e, &plan) > 0) {
        pthread_mutex_lock(&e->outbox.lock);
        cv_sample_batch(e, &plan, 1);
        pthread_mutex_unlock(&e->outbox.lock);
    }
    double t3 = cv_now();
    if (e->adaptive_batch_limit) observe_step_cost(e, &plan, t3 - t1); /* the stepping thread's own state */
    pthread_mutex_lock(&e->outbox.lock);
    record_trace(e, &plan, t0, t3);
    e->steps++;
    e->stats_live.steps = e->steps;
    e->stats_live.time_schedule += t1 - t0;
    e->stats_live.time_build += t1b - t1;
    e->stats_live.time_forward += t2 - t1b;
    e->stats_live.time_sample += t3 - t2;
    e->stats_live.time_step += t3 - t0;
    pthread_mutex_unlock(&e->outbox.lock);

    /* Retire finished requests (their sequences left the scheduler already). */
    cv_request *r = e->active;
    while (r) {
        cv_request *nx = r->next;
        cv_request_retire_if_done(e, r);
        r = nx;
    }
    if (!e->active) cv_draft_release_all(e->spec.draft); /* idle: the draft's blocks back too */
    e->stats_live.spec_draft_blocks_used = cv_draft_blocks_used(e->spec.draft);
    pthread_mutex_lock(&e->outbox.lock);
    cv_scheduler_get_stats(e->sched, &e->stats_live.sched);
    e->outbox.stats = e->stats_live;
    pthread_mutex_unlock(&e->outbox.lock);
    return (int)plan.n_seqs;
}

/* CV_ERR_BUSY, naming what was refused, while the background loop steps. */
static int refuse_while_looping(const cv_engine *e, const char *what, cv_err *err) {
    /* loop_running changes only on the thread that owns the engine, the caller's */
    if (!e->loop_running) return CV_OK;
    return cv_set_err(err, CV_ERR_BUSY, "cannot %s while its background loop runs", what);
}

int cv_engine_step(cv_engine *e, cv_err *err) {
    int rc = refuse_while_looping(e, "step the engine", err);
    return rc ? rc : engine_step(e, err);
}

int cv_engine_set_mask_wait(cv_engine *e, int on, cv_err *err) {
    int rc = refuse_while_looping(e, "change the engine's mask wait", err);
    if (rc == CV_OK) e->guided.wait = on;
    return rc;
}

/* ------------------------------------------------------------------------- */
/* Background loop */

static void *loop_main(void *arg) {
    cv_engine *e = arg;
    cv_set_thread_name("cv-engine");
    for (;;) {
        pthread_mutex_lock(&e->in.lock);
        while (!e->stop_flag && e->in.n_requests == 0 && e->in.n_aborts == 0 && e->n_active == 0)
            pthread_cond_wait(&e->in.cond, &e->in.lock);
        int stop = e->stop_flag;
        pthread_mutex_unlock(&e->in.lock);
        if (stop) break;
        cv_err err;
        int rc = engine_step(e, &err);
        if (rc < 0) {
            /* A failed step fails every request; the loop goes on serving new ones. */
            pthread_mutex_lock(&e->outbox.lock);
            e->loop_err = err;
            e->loop_failed = 1;
            pthread_mutex_unlock(&e->outbox.lock);
            cv_request *r = e->active;
            while (r) { cv_request *nx = r->next; cv_request_abort(e, r); r = nx; }
        }
        pthread_mutex_lock(&e->outbox.lock);
        int have = e->outbox.events.n_ev > 0;
        pthread_mutex_unlock(&e->outbox.lock);
        if (have && e->wake_fd >= 0) {
            uint64_t one = 1;
            ssize_t w;
            do { w = write(e->wake_fd, &one, sizeof one); } while (w < 0 && errno == EINTR);
        }
    }
    return NULL;
}

int cv_engine_start_loop(cv_engine *e, int wake_fd, cv_err *err) {
    if (e->loop_running) return cv_set_err(err, CV_ERR_BUSY, "the engine loop is already running");
    e->wake_fd = wake_fd;
    e->stop_flag = 0;
    if (pthread_create(&e->thread, NULL, loop_main, e) != 0)
        return cv_set_err(err, CV_ERR_NOMEM, "cannot start the engine thread");
    e->loop_running = 1;
    return CV_OK;
}

void cv_engine_stop_loop(cv_engine *e) {
    if (!e->loop_running) return;
    pthread_mutex_lock(&e->in.lock);
    e->stop_flag = 1;
    pthread_cond_signal(&e->in.cond);
    pthread_mutex_unlock(&e->in.lock);
    cv_mask_box_set_stop(&e->guided.box, 1); /* a sampler waiting on a mask gives up */
    pthread_join(e->thread, NULL);
    cv_mask_box_set_stop(&e->guided.box, 0);
    e->loop_running = 0;
}

int cv_engine_loop_error(cv_engine *e, cv_err *err) {
    pthread_mutex_lock(&e->outbox.lock);
    int rc = e->loop_failed ? e->loop_err.code : CV_OK;
    if (e->loop_failed && err) *err = e->loop_err;
    e->loop_failed = 0;
    pthread_mutex_unlock(&e->outbox.lock);
    return rc;
}

void cv_engine_get_stats(cv_engine *e, cv_engine_stats *st) {
    pthread_mutex_lock(&e->outbox.lock);
    *st = e->outbox.stats;
    pthread_mutex_unlock(&e->outbox.lock);
    pthread_mutex_lock(&e->in.lock);
    st->num_queued = e->in.n_queued;
    st->requests_rejected = e->in.n_rejected;
    pthread_mutex_unlock(&e->in.lock);
}

int cv_engine_check_invariants(cv_engine *e, cv_err *err) {
    int rc = refuse_while_looping(e, "check the engine's invariants", err);
    if (!rc) rc = cv_scheduler_check(e->sched, err);
    return rc ? rc : cv_draft_check(e->spec.draft, err);
}

const void *cv_engine_model_config(cv_engine *e) { return &e->worker.model->cfg; }
int64_t cv_engine_vocab_size(cv_engine *e) { return e->vocab; }

void cv_engine_weight_info(cv_engine *e, size_t *bytes, int64_t *n_params, cv_dtype *dtype,
                           cv_dtype *kv_dtype) {
    *bytes = e->worker.model->weight_bytes;
    *n_params = e->worker.model->n_params;
    *dtype = e->worker.model->dtype;
    *kv_dtype = e->worker.kv.layers[0].dtype;
}

size_t cv_engine_embed_bytes(cv_engine *e) { return e->worker.model->embed.bytes; }

cv_dtype cv_engine_lm_head_dtype(cv_engine *e) { return e->worker.model->lm_head.dtype; }

cv_dtype cv_engine_matrix_dtype(cv_engine *e) {
    return cv_worker_matrix_dtype(&e->worker);
}

void cv_engine_set_trace(cv_engine *e, int on) {
    pthread_mutex_lock(&e->outbox.lock);
    e->outbox.tracing = on;
    pthread_mutex_unlock(&e->outbox.lock);
}

size_t cv_engine_take_trace(cv_engine *e, cv_trace_entry **entries) {
    pthread_mutex_lock(&e->outbox.lock);
    size_t n = e->outbox.n_trace;
    *entries = e->outbox.trace;
    e->outbox.trace = NULL;
    e->outbox.n_trace = e->outbox.cap_trace = 0;
    pthread_mutex_unlock(&e->outbox.lock);
    return n;
}

