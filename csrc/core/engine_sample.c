/* The sampling part of a step: prompt logprobs for the chunks that ask for
 * them, guided decoding's token masks, then one token sampled per logits row
 * (min_tokens banning EOS and the stop tokens) and handed to its request. */
#include "engine_internal.h"

#include <stdlib.h>
#include <string.h>

int cv_sample_rows_init(cv_sample_rows *rows, int64_t max_rows, int n_samplers, int64_t vocab, cv_err *err) {
    rows->max_rows = max_rows;
    rows->n_samplers = n_samplers;
    rows->samplers = calloc((size_t)n_samplers, sizeof *rows->samplers);
    rows->list = malloc((size_t)max_rows * sizeof *rows->list);
    rows->token = malloc((size_t)max_rows * sizeof *rows->token);
    rows->take = malloc((size_t)max_rows * sizeof *rows->take);
    rows->info = malloc((size_t)max_rows * sizeof *rows->info);
    if (!rows->samplers || !rows->list || !rows->token || !rows->take || !rows->info)
        return cv_set_err(err, CV_ERR_NOMEM, "out of memory for the sampler");
    for (int i = 0; i < n_samplers; i++)
        if (!(rows->samplers[i].sampler = cv_sampler_create(vocab)))
            return cv_set_err(err, CV_ERR_NOMEM, "out of memory for the sampler");
    return CV_OK;
}

void cv_sample_rows_free(cv_sample_rows *rows) {
    for (int i = 0; rows->samplers && i < rows->n_samplers; i++) {
        cv_sampler_destroy(rows->samplers[i].sampler);
        free(rows->samplers[i].banned);
    }
    free(rows->samplers);
    free(rows->list);
    free(rows->token);
    free(rows->take);
    free(rows->info);
    memset(rows, 0, sizeof *rows);
}

/* The tokens min_tokens still holds off for a completion with n_out tokens
 * (EOS unless ignore_eos, and the stop tokens), in w->banned; returns how many. */
static int64_t banned_tokens(const cv_engine *e, cv_sample_worker *w, const cv_request *r, int64_t n_out) {
    if (n_out >= r->p.min_tokens) return 0;
    size_t need = (size_t)(e->detok.n_eos + r->p.n_stop_token_ids);
    if (!cv_grow((void **)&w->banned, &w->banned_cap, need, sizeof *w->banned)) return 0;
    int64_t n = 0;
    if (!r->p.ignore_eos)
        for (int i = 0; i < e->detok.n_eos; i++) w->banned[n++] = e->detok.eos_ids[i];
    for (int i = 0; i < r->p.n_stop_token_ids; i++) w->banned[n++] = r->stop_token_ids[i];
    return n;
}

/* Guided decoding: applies each guided row's mask (its completion's next
 * position) to its logits, in place; the background loop waits for masks not
 * posted yet, without holding out_lock (the grammar's thread takes the events
 * that let it compute them). A row without a mask (cancelled, or not
 * posted before a synchronous step) is marked failed.
 * Returns the number of guided rows. */
int64_t cv_apply_guided_masks(cv_engine *e, const cv_sched_output *plan) {
    const cv_batch *bt = &e->worker.runner.batch;
    int64_t n_guided = 0;
    for (int64_t row = 0; row < bt->n_logits; row++)
        n_guided += ((cv_request *)plan->seqs[e->worker.runner.sample_plan_index[row]]->owner)->p.guided != 0;
    if (n_guided == 0) return 0;
    for (int64_t row = 0; row < bt->n_logits; row++) {
        cv_sequence *s = plan->seqs[e->worker.runner.sample_plan_index[row]];
        cv_request *r = s->owner;
        if (!r->p.guided) continue;
        int idx = cv_request_completion_index(r, s);
        e->guided.failed[row] = (uint8_t)(cv_mask_box_take(&e->guided.box, r->id, idx, r->ss[idx].n_out,
                                                         e->loop_running || e->guided.wait, e->guided.scratch) != 0);
        if (!e->guided.failed[row])
            cv_sampler_apply_token_mask(e->worker.ws.logits_host + row * e->vocab, e->vocab, e->guided.scratch);
    }
    return n_guided;
}

/* A sequence's rows are consecutive: its first one stands for them all. */
static int first_row(const cv_engine *e, int64_t row) {
    return row == 0 || e->worker.runner.sample_plan_index[row] != e->worker.runner.sample_plan_index[row - 1];
}

/* Whether this step samples logits row `row` (a sequence's first) in the pass
 * for guided (or unguided) requests: its completion is still running and, if
 * guided, got its mask. */
static int samples_row(const cv_engine *e, const cv_sched_output *plan, int64_t row, int guided) {
    if (!first_row(e, row)) return 0;
    cv_sequence *s = plan->seqs[e->worker.runner.sample_plan_index[row]];
    cv_request *r = s->owner;
    if ((r->p.guided != 0) != guided) return 0;
    if (r->ss[cv_request_completion_index(r, s)].finished) return 0;
    return !(guided && e->guided.failed[row]);
}

typedef struct sample_job {
    cv_engine *e;
    const cv_sched_output *plan;
} sample_job;

/* Draws the tokens of the sequence whose first row is e->rows.list[k] with the
 * worker's own sampler. A sequence reads only its own logits, request
 * parameters, tokens and random stream, so sequences may run on any thread in
 * any order with the same results. worker < n_samplers: host_parallel runs at
 * most min(sequences, host_workers) threads, and sequences <= max_num_seqs.
 *
 * With proposals d_1..d_m (the tokens after position L-1 = n_tokens-m-1), row
 * j holds the model's distribution p_j for position L+j given the tokens
 * before it. Row j draws t_j ~ p_j as a plain decode would; d_{j+1} is kept
 * when t_j == d_{j+1}, and the draws stop at the first t_j that differs (or
 * after the last row). A proposal is a point mass, so this is the standard
 * rejection rule (accept d with probability min(1, p(d)/1) = p(d), else
 * draw from p without d, renormalized): every kept token is distributed
 * exactly as the model's own, and greedy draws keep exactly what greedy
 * decoding would produce. */
static void sample_row(void *arg, int64_t k, int worker) {
    sample_job *j = arg;
    cv_engine *e = j->e;
    cv_sample_worker *w = &e->rows.samplers[worker];
    const int64_t row0 = e->rows.list[k];
    cv_sequence *s = j->plan->seqs[e->worker.runner.sample_plan_index[row0]];
    cv_request *r = s->owner;
    seq_state *st = &r->ss[cv_request_completion_index(r, s)];
    const int64_t m = s->n_spec, base = s->n_tokens - m; /* base: position of d_1 */
    int64_t i = 0;
    for (;; i++) {
        const int64_t row = row0 + i;
        int64_t n_banned = banned_tokens(e, w, r, st->n_out + i);
        e->rows.token[row] = cv_sampler_sample(w->sampler, e->worker.ws.logits_host + row * e->vocab, &r->p.sp, s->tokens,
                                              r->n_prompt, s->tokens + r->n_prompt, base + i - r->n_prompt,
                                              w->banned, n_banned, &st->rng, &e->rows.info[row]);
        if (e->rows.info[row].no_token) {
            e->rows.take[row0] = (int32_t)-(i + 1); /* i tokens drawn, then none was left */
            return;
        }
        if (i == m || e->rows.token[row] != s->tokens[base + i]) break;
    }
    e->rows.take[row0] = (int32_t)(i + 1);
}

/* Accepts the tokens sample_row drew for the sequence at first row row0:
 * its proposals give way to them (the KV of rejected ones is rolled back),
 * and the count stops at a finish (a stop, max_tokens). Caller holds out_lock. */
static void accept_rows(cv_engine *e, cv_request *r, int idx, cv_sequence *s, int64_t row0) {
    const int64_t m = s->n_spec, take = e->rows.take[row0];
    s->n_tokens -= m; /* the accepted tokens overwrite the proposals */
    s->n_spec = 0;
    for (int64_t i = 0; i < take && !r->ss[idx].finished; i++)
        cv_request_accept_token(e, r, idx, e->rows.token[row0 + i], &e->rows.info[row0 + i]);
    if (m == 0) return;
    cv_engine_stats *sl = &e->stats_live;
    sl->spec_proposed += m;
    sl->spec_accepted += take - 1;
    for (int64_t i = 0; i < m; i++) {
        sl->spec_proposed_at[i]++;
        if (i < take - 1) sl->spec_accepted_at[i]++;
    }
    /* still running: KV is valid up to the last kept proposal, the new last token is not computed */
    if (!r->ss[idx].finished) cv_scheduler_verified(e->sched, s, s->n_tokens - 1);
}

/* A step's rows are worth waking the host workers for when they hold this
 * many logits in all (a 49k vocabulary takes ~0.1 ms a row); a few small
 * rows are not. */
#define PARALLEL_SAMPLE_FLOATS ((int64_t)1 << 17)

/* Samples one token for every logits row of the step whose request is guided
 * (or not, per `guided`) and accepts it (stops, detokenization, events):
 * first every row's draw, in parallel on the backend's host workers, then the
 * acceptances in row order. Caller holds out_lock. */
void cv_sample_batch(cv_engine *e, const cv_sched_output *plan, int guided) {
    const cv_batch *bt = &e->worker.runner.batch;
    int64_t n = 0;
    for (int64_t row = 0; row < bt->n_logits; row++)
        if (samples_row(e, plan, row, guided)) e->rows.list[n++] = (int32_t)row;
    sample_job job = {e, plan};
    if (e->rows.n_samplers > 1 && n > 1 && n * e->vocab >= PARALLEL_SAMPLE_FLOATS)
        e->backend->host_parallel(e->backend, n, sample_row, &job);
    else
        for (int64_t k = 0; k < n; k++) sample_row(&job, k, 0);
    for (int64_t row = 0; row < bt->n_logits; row++) {
        if (!first_row(e, row)) continue;
        cv_sequence *s = plan->seqs[e->worker.runner.sample_plan_index[row]];
        cv_request *r = s->owner;
        if ((r->p.guided != 0) != guided) continue;
        int idx = cv_request_completion_index(r, s);
        if (r->ss[idx].finished) continue;
        if (guided && e->guided.failed[row]) {
            cv_request_finish_completion(e, r, idx, CV_FINISH_ABORT, CV_STOP_NONE, -1, NULL);
            continue;
        }
        if (r->first_token == 0) r->first_token = cv_now();
        if (e->rows.take[row] < 0) {
            /* the request's constraints left no token: keep what was drawn before, then end it */
            e->rows.take[row] = -e->rows.take[row] - 1;
            if (e->rows.take[row] > 0) {
                accept_rows(e, r, idx, s, row);
            } else {
                s->n_tokens -= s->n_spec;
                s->n_spec = 0;
            }
            cv_request_finish_completion(e, r, idx, CV_FINISH_NO_TOKEN, CV_STOP_NONE, -1, NULL);
            continue;
        }
        accept_rows(e, r, idx, s, row);
    }
}

/* ---- prompt logprobs ---- */

/* Runs the LM head on the n grouped rows and emits one prompt event per row. */
static int flush_prompt_rows(cv_engine *e, int64_t n, cv_err *err) {
    if (n == 0) return CV_OK;
    int rc = cv_model_logits(e->worker.model, &e->worker.ws, e->prompt_lp.rows, n, e->worker.runner.batch.n_tokens, err);
    if (rc) return rc;
    pthread_mutex_lock(&e->outbox.lock);
    for (int64_t k = 0; k < n; k++) {
        cv_request *r = e->prompt_lp.req[k];
        int64_t pos = e->prompt_lp.pos[k];
        cv_sample_info info;
        cv_logprobs_of(e->worker.ws.logits_host + k * e->vocab, e->vocab, r->prompt[pos], r->p.prompt_logprobs, &info);
        cv_event *ev = cv_request_push_event(e, r, 0, NULL, 0);
        if (!ev) continue; /* out of memory for the event: the request still runs */
        ev->prompt_pos = pos;
        ev->token = r->prompt[pos];
        ev->logprob = info.logprob;
        ev->n_top = info.n_top;
        memcpy(ev->top_ids, info.top_ids, sizeof ev->top_ids);
        memcpy(ev->top_logprobs, info.top_logprobs, sizeof ev->top_logprobs);
        ev->rank = info.rank;
    }
    pthread_mutex_unlock(&e->outbox.lock);
    return CV_OK;
}

/* The logprob of every prompt token this step's chunks predict, for requests
 * that ask for them: row p of a chunk predicts prompt token p + 1. Only those
 * rows go through the LM head again (in groups of max_num_seqs), after the
 * layers ran once for the whole ragged batch; the sampling rows' logits are
 * then recomputed, since the groups overwrote them. Positions already sent
 * (a preempted sequence recomputes its prompt) are skipped. */
int cv_prompt_logprobs_pass(cv_engine *e, const cv_sched_output *plan, cv_err *err) {
    const cv_batch *bt = &e->worker.runner.batch;
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
            e->prompt_lp.rows[n] = bt->query_start[i] + (int32_t)(pos - start);
            e->prompt_lp.req[n] = r;
            e->prompt_lp.pos[n] = pos + 1;
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
        return cv_model_logits(e->worker.model, &e->worker.ws, bt->logits_rows, bt->n_logits, bt->n_tokens, err);
    return CV_OK;
}
