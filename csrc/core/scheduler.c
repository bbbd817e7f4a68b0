/* Iteration-level scheduler: policy only (see scheduler.h). Every block it
 * plans for goes through the KV manager.
 *
 * Structures:
 * - running: array [max_num_seqs] ordered by the victim key (arrival; under
 *   the priority policy (priority, arrival)), ties by seq_id. The last entry
 *   is always the next preemption victim, and since the running phase walks
 *   the array from the front, a victim is never a sequence already planned
 *   this step.
 * - waiting (continuous, fcfs and static): "resume", an intrusive list over
 *   q_prev/q_next of preempted sequences and forks, pushed at its head, ahead
 *   of "fresh", the never-admitted ones. Fresh is a binary min-heap on
 *   (wait_key, arrival, seq_id) under the continuous policy, and a list in
 *   arrival order under fcfs and static.
 * - waiting (priority): a binary min-heap on (priority, arrival, seq_id).
 *
 * The continuous policy's wait_key is a virtual finish time: the scheduler's
 * clock of tokens planned when the sequence arrived, plus the work it is
 * expected to need (its prompt and its expected output: the mean output
 * expected_output() estimates, never more than its max_tokens; its
 * max_tokens until an output stopped). Among sequences that arrive together
 * the shortest starts first, which brings the median completion forward; a
 * later arrival passes an earlier one only when it arrived less than their
 * difference in work after it, so nothing waits behind later arrivals for
 * more than its own work.
 *
 * The scheduler stamps seq->arrival in cv_scheduler_add (a fork takes its
 * parent's). No step allocates, except the amortized growth of a block table
 * (in the KV manager).
 * Precondition kept by the engine: seq->n_tokens <= seq->max_total. */
#include "scheduler.h"
#include "kv_manager.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

struct cv_scheduler {
    cv_scheduler_config cfg;
    cv_kv_manager *kv;       /* borrowed: the blocks of every sequence it plans */
    int64_t bs;              /* block size */
    int64_t usable_blocks;   /* num_blocks - 1 */

    cv_sequence **running;   /* [max_num_seqs] ordered by victim key, last = next victim */
    int64_t n_running;

    cv_sequence *resume_head, *resume_tail; /* preempted and forked, pushed at the head */
    cv_sequence *fresh_head, *fresh_tail;   /* never admitted, arrival order (fcfs, static) */
    cv_sequence **heap;                     /* [heap_cap] the priority queue, or continuous's fresh */
    int64_t heap_len, heap_cap;
    int64_t n_waiting;
    int64_t n_waiting_holding;              /* waiting sequences holding blocks (forks) */

    /* the plan's arrays, sized at creation */
    cv_sequence **out_seqs;      /* [max_num_seqs] */
    int32_t *out_new;            /* [max_num_seqs] */
    int64_t *out_start;          /* [max_num_seqs] */
    cv_sequence **out_preempted; /* [max_num_seqs] */

    int64_t next_arrival;
    int64_t tokens_planned;      /* the continuous policy's clock */
    int64_t running_target;      /* admissions stop at this many running; 0: none (see the setter) */
    int64_t decode_limit;        /* the next step's decodes at most; 0: none (one step only) */
    int64_t n_limited_steps;     /* steps planned under a decode limit */
    int64_t n_preempted_total, steps;
    int64_t n_recomputed_tokens; /* KV computed before a preemption and computed again */
    int64_t n_resumed_tokens;    /* KV a resumed sequence took back instead */

    /* For the admission margin: outputs of the sequences that finished (not aborted) */
    int64_t n_stops_seen, output_tokens_seen;
};

/* ---- ordering ---- */

/* a before b in the running order; the largest is the next victim. */
static int seq_less(const cv_scheduler *s, const cv_sequence *a, const cv_sequence *b) {
    if (s->cfg.policy == CV_SCHED_PRIORITY && a->priority != b->priority)
        return a->priority < b->priority;
    if (a->arrival != b->arrival) return a->arrival < b->arrival;
    return a->seq_id < b->seq_id;
}

/* a before b in a waiting heap. */
static int wait_less(const cv_scheduler *s, const cv_sequence *a, const cv_sequence *b) {
    if (s->cfg.policy == CV_SCHED_CONTINUOUS && a->wait_key != b->wait_key) return a->wait_key < b->wait_key;
    return seq_less(s, a, b);
}

/* Never-admitted sequences wait in the heap (continuous, priority). */
static int fresh_in_heap(const cv_scheduler *s) {
    return s->cfg.policy == CV_SCHED_CONTINUOUS || s->cfg.policy == CV_SCHED_PRIORITY;
}

/* Running sequences admissions stop at: the running target, within max_num_seqs. */
static int64_t admission_seats(const cv_scheduler *s) {
    return s->running_target > 0 && s->running_target < s->cfg.max_num_seqs ? s->running_target
                                                                           : s->cfg.max_num_seqs;
}

static int64_t blocks_for(const cv_scheduler *s, int64_t tokens) {
    return (tokens + s->bs - 1) / s->bs;
}

/* ---- running array ---- */

static void running_insert(cv_scheduler *s, cv_sequence *q) {
    int64_t pos = s->n_running;
    if (pos > 0 && seq_less(s, q, s->running[pos - 1])) { /* rare: a resumed sequence */
        int64_t lo = 0, hi = s->n_running;
        while (lo < hi) {
            int64_t mid = lo + (hi - lo) / 2;
            if (seq_less(s, q, s->running[mid])) hi = mid; else lo = mid + 1;
        }
        pos = lo;
        memmove(&s->running[pos + 1], &s->running[pos],
                (size_t)(s->n_running - pos) * sizeof *s->running);
    }
    s->running[pos] = q;
    s->n_running++;
    for (int64_t i = pos; i < s->n_running; i++) s->running[i]->sched_index = i;
}

static void running_remove(cv_scheduler *s, cv_sequence *q) {
    int64_t pos = q->sched_index;
    memmove(&s->running[pos], &s->running[pos + 1],
            (size_t)(s->n_running - pos - 1) * sizeof *s->running);
    s->n_running--;
    for (int64_t i = pos; i < s->n_running; i++) s->running[i]->sched_index = i;
    q->sched_index = -1;
}

/* ---- priority heap ---- */

static void heap_set(cv_scheduler *s, int64_t i, cv_sequence *q) {
    s->heap[i] = q;
    q->heap_index = i;
}

static void heap_sift_up(cv_scheduler *s, int64_t i) {
    cv_sequence *q = s->heap[i];
    while (i > 0) {
        int64_t p = (i - 1) / 2;
        if (!wait_less(s, q, s->heap[p])) break;
        heap_set(s, i, s->heap[p]);
        i = p;
    }
    heap_set(s, i, q);
}

static void heap_sift_down(cv_scheduler *s, int64_t i) {
    cv_sequence *q = s->heap[i];
    for (;;) {
        int64_t c = 2 * i + 1;
        if (c >= s->heap_len) break;
        if (c + 1 < s->heap_len && wait_less(s, s->heap[c + 1], s->heap[c])) c++;
        if (!wait_less(s, s->heap[c], q)) break;
        heap_set(s, i, s->heap[c]);
        i = c;
    }
    heap_set(s, i, q);
}

/* Capacity for every unfinished sequence, reserved at add so that pushing a
 * preempted sequence back never allocates. */
static int heap_reserve(cv_scheduler *s, int64_t need, cv_err *err) {
    if (!fresh_in_heap(s) || need <= s->heap_cap) return CV_OK;
    int64_t cap = s->heap_cap * 2 > need ? s->heap_cap * 2 : need;
    if (cap < 64) cap = 64;
    cv_sequence **h = realloc(s->heap, (size_t)cap * sizeof *h);
    if (!h) return cv_set_err(err, CV_ERR_NOMEM, "scheduler: out of memory for a waiting queue of %lld",
                              (long long)cap);
    s->heap = h;
    s->heap_cap = cap;
    return CV_OK;
}

/* ---- waiting queue ---- */

static void wait_count_in(cv_scheduler *s, cv_sequence *q) {
    q->status = CV_SEQ_WAITING;
    s->n_waiting++;
    if (cv_kv_num_blocks(q) > 0) s->n_waiting_holding++;
}

/* A new arrival: the back of the queue. */
static void wait_push_back(cv_scheduler *s, cv_sequence *q) {
    if (fresh_in_heap(s)) {
        heap_set(s, s->heap_len++, q);
        heap_sift_up(s, q->heap_index);
    } else {
        q->q_next = NULL;
        q->q_prev = s->fresh_tail;
        if (s->fresh_tail) s->fresh_tail->q_next = q; else s->fresh_head = q;
        s->fresh_tail = q;
    }
    wait_count_in(s, q);
}

/* A preempted sequence or a fork: the head of the queue (under the priority
 * policy, back into the heap at its key). */
static void wait_push_front(cv_scheduler *s, cv_sequence *q) {
    if (s->cfg.policy == CV_SCHED_PRIORITY) {
        heap_set(s, s->heap_len++, q);
        heap_sift_up(s, q->heap_index);
    } else {
        q->q_prev = NULL;
        q->q_next = s->resume_head;
        if (s->resume_head) s->resume_head->q_prev = q; else s->resume_tail = q;
        s->resume_head = q;
    }
    wait_count_in(s, q);
}

static cv_sequence *wait_peek(const cv_scheduler *s) {
    if (s->cfg.policy == CV_SCHED_PRIORITY) return s->heap_len ? s->heap[0] : NULL;
    if (s->resume_head) return s->resume_head;
    if (fresh_in_heap(s)) return s->heap_len ? s->heap[0] : NULL;
    return s->fresh_head;
}

static void wait_remove(cv_scheduler *s, cv_sequence *q) {
    if (q->heap_index >= 0) {
        int64_t i = q->heap_index;
        cv_sequence *last = s->heap[--s->heap_len];
        if (last != q) {
            heap_set(s, i, last);
            heap_sift_up(s, i);
            heap_sift_down(s, last->heap_index);
        }
        q->heap_index = -1;
    } else {
        /* the list is told apart by its head/tail pointers */
        if (q->q_prev) q->q_prev->q_next = q->q_next;
        else if (s->resume_head == q) s->resume_head = q->q_next;
        else s->fresh_head = q->q_next;
        if (q->q_next) q->q_next->q_prev = q->q_prev;
        else if (s->resume_tail == q) s->resume_tail = q->q_prev;
        else s->fresh_tail = q->q_prev;
        q->q_prev = q->q_next = NULL;
    }
    s->n_waiting--;
    if (cv_kv_num_blocks(q) > 0) s->n_waiting_holding--;
}

/* Frees the blocks of waiting forks (except keep), so a lone sequence can get
 * the whole cache; they recompute their prefix when admitted. */
static void release_waiting_holders(cv_scheduler *s, const cv_sequence *keep) {
    if (s->cfg.policy == CV_SCHED_PRIORITY) {
        for (int64_t i = 0; i < s->heap_len; i++) {
            cv_sequence *q = s->heap[i];
            if (q == keep || cv_kv_num_blocks(q) == 0) continue;
            cv_kv_manager_free(s->kv, q);
            s->n_waiting_holding--;
        }
    } else {
        for (cv_sequence *q = s->resume_head; q; q = q->q_next) { /* fresh ones hold nothing */
            if (q == keep || cv_kv_num_blocks(q) == 0) continue;
            cv_kv_manager_free(s->kv, q);
            s->n_waiting_holding--;
        }
    }
}

/* Drops q's unverified proposals (not planned, or preempted). */
static void drop_proposals(cv_sequence *q) {
    q->n_tokens -= q->n_spec;
    q->n_spec = 0;
}

static void preempt(cv_scheduler *s, cv_sequence *q, int64_t *n_pre) {
    drop_proposals(q);
    running_remove(s, q);
    cv_kv_manager_preempt(s->kv, q); /* its KV stays reclaimable until the LRU reuses it */
    q->n_preemptions++;
    wait_push_front(s, q);
    s->out_preempted[(*n_pre)++] = q;
    s->n_preempted_total++;
}

/* ---- life cycle ---- */

cv_scheduler *cv_scheduler_create(const cv_scheduler_config *cfg, cv_kv_manager *kv, cv_err *err) {
    cv_scheduler *s = NULL;
    const char *bad = NULL;
    if (!cfg || !kv) { cv_set_err(err, CV_ERR_INVALID, "scheduler: no config or no KV manager"); goto fail; }
    if (cfg->max_num_seqs < 1) bad = "max_num_seqs";
    else if (cfg->max_num_batched_tokens < 1) bad = "max_num_batched_tokens";
    else if (cfg->max_model_len < 1) bad = "max_model_len";
    if (bad) {
        cv_set_err(err, CV_ERR_INVALID,
                   "scheduler: %s must be positive; "
                   "max_num_seqs=%lld max_num_batched_tokens=%lld max_model_len=%lld",
                   bad, (long long)cfg->max_num_seqs, (long long)cfg->max_num_batched_tokens,
                   (long long)cfg->max_model_len);
        goto fail;
    }
    if (cfg->policy != CV_SCHED_CONTINUOUS && cfg->policy != CV_SCHED_PRIORITY &&
        cfg->policy != CV_SCHED_STATIC && cfg->policy != CV_SCHED_FCFS) {
        cv_set_err(err, CV_ERR_INVALID, "scheduler: unknown policy %d", (int)cfg->policy);
        goto fail;
    }
    if (cfg->admission_reserve < -1 || cfg->admission_reserve > CV_SCHED_MAX_RESERVE) {
        cv_set_err(err, CV_ERR_INVALID,
                   "scheduler: admission_reserve must be -1 (no margin) or in [0, %d] "
                   "(0: the default %d), got %d",
                   CV_SCHED_MAX_RESERVE, CV_SCHED_DEFAULT_RESERVE, (int)cfg->admission_reserve);
        goto fail;
    }
    if (cfg->max_prefill_tokens_while_decoding < 0) {
        cv_set_err(err, CV_ERR_INVALID,
                   "scheduler: max_prefill_tokens_while_decoding must be >= 0 (0: no cap), got %lld",
                   (long long)cfg->max_prefill_tokens_while_decoding);
        goto fail;
    }
    if (!cfg->enable_chunked_prefill && cfg->max_num_batched_tokens < cfg->max_model_len) {
        cv_set_err(err, CV_ERR_INVALID,
                   "scheduler: with enable_chunked_prefill off, max_num_batched_tokens (%lld) "
                   "must be >= max_model_len (%lld), or a long prompt could never be scheduled",
                   (long long)cfg->max_num_batched_tokens, (long long)cfg->max_model_len);
        goto fail;
    }
    s = calloc(1, sizeof *s);
    if (!s) goto nomem;
    s->cfg = *cfg;
    s->cfg.enable_chunked_prefill = cfg->enable_chunked_prefill ? 1 : 0;
    if (s->cfg.admission_reserve == 0) s->cfg.admission_reserve = CV_SCHED_DEFAULT_RESERVE;
    s->kv = kv;
    s->bs = cv_kv_manager_block_size(kv);
    s->usable_blocks = cv_kv_manager_num_blocks(kv) - 1;
    size_t n = (size_t)cfg->max_num_seqs;
    s->running = calloc(n, sizeof *s->running);
    s->out_seqs = calloc(n, sizeof *s->out_seqs);
    s->out_new = calloc(n, sizeof *s->out_new);
    s->out_start = calloc(n, sizeof *s->out_start);
    s->out_preempted = calloc(n, sizeof *s->out_preempted);
    if (!s->running || !s->out_seqs || !s->out_new || !s->out_start || !s->out_preempted)
        goto nomem;
    return s;
nomem:
    cv_set_err(err, CV_ERR_NOMEM, "scheduler: out of memory (max_num_seqs=%lld)",
               (long long)cfg->max_num_seqs);
fail:
    cv_scheduler_destroy(s);
    return NULL;
}

void cv_scheduler_destroy(cv_scheduler *s) {
    if (!s) return;
    free(s->running);
    free(s->heap);
    free(s->out_seqs);
    free(s->out_new);
    free(s->out_start);
    free(s->out_preempted);
    free(s);
}

/* Refuses a sequence that can never run. */
static int validate_new(const cv_scheduler *s, const cv_sequence *q, cv_err *err) {
    if (!q) return cv_set_err(err, CV_ERR_INVALID, "scheduler: no sequence");
    if (q->status != CV_SEQ_NEW)
        return cv_set_err(err, CV_ERR_INVALID, "sequence %lld was already added (status %d)",
                          (long long)q->seq_id, (int)q->status);
    if (q->n_prompt < 1)
        return cv_set_err(err, CV_ERR_INVALID, "sequence %lld: the prompt is empty (n_prompt=%lld)",
                          (long long)q->seq_id, (long long)q->n_prompt);
    if (q->n_tokens < q->n_prompt || q->max_total < q->n_tokens)
        return cv_set_err(err, CV_ERR_INVALID,
                          "sequence %lld: inconsistent lengths (n_prompt=%lld n_tokens=%lld max_total=%lld)",
                          (long long)q->seq_id, (long long)q->n_prompt, (long long)q->n_tokens,
                          (long long)q->max_total);
    if (q->max_total > s->cfg.max_model_len)
        return cv_set_err(err, CV_ERR_INVALID,
                          "sequence %lld may hold %lld tokens (prompt %lld + max_tokens %lld), "
                          "more than max_model_len %lld",
                          (long long)q->seq_id, (long long)q->max_total, (long long)q->n_prompt,
                          (long long)(q->max_total - q->n_prompt), (long long)s->cfg.max_model_len);
    int64_t need = blocks_for(s, q->max_total);
    if (need > s->usable_blocks)
        return cv_set_err(err, CV_ERR_INVALID,
                          "sequence %lld may hold %lld tokens = %lld KV blocks of %lld, "
                          "more blocks than the whole cache has (%lld usable of num_blocks %lld)",
                          (long long)q->seq_id, (long long)q->max_total, (long long)need,
                          (long long)s->bs, (long long)s->usable_blocks,
                          (long long)cv_kv_manager_num_blocks(s->kv));
    return CV_OK;
}

/* The expected length of an output left to end by itself (a stop): the
 * output tokens seen over the stops seen, the estimate of an exponential
 * length's mean from censored observations. Every output counts as seen,
 * the running ones' so far as well as the ended ones': without them the
 * first finishes, the short ones, would make every output look short. An
 * output cut at its max_tokens is censored, not an end: it says the length
 * is larger, so where every output ends at its max_tokens (ignore_eos) each
 * request's own max_tokens stays its expected length. -1 until a stop. */
static double expected_output(const cv_scheduler *s) {
    if (s->n_stops_seen == 0) return -1.0;
    double seen = (double)s->output_tokens_seen;
    for (int64_t i = 0; i < s->n_running; i++) {
        const cv_sequence *r = s->running[i];
        if (r->n_tokens - r->n_spec > r->n_prompt) seen += (double)(r->n_tokens - r->n_spec - r->n_prompt);
    }
    return seen / (double)s->n_stops_seen;
}

/* The continuous policy's waiting order (see the top of this file): the clock
 * now plus the work q is expected to need. */
static int64_t virtual_finish(const cv_scheduler *s, const cv_sequence *q) {
    int64_t out = q->max_total - q->n_tokens;
    const double mean = expected_output(s);
    if (mean >= 0 && mean < (double)out) out = (int64_t)mean + 1;
    return s->tokens_planned + (q->n_tokens - q->n_computed) + out;
}

static void reset_links(cv_sequence *q) {
    q->q_prev = q->q_next = NULL;
    q->sched_index = -1;
    q->heap_index = -1;
}

int cv_scheduler_add(cv_scheduler *s, cv_sequence *q, cv_err *err) {
    int rc = validate_new(s, q, err);
    if (rc != CV_OK) return rc;
    rc = heap_reserve(s, s->n_waiting + s->n_running + 1, err);
    if (rc != CV_OK) return rc;
    reset_links(q);
    q->arrival = s->next_arrival++;
    cv_kv_manager_free(s->kv, q); /* a new sequence holds no blocks: this only zeroes n_computed */
    q->n_cached_prompt = 0;
    q->wait_key = virtual_finish(s, q);
    wait_push_back(s, q);
    return CV_OK;
}

int cv_scheduler_add_fork(cv_scheduler *s, cv_sequence *child, cv_sequence *parent, cv_err *err) {
    int rc = validate_new(s, child, err);
    if (rc != CV_OK) return rc;
    if (!parent || (parent->status != CV_SEQ_WAITING && parent->status != CV_SEQ_RUNNING))
        return cv_set_err(err, CV_ERR_INVALID, "fork of sequence %lld: the parent is not queued or running",
                          parent ? (long long)parent->seq_id : -1LL);
    if (child->n_prompt != parent->n_prompt || child->n_tokens != child->n_prompt ||
        memcmp(child->tokens, parent->tokens, (size_t)child->n_prompt * sizeof *child->tokens) != 0)
        return cv_set_err(err, CV_ERR_INVALID,
                          "fork %lld of sequence %lld: the child must hold exactly the parent's prompt "
                          "(%lld tokens), it holds %lld",
                          (long long)child->seq_id, (long long)parent->seq_id,
                          (long long)parent->n_prompt, (long long)child->n_tokens);
    rc = heap_reserve(s, s->n_waiting + s->n_running + 1, err);
    if (rc != CV_OK) return rc;
    if (cv_kv_manager_fork(s->kv, child, parent) != CV_OK)
        return cv_set_err(err, CV_ERR_NOMEM, "fork %lld: out of memory for its block table",
                          (long long)child->seq_id);
    reset_links(child);
    child->arrival = parent->arrival; /* the same request */
    child->wait_key = parent->wait_key;
    wait_push_front(s, child);
    return CV_OK;
}

/* ---- one step ---- */

static void emit(cv_scheduler *s, int64_t *n_out, int64_t *total, cv_sequence *q, int64_t n) {
    if (q->n_spec > 0) { /* proposals beyond the planned rows are dropped */
        q->n_tokens = q->n_computed + n;
        q->n_spec = n - 1;
    }
    q->planned_step = s->steps;
    s->out_seqs[*n_out] = q;
    s->out_new[*n_out] = (int32_t)n;
    s->out_start[*n_out] = q->n_computed;
    (*n_out)++;
    *total += n;
}

/* Takes back what q's resume lookup found and counts what it must recompute. */
static void take_resume(cv_scheduler *s, cv_sequence *q) {
    const int64_t before = q->blocks.kept_computed;
    cv_kv_manager_take_resume(s->kv, q);
    const int64_t back = q->n_computed < before ? q->n_computed : before;
    s->n_resumed_tokens += back;
    s->n_recomputed_tokens += before - back;
}

/* The tokens q is expected to add: its next token and `reserve` more, never
 * beyond max_total. */
static int64_t growth_horizon(const cv_sequence *q, int64_t reserve) {
    const int64_t left = q->max_total - (q->n_tokens - q->n_spec);
    return reserve >= left ? left : reserve > 1 ? reserve : 1;
}

/* Blocks q holding `held` adds, beyond those, in its next x tokens. */
static int64_t blocks_grown(const cv_scheduler *s, const cv_sequence *q, int64_t held, int64_t x) {
    const int64_t need = blocks_for(s, q->n_tokens - q->n_spec + x) - held;
    return need > 0 ? need : 0;
}

/* Blocks q will still add, beyond those it holds, to reach its expected
 * length. */
static int64_t growth_blocks(const cv_scheduler *s, const cv_sequence *q, int64_t held, int64_t reserve) {
    return blocks_grown(s, q, held, growth_horizon(q, reserve));
}

/* The output tokens admission reserves for each sequence beyond its current
 * length (see cv_scheduler_config.admission_reserve): that percentage of the
 * expected output. INT64_MAX (each its max_tokens) until an output stopped. */
static int64_t reserve_tokens(const cv_scheduler *s) {
    const double mean = expected_output(s);
    if (mean < 0) return INT64_MAX;
    const double r = mean * s->cfg.admission_reserve / 100.0;
    return r >= (double)s->cfg.max_model_len ? s->cfg.max_model_len : (int64_t)r + 1;
}

/* A running sequence that decodes (one token a step) and reaches its
 * max_total within its horizon: it ends there and its new blocks go back. */
static int ends_within(const cv_sequence *r, int64_t reserve) {
    const int64_t now = r->n_tokens - r->n_spec;
    return now - r->n_computed <= 1 && growth_horizon(r, reserve) == r->max_total - now;
}

/* Whether the running sequences' growth (under the priority policy only
 * those ranked at or above q) fits in room blocks: the most new blocks they
 * hold at once in the steps ahead. Each grows a token a step up to its
 * horizon; one that ends within it (ends_within) gives its new blocks back,
 * so the peak comes just before one of those ends, or after all of them,
 * when the others have grown in full. The sum of every horizon's blocks is
 * never below the peak: when it fits (the common case, one pass) so does
 * the peak, and the ends are looked at only otherwise. */
static int running_growth_fits(const cv_scheduler *s, const cv_sequence *q, int64_t reserve, int64_t room) {
    int64_t n = 0, held_in_full = 0, sum = 0;
    for (; n < s->n_running; n++) {
        const cv_sequence *r = s->running[n];
        if (s->cfg.policy == CV_SCHED_PRIORITY && r->priority > q->priority) break; /* ordered by priority */
        const int64_t g = growth_blocks(s, r, cv_kv_num_blocks(r), reserve);
        sum += g;
        if (!ends_within(r, reserve)) held_in_full += g;
    }
    if (sum <= room) return 1;
    if (held_in_full > room) return 0;
    for (int64_t j = 0; j < n; j++) {
        const cv_sequence *e = s->running[j];
        if (!ends_within(e, reserve)) continue;
        const int64_t t = growth_horizon(e, reserve); /* e's last step: every sequence with t or more left runs */
        int64_t at = 0;
        for (int64_t i = 0; i < n; i++) {
            const cv_sequence *r = s->running[i];
            if (!ends_within(r, reserve)) continue;
            const int64_t h = growth_horizon(r, reserve);
            if (h >= t) at += blocks_grown(s, r, cv_kv_num_blocks(r), t);
        }
        if (held_in_full + at > room) return 0;
    }
    return 1;
}

/* Static policy, nothing running: the next batch joins the running set
 * without reserving blocks; the running phase then feeds it. */
static int static_admit(cv_scheduler *s) {
    while (s->n_running < s->cfg.max_num_seqs && s->n_waiting > 0) {
        cv_sequence *q = wait_peek(s);
        int64_t n_hits = 0, n_free_hits = 0;
        const int fresh = cv_kv_num_blocks(q) == 0, resume = fresh && q->blocks.n_kept > 0;
        if (resume) cv_kv_manager_lookup_resume(s->kv, q, &n_hits, &n_free_hits);
        else if (fresh) n_hits = cv_kv_manager_lookup_prefix(s->kv, q, &n_free_hits);
        if (fresh && cv_kv_manager_reserve(s->kv, q, n_hits > 0 ? n_hits : 1) != CV_OK) return CV_ERR_NOMEM;
        wait_remove(s, q);
        /* reserved: neither can fail */
        if (resume) take_resume(s, q);
        else if (fresh) cv_kv_manager_take_prefix(s->kv, q, n_hits);
        q->status = CV_SEQ_RUNNING;
        running_insert(s, q);
    }
    return CV_OK;
}

/* A decode: the prompt is computed and one new token remains. Everything else
 * a step computes is prompt work (a prefill chunk or a recomputation). */
static int is_decode(const cv_sequence *q) {
    return q->n_computed >= q->n_prompt && q->n_tokens - q->n_spec - q->n_computed == 1;
}

/* Prompt tokens this step may carry: the cap when a running sequence decodes
 * (and chunked prefill can split the prompts), else unlimited. */
static int64_t prefill_allowance(const cv_scheduler *s) {
    int64_t cap = s->cfg.max_prefill_tokens_while_decoding;
    if (cap <= 0 || !s->cfg.enable_chunked_prefill) return INT64_MAX;
    for (int64_t i = 0; i < s->n_running; i++)
        if (is_decode(s->running[i])) return cap;
    return INT64_MAX;
}

/* Priority policy: when the best waiting sequence ranks strictly above the
 * worst running one and cannot start for want of a seat or of blocks for its
 * first chunk, the worst running one is preempted (it recomputes later), as
 * vLLM does, so a high-priority arrival does not wait for low-priority work to
 * end. One a step, and the same step admits the waiting one. Equal priorities
 * never preempt each other, so two sequences cannot take turns evicting. */
static const cv_sequence *priority_preempt(cv_scheduler *s, int64_t *n_pre) {
    if (s->cfg.policy != CV_SCHED_PRIORITY || s->n_running == 0) return NULL;
    const cv_sequence *head = wait_peek(s);
    cv_sequence *worst = s->running[s->n_running - 1];
    if (!head || worst->priority <= head->priority) return NULL;
    int64_t chunk = head->n_tokens - head->n_computed;
    if (chunk > s->cfg.max_num_batched_tokens) chunk = s->cfg.max_num_batched_tokens;
    const int64_t need = blocks_for(s, head->n_computed + chunk) - cv_kv_num_blocks(head);
    if (s->n_running < s->cfg.max_num_seqs && need <= cv_kv_manager_num_free(s->kv)) return NULL;
    preempt(s, worst, n_pre);
    return worst;
}

int cv_scheduler_schedule(cv_scheduler *s, cv_sched_output *out) {
    int rc = CV_OK;
    const int chunked = s->cfg.enable_chunked_prefill;
    int64_t budget = s->cfg.max_num_batched_tokens;
    int64_t n_out = 0, n_pre = 0, total = 0;
    s->steps++;

    if (s->cfg.policy == CV_SCHED_STATIC && s->n_running == 0 && s->n_waiting > 0)
        rc = static_admit(s);
    /* it makes room for admissions, so it does not stop them; its victim waits a step */
    const cv_sequence *victim = priority_preempt(s, &n_pre);
    const int64_t n_pre_priority = n_pre;
    int64_t prefill_left = prefill_allowance(s);
    int64_t decodes_left = s->decode_limit > 0 ? s->decode_limit : INT64_MAX;
    if (s->decode_limit > 0) s->n_limited_steps++;
    s->decode_limit = 0;

    /* Running sequences first, in order: each gets its remaining tokens. */
    for (int64_t i = 0; rc == CV_OK && i < s->n_running && budget > 0;) {
        cv_sequence *q = s->running[i];
        int64_t n = q->n_tokens - q->n_computed;
        if (n <= 0) { i++; continue; } /* waits for its sampled token */
        if (q->n_spec > 0) { /* proposals yield to the budget and to free blocks, never preempt */
            int64_t spare = q->n_spec;
            if (n > budget) { int64_t cut = n - budget < spare ? n - budget : spare; n -= cut; spare -= cut; }
            while (spare > 0 && cv_kv_manager_blocks_needed(s->kv, q, q->n_computed + n) > cv_kv_manager_num_free(s->kv)) {
                n--;
                spare--;
            }
        }
        if (n > budget) {
            if (!chunked) { i++; continue; } /* all or nothing; fits a later step */
            n = budget;
        }
        const int prefill = !is_decode(q);
        if (!prefill && decodes_left == 0) { i++; continue; } /* held back this step */
        if (prefill && n > prefill_left) { /* finite only when chunked */
            if (prefill_left == 0) { i++; continue; }
            n = prefill_left;
        }
        const int64_t need = cv_kv_manager_blocks_needed(s->kv, q, q->n_computed + n);
        int self = 0;
        while (need > cv_kv_manager_num_free(s->kv)) {
            if (s->n_running - 1 > i) {
                preempt(s, s->running[s->n_running - 1], &n_pre); /* newest, not yet planned */
            } else if (i == 0 && s->n_waiting_holding > 0) {
                release_waiting_holders(s, NULL); /* alone: it must get the whole cache */
            } else if (i == 0) {
                break; /* cannot happen while n_tokens <= max_total (checked at add) */
            } else {
                preempt(s, q, &n_pre); /* it is the newest itself */
                self = 1;
                break;
            }
        }
        if (self) break; /* it was the last running one */
        if (need > cv_kv_manager_num_free(s->kv)) { i++; continue; }
        if (cv_kv_manager_allocate(s->kv, q, need) != CV_OK) { rc = CV_ERR_NOMEM; break; }
        emit(s, &n_out, &total, q, n);
        budget -= n;
        if (prefill) prefill_left -= n;
        else decodes_left--;
        i++;
    }

    /* Then waiting ones, in queue order, while budget, seat and blocks allow.
     * Stops at the first that does not fit: O(admitted), never O(waiting). */
    const int64_t seats = admission_seats(s);
    while (rc == CV_OK && n_pre == n_pre_priority && s->cfg.policy != CV_SCHED_STATIC && budget > 0 &&
           prefill_left > 0 && (s->n_running < seats || s->n_running == 0) && s->n_waiting > 0) {
        cv_sequence *q = wait_peek(s);
        if (q == victim) break; /* preempted this step: it cannot also run in it */
        int64_t n_hits = 0, n_free_hits = 0, computed = q->n_computed;
        const int fresh = cv_kv_num_blocks(q) == 0, resume = fresh && q->blocks.n_kept > 0;
        if (resume) {
            computed = cv_kv_manager_lookup_resume(s->kv, q, &n_hits, &n_free_hits);
        } else if (fresh) {
            n_hits = cv_kv_manager_lookup_prefix(s->kv, q, &n_free_hits);
            computed = n_hits * s->bs;
        }
        int64_t held = fresh ? n_hits : cv_kv_num_blocks(q);
        int64_t n = q->n_tokens - computed;
        if (n <= 0) break; /* cannot happen: a waiting sequence always has tokens to compute */
        if (n > budget) {
            if (!chunked) break; /* its whole prompt must fit this step */
            n = budget;
        }
        if (n > prefill_left) n = prefill_left; /* finite only when chunked */
        int64_t need = blocks_for(s, computed + n) - held;
        if (need < 0) need = 0;
        if (need + n_free_hits > cv_kv_manager_num_free(s->kv)) {
            if (s->n_running == 0 && s->n_waiting_holding > (fresh ? 0 : 1)) {
                release_waiting_holders(s, q); /* nothing runs: waiting forks must not block the head */
                continue;
            }
            break; /* no preemption to admit */
        }
        if (s->n_running > 0 && s->cfg.admission_reserve > 0) { /* alone, it starts once its first chunk fits */
            const int64_t reserve = reserve_tokens(s);
            int64_t total = growth_blocks(s, q, held, reserve);
            if (total < need) total = need;
            const int64_t room = cv_kv_manager_num_free(s->kv) - total - n_free_hits;
            if (!running_growth_fits(s, q, reserve, room))
                break; /* admitting it now would likely preempt: wait for blocks to free */
        }
        if (cv_kv_manager_reserve(s->kv, q, held + need > 0 ? held + need : 1) != CV_OK) {
            rc = CV_ERR_NOMEM;
            break;
        }
        wait_remove(s, q);
        /* reserved and counted: neither can fail */
        if (resume) take_resume(s, q);
        else if (fresh) cv_kv_manager_take_prefix(s->kv, q, n_hits);
        cv_kv_manager_allocate(s->kv, q, need);
        q->status = CV_SEQ_RUNNING;
        running_insert(s, q);
        emit(s, &n_out, &total, q, n);
        budget -= n;
        prefill_left -= n;
    }

    /* proposals of running sequences this step did not plan */
    for (int64_t i = 0; i < s->n_running; i++)
        if (s->running[i]->n_spec > 0 && s->running[i]->planned_step != s->steps) drop_proposals(s->running[i]);

    s->tokens_planned += total;
    out->n_seqs = n_out;
    out->seqs = s->out_seqs;
    out->num_new_tokens = s->out_new;
    out->start_pos = s->out_start;
    out->total_tokens = total;
    out->preempted = s->out_preempted;
    out->n_preempted = n_pre;
    return rc;
}

void cv_scheduler_commit(cv_scheduler *s, const cv_sched_output *out) {
    for (int64_t k = 0; k < out->n_seqs; k++) {
        cv_sequence *q = out->seqs[k];
        /* finished since the plan, or a stale plan: nothing to advance */
        if (q->status != CV_SEQ_RUNNING || q->n_computed != out->start_pos[k]) continue;
        q->n_computed += out->num_new_tokens[k];
        cv_kv_manager_cache_full(s->kv, q);
    }
}

void cv_scheduler_verified(cv_scheduler *s, cv_sequence *q, int64_t n_valid) {
    if (q->status != CV_SEQ_RUNNING) return;
    q->n_spec = 0;
    cv_kv_manager_trim(s->kv, q, n_valid);
}

void cv_scheduler_finish(cv_scheduler *s, cv_sequence *q, cv_seq_status status) {
    if (!q || CV_SEQ_IS_FINISHED(q->status)) return;
    if (!CV_SEQ_IS_FINISHED(status)) status = CV_SEQ_FINISHED_ABORTED;
    if (q->status == CV_SEQ_RUNNING) {
        if (q->sched_index >= 0 && q->sched_index < s->n_running && s->running[q->sched_index] == q)
            running_remove(s, q);
    } else if (q->status == CV_SEQ_WAITING) {
        wait_remove(s, q);
    }
    if (q->status == CV_SEQ_RUNNING && status != CV_SEQ_FINISHED_ABORTED) {
        if (status == CV_SEQ_FINISHED_STOPPED) s->n_stops_seen++;
        s->output_tokens_seen += q->n_tokens - q->n_spec - q->n_prompt;
    }
    cv_kv_manager_free(s->kv, q);
    q->status = status;
}

int64_t cv_scheduler_num_unfinished(const cv_scheduler *s) {
    return s->n_running + s->n_waiting;
}

int64_t cv_scheduler_num_running(const cv_scheduler *s) { return s->n_running; }

void cv_scheduler_set_running_target(cv_scheduler *s, int64_t n) { s->running_target = n > 0 ? n : 0; }

void cv_scheduler_limit_next_decodes(cv_scheduler *s, int64_t n) { s->decode_limit = n > 0 ? n : 0; }

void cv_scheduler_get_stats(const cv_scheduler *s, cv_sched_stats *st) {
    memset(st, 0, sizeof *st);
    st->n_running = s->n_running;
    st->n_waiting = s->n_waiting;
    st->n_preempted_total = s->n_preempted_total;
    st->n_recomputed_tokens = s->n_recomputed_tokens;
    st->n_resumed_tokens = s->n_resumed_tokens;
    const int64_t reserve = s->cfg.admission_reserve > 0 ? reserve_tokens(s) : 0;
    st->admission_reserve_tokens = reserve == INT64_MAX ? -1 : reserve;
    st->running_target = admission_seats(s);
    st->n_limited_steps = s->n_limited_steps;
    st->blocks_total = s->usable_blocks;
    st->blocks_free = cv_kv_manager_num_free(s->kv);
    st->blocks_used = st->blocks_total - st->blocks_free;
    st->blocks_cached_free = cv_kv_manager_num_cached_free(s->kv);
    st->blocks_touched = cv_kv_manager_num_touched(s->kv);
    /* Shared blocks are always full, so counting the empty slots of each
     * sequence's unshared tail blocks counts every block once. Waiting forks
     * hold only full blocks. */
    int64_t empty = 0;
    for (int64_t i = 0; i < s->n_running; i++) empty += cv_kv_manager_empty_slots(s->kv, s->running[i]);
    st->tokens_in_kv = st->blocks_used * s->bs - empty;
    st->kv_waste = st->blocks_used ? 1.0 - (double)st->tokens_in_kv / (double)(st->blocks_used * s->bs) : 0.0;
    cv_kv_manager_prefix_counts(s->kv, &st->prefix_queries, &st->prefix_hits);
    st->steps = s->steps;
}

/* ---- invariants (tests) ---- */

/* The block side of every sequence is checked by the KV manager at the end;
 * here the queue's own rules, gathering the sequences into held. */
static int check_waiting_seq(const cv_scheduler *s, const cv_sequence *q, const cv_sequence **held,
                             int64_t *n_held, int64_t *holding, cv_err *err) {
    if (q->status != CV_SEQ_WAITING || q->sched_index != -1)
        return cv_set_err(err, CV_ERR_STATE, "waiting sequence %lld has status %d, running index %lld",
                          (long long)q->seq_id, (int)q->status, (long long)q->sched_index);
    const int64_t n_blocks = cv_kv_num_blocks(q);
    if (q->n_computed != n_blocks * s->bs || q->n_computed >= q->n_tokens || q->n_spec != 0)
        return cv_set_err(err, CV_ERR_STATE,
                          "waiting sequence %lld: %lld computed with %lld blocks, %lld tokens "
                          "(%lld unverified proposals)",
                          (long long)q->seq_id, (long long)q->n_computed, (long long)n_blocks,
                          (long long)q->n_tokens, (long long)q->n_spec);
    if (n_blocks > 0) (*holding)++;
    held[(*n_held)++] = q;
    return CV_OK;
}

int cv_scheduler_check(const cv_scheduler *s, cv_err *err) {
    int rc = CV_OK;
    int64_t n_held = 0, count = 0, holding = 0;
    /* room for every counted sequence, and one more to catch a list longer than its count */
    const cv_sequence **held = calloc((size_t)(s->n_running + s->n_waiting + 2), sizeof *held);
    if (!held) return cv_set_err(err, CV_ERR_NOMEM, "scheduler check: out of memory");

    if (s->n_running < 0 || s->n_running > s->cfg.max_num_seqs) {
        rc = cv_set_err(err, CV_ERR_STATE, "%lld running sequences, cap max_num_seqs %lld",
                        (long long)s->n_running, (long long)s->cfg.max_num_seqs);
        goto done;
    }
    for (int64_t i = 0; i < s->n_running; i++) {
        const cv_sequence *q = s->running[i];
        if (q->status != CV_SEQ_RUNNING || q->sched_index != i || q->heap_index != -1 || q->q_prev || q->q_next) {
            rc = cv_set_err(err, CV_ERR_STATE, "running[%lld] = sequence %lld with status %d, index %lld",
                            (long long)i, (long long)q->seq_id, (int)q->status, (long long)q->sched_index);
            goto done;
        }
        if (i > 0 && !seq_less(s, s->running[i - 1], q)) {
            rc = cv_set_err(err, CV_ERR_STATE, "running order: sequence %lld before %lld",
                            (long long)s->running[i - 1]->seq_id, (long long)q->seq_id);
            goto done;
        }
        const int64_t n_blocks = cv_kv_num_blocks(q);
        if (q->n_computed < 0 || q->n_computed > q->n_tokens || q->n_tokens > q->max_total ||
            n_blocks * s->bs < q->n_computed || n_blocks > blocks_for(s, q->n_tokens)) {
            rc = cv_set_err(err, CV_ERR_STATE,
                            "running sequence %lld: %lld computed of %lld tokens (max %lld) in %lld blocks",
                            (long long)q->seq_id, (long long)q->n_computed, (long long)q->n_tokens,
                            (long long)q->max_total, (long long)n_blocks);
            goto done;
        }
        held[n_held++] = q;
    }

    if (s->heap_len > s->n_waiting) {
        rc = cv_set_err(err, CV_ERR_STATE, "waiting heap holds %lld, the waiting count is %lld",
                        (long long)s->heap_len, (long long)s->n_waiting);
        goto done;
    }
    for (int64_t i = 0; i < s->heap_len; i++) {
        const cv_sequence *q = s->heap[i];
        if (q->heap_index != i || q->q_prev || q->q_next || (i > 0 && wait_less(s, q, s->heap[(i - 1) / 2]))) {
            rc = cv_set_err(err, CV_ERR_STATE, "waiting heap broken at %lld (sequence %lld)",
                            (long long)i, (long long)q->seq_id);
            goto done;
        }
        /* under the continuous policy the heap holds the never-admitted */
        if (s->cfg.policy == CV_SCHED_CONTINUOUS && (cv_kv_num_blocks(q) != 0 || q->n_preemptions != 0)) {
            rc = cv_set_err(err, CV_ERR_STATE, "waiting heap holds sequence %lld, which was admitted before",
                            (long long)q->seq_id);
            goto done;
        }
        if ((rc = check_waiting_seq(s, q, held, &n_held, &holding, err)) != CV_OK) goto done;
        count++;
    }
    if (s->cfg.policy == CV_SCHED_PRIORITY ? (s->resume_head || s->fresh_head)
                                           : (fresh_in_heap(s) && s->fresh_head)) {
        rc = cv_set_err(err, CV_ERR_STATE, "a waiting list is in use where the heap holds the queue");
        goto done;
    }
    {
        const cv_sequence *heads[2] = {s->resume_head, s->fresh_head};
        const cv_sequence *tails[2] = {s->resume_tail, s->fresh_tail};
        for (int l = 0; l < 2; l++) {
            const cv_sequence *prev = NULL;
            for (const cv_sequence *q = heads[l]; q; q = q->q_next) {
                if (count > s->n_waiting) {
                    rc = cv_set_err(err, CV_ERR_STATE, "waiting list longer than its count %lld (a cycle?)",
                                    (long long)s->n_waiting);
                    goto done;
                }
                if (q->q_prev != prev || q->heap_index != -1) {
                    rc = cv_set_err(err, CV_ERR_STATE, "waiting list: broken back link at sequence %lld",
                                    (long long)q->seq_id);
                    goto done;
                }
                /* Never-admitted sequences wait in arrival order; preempted
                 * ones and forks wait ahead of them. */
                if (l == 1 && (cv_kv_num_blocks(q) != 0 || q->n_preemptions != 0 ||
                               (prev && prev->arrival >= q->arrival))) {
                    rc = cv_set_err(err, CV_ERR_STATE,
                                    "waiting queue out of arrival order at sequence %lld (arrival %lld)",
                                    (long long)q->seq_id, (long long)q->arrival);
                    goto done;
                }
                if ((rc = check_waiting_seq(s, q, held, &n_held, &holding, err)) != CV_OK) goto done;
                prev = q;
                count++;
            }
            if (tails[l] != prev) {
                rc = cv_set_err(err, CV_ERR_STATE, "waiting list: tail is not the last sequence");
                goto done;
            }
        }
    }
    if (count != s->n_waiting || holding != s->n_waiting_holding) {
        rc = cv_set_err(err, CV_ERR_STATE, "%lld waiting (%lld holding blocks), counters say %lld (%lld)",
                        (long long)count, (long long)holding, (long long)s->n_waiting,
                        (long long)s->n_waiting_holding);
        goto done;
    }
    rc = cv_kv_manager_check(s->kv, held, n_held, err);
done:
    free(held);
    return rc;
}
