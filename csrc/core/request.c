/* A request's life in the engine: validation, add and abort (any thread,
 * through the inbox), then on the stepping thread its sequences, forks,
 * accepted tokens (stops, detokenized text, events), deadlines, and its
 * retirement once every completion finished. */
#include "engine_internal.h"

#include <stdlib.h>
#include <string.h>

void cv_request_free(cv_request *r) {
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

cv_event *cv_request_push_event(cv_engine *e, cv_request *r, int idx, const char *text, size_t len) {
    return cv_outbox_push(&e->outbox.events, r->id, idx, text, len);
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
    pthread_mutex_lock(&e->outbox.lock);
    size_t n = cv_outbox_take(&e->outbox.events, events, text);
    pthread_mutex_unlock(&e->outbox.lock);
    return n;
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

int64_t cv_engine_request_room(const cv_engine *e) {
    const int64_t cache = (int64_t)(e->worker.kv.num_blocks - 1) * e->block_size;
    return cache < e->max_model_len ? cache : e->max_model_len;
}

/* max_tokens, or for "the rest" what the context and the cache leave. */
static int64_t resolved_max_tokens(const cv_engine *e, int64_t n_prompt, const cv_request_params *p) {
    return p->max_tokens == CV_MAX_TOKENS_REST ? cv_engine_request_room(e) - n_prompt : p->max_tokens;
}

int cv_engine_check_request(cv_engine *e, const int32_t *prompt, int64_t n_prompt,
                            const cv_request_params *p, cv_err *err) {
    int rc = cv_request_params_check(p, err);
    if (rc) return rc;
    if ((rc = cv_engine_lora_check(e, p->lora_slot, p->lora_id, err))) return rc;
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
    if (n_prompt < e->max_model_len && n_prompt >= cv_engine_request_room(e))
        return cv_set_field_err(err, CV_ERR_INVALID, "prompt",
                                "the prompt has %lld tokens but the whole KV cache holds %lld, with no "
                                "room left to generate; raise kv_cache_memory or shorten the prompt",
                                (long long)n_prompt, (long long)cv_engine_request_room(e));
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
    if (need > e->worker.kv.num_blocks - 1)
        return cv_set_field_err(err, CV_ERR_INVALID, "max_tokens",
                                "the request needs %lld KV blocks but the whole cache holds %lld; "
                                "raise kv_cache_memory or lower max_tokens",
                                (long long)need, (long long)(e->worker.kv.num_blocks - 1));
    for (int i = 0; i < p->n_stop_token_ids; i++)
        if (p->stop_token_ids[i] >= e->vocab)
            return cv_set_field_err(err, CV_ERR_INVALID, "stop_token_ids",
                                    "stop_token_ids contains %d, outside the vocabulary [0, %lld)",
                                    p->stop_token_ids[i], (long long)e->vocab);
    if ((rc = cv_logit_controls_check_vocab(&p->sp.ctl, e->vocab, err))) return rc;
    int held_off = p->min_tokens > 0; /* min_tokens bans EOS (unless ignore_eos) and the stop tokens */
    return cv_logit_controls_check_allowed(&p->sp.ctl, e->vocab, e->detok.eos_ids,
                                           held_off && !p->ignore_eos ? e->detok.n_eos : 0, p->stop_token_ids,
                                           held_off ? p->n_stop_token_ids : 0, err);
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
            cv_request_free(r);
            return cv_set_err(err, CV_ERR_INVALID, "stop strings must not be empty");
        }
        if (src) goto nomem;
    }
    /* every completion that runs (best_of of them) is masked */
    if (p->guided && cv_mask_box_open(&e->guided.box, request_id, r->p.n)) goto nomem;
    pthread_mutex_lock(&e->in.lock);
    if (!p->accepted && e->in.max_queued > 0 && e->in.n_queued >= e->in.max_queued) {
        int64_t queued = e->in.n_queued;
        e->in.n_rejected++;
        pthread_mutex_unlock(&e->in.lock);
        cv_request_free(r);
        return cv_set_err(err, CV_ERR_OVERLOADED,
                          "the engine is overloaded: %lld requests already wait to be scheduled "
                          "(max_queued_requests=%lld); retry later",
                          (long long)queued, (long long)e->in.max_queued);
    }
    e->in.n_queued++;
    r->queued = 1;
    r->arrival_order = e->in.arrival_counter++;
    if (e->in.tail) e->in.tail->next = r; else e->in.head = r;
    r->prev = e->in.tail;
    e->in.tail = r;
    e->in.n_requests++;
    pthread_cond_signal(&e->in.cond);
    pthread_mutex_unlock(&e->in.lock);
    return CV_OK;
nomem:
    cv_request_free(r);
    return cv_set_err(err, CV_ERR_NOMEM, "out of memory for a request");
}

int cv_engine_abort(cv_engine *e, int64_t request_id) {
    int rc = CV_OK;
    pthread_mutex_lock(&e->in.lock);
    if (cv_grow((void **)&e->in.aborts, &e->in.cap_aborts, e->in.n_aborts + 1, sizeof *e->in.aborts))
        e->in.aborts[e->in.n_aborts++] = request_id;
    else
        rc = CV_ERR_NOMEM;
    pthread_cond_signal(&e->in.cond);
    pthread_mutex_unlock(&e->in.lock);
    cv_mask_box_cancel(&e->guided.box, request_id); /* a sampler waiting on its mask gives up */
    return rc;
}

int cv_engine_set_token_mask(cv_engine *e, int64_t request_id, int32_t seq_index, int64_t pos,
                             const uint32_t *mask) {
    return cv_mask_box_put(&e->guided.box, request_id, seq_index, pos, mask);
}

int64_t cv_engine_token_mask_words(cv_engine *e) { return e->guided.box.words; }

int64_t cv_engine_num_unfinished(cv_engine *e) {
    pthread_mutex_lock(&e->in.lock);
    int64_t n = e->in.n_requests + e->n_active;
    pthread_mutex_unlock(&e->in.lock);
    return n;
}

int64_t cv_engine_num_queued(cv_engine *e) {
    pthread_mutex_lock(&e->in.lock);
    int64_t n = e->in.n_queued;
    pthread_mutex_unlock(&e->in.lock);
    return n;
}

/* ------------------------------------------------------------------------- */
/* On the stepping thread */

static void active_remove(cv_engine *e, cv_request *r) {
    if (r->prev) r->prev->next = r->next; else e->active = r->next;
    if (r->next) r->next->prev = r->prev;
    r->prev = r->next = NULL;
    pthread_mutex_lock(&e->in.lock);
    e->n_active--;
    pthread_mutex_unlock(&e->in.lock);
}

void cv_request_finish_completion(cv_engine *e, cv_request *r, int idx, int reason, int stop_kind,
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
        ev = cv_request_push_event(e, r, idx, st->text + st->emitted, st->text_len - st->emitted);
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

void cv_request_leave_queue(cv_engine *e, cv_request *r) {
    if (!r->queued) return;
    r->queued = 0;
    pthread_mutex_lock(&e->in.lock);
    e->in.n_queued--;
    pthread_mutex_unlock(&e->in.lock);
}

void cv_request_retire_if_done(cv_engine *e, cv_request *r) {
    if (r->n_done == r->p.n) {
        cv_request_leave_queue(e, r);
        if (r->deadline > 0) e->n_deadlines--;
        active_remove(e, r);
        if (r->p.guided) cv_mask_box_close(&e->guided.box, r->id);
        cv_request_free(r);
    }
}

/* Ends every completion of r with reason (CV_FINISH_ABORT or CV_FINISH_TIMEOUT). */
static void end_request(cv_engine *e, cv_request *r, int reason) {
    r->forked = 1; /* no forks after an abort */
    pthread_mutex_lock(&e->outbox.lock);
    for (int i = 0; i < r->p.n; i++) cv_request_finish_completion(e, r, i, reason, CV_STOP_NONE, -1, NULL);
    pthread_mutex_unlock(&e->outbox.lock);
    cv_request_retire_if_done(e, r);
}

void cv_request_abort(cv_engine *e, cv_request *r) { end_request(e, r, CV_FINISH_ABORT); }

void cv_expire_deadlines(cv_engine *e, double now) {
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
    s->lora_slot = r->p.lora_id ? r->p.lora_slot : -1;
    s->lora_id = r->p.lora_id;
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

static int cmp_id(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* Aborts every active request whose id is in ids (which it sorts): one pass
 * over the active list with a binary search each, so that N aborts cost
 * O((N + active) log N), not N x active. */
static void apply_aborts(cv_engine *e, int64_t *ids, size_t n) {
    if (n == 0) return;
    qsort(ids, n, sizeof *ids, cmp_id);
    cv_request *r = e->active;
    while (r) {
        cv_request *nx = r->next; /* an abort frees r */
        if (bsearch(&r->id, ids, n, sizeof *ids, cmp_id)) cv_request_abort(e, r);
        r = nx;
    }
}

void cv_drain_inbox(cv_engine *e) {
    pthread_mutex_lock(&e->in.lock);
    cv_request *head = e->in.head;
    e->in.head = e->in.tail = NULL;
    int64_t moved = e->in.n_requests;
    e->in.n_requests = 0;
    e->n_active += moved;
    int64_t *aborts = e->in.aborts;
    size_t n_aborts = e->in.n_aborts;
    e->in.aborts = NULL;
    e->in.n_aborts = e->in.cap_aborts = 0;
    pthread_mutex_unlock(&e->in.lock);

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
            cv_request_abort(e, r); /* validated at add: only out of memory lands here */
        }
    }
    apply_aborts(e, aborts, n_aborts);
    free(aborts);
}

void cv_request_fork_children(cv_engine *e, cv_request *r) {
    cv_sequence *parent = r->ss[0].seq;
    r->forked = 1;
    for (int i = 1; i < r->p.n; i++) {
        cv_sequence *c = NULL;
        cv_err err;
        if (new_sequence(e, r, i, &c) || cv_scheduler_add_fork(e->sched, c, parent, &err)) {
            pthread_mutex_lock(&e->outbox.lock);
            cv_request_finish_completion(e, r, i, CV_FINISH_ABORT, CV_STOP_NONE, -1, NULL);
            pthread_mutex_unlock(&e->outbox.lock);
        }
    }
}

void cv_request_accept_token(cv_engine *e, cv_request *r, int idx, int32_t t, const cv_sample_info *info) {
    seq_state *st = &r->ss[idx];
    cv_sequence *s = st->seq;
    const cv_request_params *p = &r->p;
    int32_t prev = s->n_tokens > 0 ? s->tokens[s->n_tokens - 1] : -1;
    if (cv_sequence_append(s, t)) {
        cv_request_finish_completion(e, r, idx, CV_FINISH_ABORT, CV_STOP_NONE, -1, NULL);
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
                cv_request_finish_completion(e, r, idx, CV_FINISH_ABORT, CV_STOP_NONE, -1, NULL);
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
    cv_event *ev = cv_request_push_event(e, r, idx, st->text + st->emitted, visible - st->emitted);
    if (ev) {
        st->emitted = visible;
        ev->token = t;
        if (info && p->sp.n_logprobs >= 0) {
            ev->logprob = info->logprob;
            ev->n_top = info->n_top;
            memcpy(ev->top_ids, info->top_ids, sizeof ev->top_ids);
            memcpy(ev->top_logprobs, info->top_logprobs, sizeof ev->top_logprobs);
            ev->rank = info->rank;
        } else if (info) {
            ev->logprob = info->logprob;
        }
    }
    if (reason) cv_request_finish_completion(e, r, idx, reason, stop_kind, stop_value, ev);
}

int cv_request_completion_index(const cv_request *r, const cv_sequence *s) {
    for (int k = 0; k < r->p.n; k++)
        if (r->ss[k].seq == s) return k;
    return 0;
}
