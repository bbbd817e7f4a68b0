/* Binding of the scheduler part: conveyor._testing.Scheduler, a harness for
 * tests and benchmarks that drives the C scheduler with a fake runner, and
 * conveyor._testing.KVManager, the KV manager alone (at the end of the file).
 * Each owns the cv_sequence objects it creates (finished ones are kept, for seq_info,
 * until the harness is freed).
 *
 *   plan = s.schedule()          # the step's plan (dict of lists)
 *   s.commit()                   # the runner ran it: advance n_computed
 *   s.append_token(id, tok)      # for sequences whose tokens are all computed
 *   s.finish(id, "length")       # "stopped" | "length" | "aborted"
 */
#include "../binding/arrays.h"

#include "../core/kv_manager.h"
#include "../core/scheduler.h"
#include "../core/sequence.h"
#include "../core/step_cost.h"

typedef struct {
    PyObject_HEAD
    cv_scheduler *s;
    cv_kv_manager *kv;    /* the scheduler's blocks (destroyed after it) */
    cv_scheduler_config cfg;
    PyObject *seqs;       /* private dict: seq_id (int) -> int, the address of a cv_sequence owned
                           * here (ints only: no cycle, so no GC support) */
    cv_sched_output plan; /* the last plan (arrays owned by the scheduler) */
    int pending;          /* plan scheduled and not committed yet */
} SchedObject;

static const char *status_name(cv_seq_status st) {
    switch (st) {
    case CV_SEQ_NEW: return "new";
    case CV_SEQ_WAITING: return "waiting";
    case CV_SEQ_RUNNING: return "running";
    case CV_SEQ_FINISHED_STOPPED: return "stopped";
    case CV_SEQ_FINISHED_LENGTH: return "length";
    case CV_SEQ_FINISHED_ABORTED: return "aborted";
    }
    return "unknown";
}

/* The sequence with this id, or NULL with KeyError set. */
static cv_sequence *get_seq(PyObject *seqs, long long seq_id) {
    PyObject *key = PyLong_FromLongLong(seq_id);
    if (!key) return NULL;
    PyObject *v = PyDict_GetItemWithError(seqs, key); /* borrowed */
    Py_DECREF(key);
    if (!v) {
        if (!PyErr_Occurred()) PyErr_Format(PyExc_KeyError, "no sequence with seq_id %lld", seq_id);
        return NULL;
    }
    return (cv_sequence *)PyLong_AsVoidPtr(v);
}

/* Takes ownership of q under seq_id (frees q on failure). */
static int store_seq(PyObject *seqs, long long seq_id, cv_sequence *q) {
    int rc = -1;
    PyObject *key = PyLong_FromLongLong(seq_id);
    PyObject *val = PyLong_FromVoidPtr(q);
    if (key && val && PyDict_SetItem(seqs, key, val) == 0) rc = 0;
    else cv_sequence_free(q);
    Py_XDECREF(key);
    Py_XDECREF(val);
    return rc;
}

static void drop_seq(PyObject *seqs, long long seq_id, cv_sequence *q) {
    PyObject *key = PyLong_FromLongLong(seq_id);
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb); /* keep the error being raised */
    if (key) {
        if (PyDict_DelItem(seqs, key) < 0) PyErr_Clear();
        Py_DECREF(key);
    } else {
        PyErr_Clear();
    }
    PyErr_Restore(et, ev, tb);
    cv_sequence_free(q);
}

/* 0 when no sequence has this id yet; -1 with ValueError (or the lookup's error). */
static int check_new_id(PyObject *seqs, long long seq_id) {
    PyObject *key = PyLong_FromLongLong(seq_id);
    if (!key) return -1;
    int r = PyDict_Contains(seqs, key);
    Py_DECREF(key);
    if (r > 0) PyErr_Format(PyExc_ValueError, "seq_id %lld already exists", seq_id);
    return r == 0 ? 0 : -1;
}

/* Parses args with fmt, whose first unit is the seq_id and whose second, when it
 * has one, is a long long stored in *n; the sequence, or NULL with an exception. */
static cv_sequence *parse_seq(PyObject *seqs, PyObject *args, const char *fmt, long long *seq_id,
                              long long *n) {
    if (!PyArg_ParseTuple(args, fmt, seq_id, n)) return NULL;
    return get_seq(seqs, *seq_id);
}

/* Frees every sequence the dict owns, then the dict. */
static void free_seqs(PyObject *seqs) {
    if (!seqs) return;
    Py_ssize_t pos = 0;
    PyObject *k, *v;
    while (PyDict_Next(seqs, &pos, &k, &v)) cv_sequence_free(PyLong_AsVoidPtr(v));
    Py_DECREF(seqs);
}

/* The ref count of every block of m, as a list. */
static PyObject *refcount_list(const cv_kv_manager *m) {
    const int64_t nb = cv_kv_manager_num_blocks(m);
    PyObject *l = PyList_New((Py_ssize_t)nb);
    if (!l) return NULL;
    for (int64_t b = 0; b < nb; b++) {
        PyObject *x = PyLong_FromLong(cv_kv_manager_refcount(m, b));
        if (!x) { Py_DECREF(l); return NULL; }
        PyList_SET_ITEM(l, b, x);
    }
    return l;
}

/* None for a check that passed; AssertionError naming the broken invariant of
 * `what`, or the check's own error. */
static PyObject *check_result(int rc, const cv_err *err, const char *what) {
    if (rc == CV_OK) Py_RETURN_NONE;
    if (rc == CV_ERR_STATE) return PyErr_Format(PyExc_AssertionError, "%s invariant broken: %s", what, err->msg);
    return cv_py_raise(err);
}

static PyObject *Sched_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens",
                             "max_model_len", "enable_prefix_caching", "enable_chunked_prefill",
                             "policy", "max_prefill_tokens_while_decoding", "admission_reserve", NULL};
    long long nb, bs, mns, mbt, mml, prefill_cap = 0;
    int prefix = 1, chunked = 1, reserve = 0;
    const char *policy = "continuous";
    if (!PyArg_ParseTupleAndKeywords(args, kw, "LLLLL|ppsLi:Scheduler", kwlist, &nb, &bs, &mns, &mbt,
                                     &mml, &prefix, &chunked, &policy, &prefill_cap, &reserve))
        return NULL;
    cv_scheduler_config cfg = {0};
    cfg.max_num_seqs = mns;
    cfg.max_num_batched_tokens = mbt;
    cfg.max_model_len = mml;
    cfg.enable_chunked_prefill = chunked;
    cfg.max_prefill_tokens_while_decoding = prefill_cap;
    cfg.admission_reserve = reserve;
    if (strcmp(policy, "continuous") == 0) cfg.policy = CV_SCHED_CONTINUOUS;
    else if (strcmp(policy, "priority") == 0) cfg.policy = CV_SCHED_PRIORITY;
    else if (strcmp(policy, "static") == 0) cfg.policy = CV_SCHED_STATIC;
    else if (strcmp(policy, "fcfs") == 0) cfg.policy = CV_SCHED_FCFS;
    else {
        PyErr_Format(PyExc_ValueError,
                     "policy must be \"continuous\", \"fcfs\", \"priority\" or \"static\", got \"%s\"", policy);
        return NULL;
    }
    SchedObject *self = (SchedObject *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    self->cfg = cfg;
    self->seqs = PyDict_New();
    if (!self->seqs) goto fail;
    cv_err err = {0};
    self->kv = cv_kv_manager_create(nb, bs, prefix, &err);
    if (!self->kv) { cv_py_raise(&err); goto fail; }
    self->s = cv_scheduler_create(&cfg, self->kv, &err);
    if (!self->s) { cv_py_raise(&err); goto fail; }
    return (PyObject *)self;
fail:
    Py_DECREF(self);
    return NULL;
}

static void Sched_dealloc(SchedObject *self) {
    PyTypeObject *type = Py_TYPE(self);
    cv_scheduler_destroy(self->s);
    cv_kv_manager_destroy(self->kv);
    free_seqs(self->seqs);
    type->tp_free((PyObject *)self);
    Py_DECREF(type);
}

/* What both harnesses' seq_info report of a sequence: its tokens and their KV. */
static PyObject *seq_dict(const cv_sequence *q) {
    PyObject *d = PyDict_New();
    if (!d) return NULL;
    if (cv_py_put(d, "n_tokens", PyLong_FromLongLong(q->n_tokens)) < 0 ||
        cv_py_put(d, "tokens", cv_py_int32_list(q->tokens, q->n_tokens)) < 0 ||
        cv_py_put(d, "n_computed", PyLong_FromLongLong(q->n_computed)) < 0 ||
        cv_py_put(d, "n_cached_prompt", PyLong_FromLongLong(q->n_cached_prompt)) < 0 ||
        cv_py_put(d, "block_table", cv_py_int32_list(q->blocks.table, q->blocks.n)) < 0 ||
        cv_py_put(d, "n_kept", PyLong_FromLongLong(q->blocks.n_kept)) < 0 ||
        cv_py_put(d, "kept_computed", PyLong_FromLongLong(q->blocks.kept_computed)) < 0) {
        Py_DECREF(d);
        return NULL;
    }
    return d;
}

/* A new sequence holding the int32 tokens of a Python sequence; NULL with an
 * exception set. */
static cv_sequence *new_seq_from(long long seq_id, PyObject *tokens, long long max_tokens) {
    PyObject *fast = PySequence_Fast(tokens, "prompt_tokens must be a sequence of ints");
    if (!fast) return NULL;
    cv_sequence *q = NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    int32_t *toks = PyMem_Malloc((size_t)(n + 1) * sizeof *toks);
    if (!toks) { PyErr_NoMemory(); goto done; }
    for (Py_ssize_t i = 0; i < n; i++) {
        long long t = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i));
        if (t == -1 && PyErr_Occurred()) goto done;
        if (t < INT32_MIN || t > INT32_MAX) {
            PyErr_Format(PyExc_ValueError, "token %lld at position %zd does not fit int32", t, i);
            goto done;
        }
        toks[i] = (int32_t)t;
    }
    q = cv_sequence_create(seq_id, toks, n, max_tokens);
    if (!q) PyErr_NoMemory();
done:
    PyMem_Free(toks);
    Py_DECREF(fast);
    return q;
}

/* A new sequence under a new seq_id, holding tokens, owned by seqs; NULL with
 * an exception set. */
static cv_sequence *add_seq(PyObject *seqs, long long seq_id, PyObject *tokens, long long max_tokens) {
    if (check_new_id(seqs, seq_id) < 0) return NULL;
    if (max_tokens < 0) {
        PyErr_Format(PyExc_ValueError, "max_tokens must be >= 0, got %lld", max_tokens);
        return NULL;
    }
    cv_sequence *q = new_seq_from(seq_id, tokens, max_tokens);
    if (!q || store_seq(seqs, seq_id, q) < 0) return NULL;
    return q;
}

/* A new sequence under child_id holding the prompt and priority of the
 * sequence parent_id (set in *parent), owned by seqs; with the parent's room
 * for new tokens when with_room, else none. NULL with an exception set. */
static cv_sequence *add_child_seq(PyObject *seqs, long long child_id, long long parent_id, int with_room,
                                  cv_sequence **parent) {
    *parent = get_seq(seqs, parent_id);
    if (!*parent || check_new_id(seqs, child_id) < 0) return NULL;
    const cv_sequence *p = *parent;
    cv_sequence *child = cv_sequence_create(child_id, p->tokens, p->n_prompt,
                                            with_room ? p->max_total - p->n_prompt : 0);
    if (!child) {
        PyErr_NoMemory();
        return NULL;
    }
    child->priority = p->priority;
    if (store_seq(seqs, child_id, child) < 0) return NULL;
    return child;
}

static PyObject *Sched_add(SchedObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"seq_id", "prompt_tokens", "max_tokens", "priority", NULL};
    long long seq_id, max_tokens;
    int priority = 0;
    PyObject *prompt;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "LOL|i:add", kwlist, &seq_id, &prompt, &max_tokens, &priority))
        return NULL;
    cv_sequence *q = add_seq(self->seqs, seq_id, prompt, max_tokens);
    if (!q) return NULL;
    q->priority = priority;
    cv_err err = {0};
    if (cv_scheduler_add(self->s, q, &err) != CV_OK) {
        cv_py_raise(&err);
        drop_seq(self->seqs, seq_id, q);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *Sched_fork(SchedObject *self, PyObject *args) {
    long long child_id, parent_id;
    if (!PyArg_ParseTuple(args, "LL:fork", &child_id, &parent_id)) return NULL;
    cv_sequence *parent;
    cv_sequence *child = add_child_seq(self->seqs, child_id, parent_id, 1, &parent);
    if (!child) return NULL;
    cv_err err = {0};
    if (cv_scheduler_add_fork(self->s, child, parent, &err) != CV_OK) {
        cv_py_raise(&err);
        drop_seq(self->seqs, child_id, child);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *seq_id_list(cv_sequence *const *seqs, int64_t n) {
    PyObject *l = PyList_New((Py_ssize_t)n);
    if (!l) return NULL;
    for (int64_t i = 0; i < n; i++) {
        PyObject *x = PyLong_FromLongLong(seqs[i]->seq_id);
        if (!x) { Py_DECREF(l); return NULL; }
        PyList_SET_ITEM(l, i, x);
    }
    return l;
}

static PyObject *plan_dict(const cv_sched_output *p) {
    PyObject *d = PyDict_New();
    if (!d) return NULL;
    PyObject *tables = PyList_New((Py_ssize_t)p->n_seqs);
    if (!tables) goto fail;
    for (int64_t i = 0; i < p->n_seqs; i++) {
        PyObject *t = cv_py_int32_list(p->seqs[i]->blocks.table, p->seqs[i]->blocks.n);
        if (!t) { Py_DECREF(tables); goto fail; }
        PyList_SET_ITEM(tables, i, t);
    }
    if (cv_py_put(d, "block_tables", tables) < 0) goto fail;
    if (cv_py_put(d, "seq_ids", seq_id_list(p->seqs, p->n_seqs)) < 0) goto fail;
    if (cv_py_put(d, "num_new_tokens", cv_py_int32_list(p->num_new_tokens, p->n_seqs)) < 0) goto fail;
    if (cv_py_put(d, "start_pos", cv_py_int64_list(p->start_pos, p->n_seqs)) < 0) goto fail;
    if (cv_py_put(d, "preempted", seq_id_list(p->preempted, p->n_preempted)) < 0) goto fail;
    if (cv_py_put(d, "total_tokens", PyLong_FromLongLong(p->total_tokens)) < 0) goto fail;
    return d;
fail:
    Py_DECREF(d);
    return NULL;
}

static PyObject *Sched_schedule(SchedObject *self, PyObject *Py_UNUSED(ignored)) {
    if (self->pending)
        return PyErr_Format(PyExc_RuntimeError, "the previous plan was not committed: call commit() first");
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = cv_scheduler_schedule(self->s, &self->plan);
    Py_END_ALLOW_THREADS
    self->pending = 1; /* even a partial plan (out of memory) holds blocks and must be committed */
    if (rc != CV_OK) {
        cv_err err = {0};
        cv_set_err(&err, rc, "scheduler: out of memory growing a block table");
        return cv_py_raise(&err);
    }
    return plan_dict(&self->plan);
}

static PyObject *Sched_commit(SchedObject *self, PyObject *Py_UNUSED(ignored)) {
    if (!self->pending) return PyErr_Format(PyExc_RuntimeError, "no plan to commit: call schedule() first");
    cv_scheduler_commit(self->s, &self->plan);
    self->pending = 0;
    Py_RETURN_NONE;
}

static PyObject *Sched_append_token(SchedObject *self, PyObject *args) {
    long long seq_id, token;
    cv_sequence *q = parse_seq(self->seqs, args, "LL:append_token", &seq_id, &token);
    if (!q) return NULL;
    if (q->status != CV_SEQ_RUNNING)
        return PyErr_Format(PyExc_ValueError, "sequence %lld is %s, not running", seq_id,
                            status_name(q->status));
    if (q->n_computed != q->n_tokens)
        return PyErr_Format(PyExc_ValueError, "sequence %lld still has %lld uncomputed tokens",
                            seq_id, (long long)(q->n_tokens - q->n_computed));
    if (q->n_tokens >= q->max_total)
        return PyErr_Format(PyExc_ValueError, "sequence %lld already holds max_total=%lld tokens",
                            seq_id, (long long)q->max_total);
    if (token < INT32_MIN || token > INT32_MAX)
        return PyErr_Format(PyExc_ValueError, "token %lld does not fit int32", token);
    if (cv_sequence_append(q, (int32_t)token) != CV_OK) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static int parse_reason(const char *r, cv_seq_status *st) {
    if (strcmp(r, "stopped") == 0) *st = CV_SEQ_FINISHED_STOPPED;
    else if (strcmp(r, "length") == 0) *st = CV_SEQ_FINISHED_LENGTH;
    else if (strcmp(r, "aborted") == 0) *st = CV_SEQ_FINISHED_ABORTED;
    else {
        PyErr_Format(PyExc_ValueError, "reason must be \"stopped\", \"length\" or \"aborted\", got \"%s\"", r);
        return -1;
    }
    return 0;
}

static PyObject *Sched_finish(SchedObject *self, PyObject *args) {
    long long seq_id;
    const char *reason = "stopped";
    if (!PyArg_ParseTuple(args, "L|s:finish", &seq_id, &reason)) return NULL;
    cv_seq_status st;
    if (parse_reason(reason, &st) < 0) return NULL;
    cv_sequence *q = get_seq(self->seqs, seq_id);
    if (!q) return NULL;
    cv_scheduler_finish(self->s, q, st);
    Py_RETURN_NONE;
}

static PyObject *Sched_abort(SchedObject *self, PyObject *args) {
    long long seq_id;
    cv_sequence *q = parse_seq(self->seqs, args, "L:abort", &seq_id, NULL);
    if (!q) return NULL;
    cv_scheduler_finish(self->s, q, CV_SEQ_FINISHED_ABORTED);
    Py_RETURN_NONE;
}

static PyObject *Sched_seq_info(SchedObject *self, PyObject *args) {
    long long seq_id;
    cv_sequence *q = parse_seq(self->seqs, args, "L:seq_info", &seq_id, NULL);
    if (!q) return NULL;
    PyObject *d = seq_dict(q);
    if (!d) return NULL;
    if (cv_py_put(d, "status", PyUnicode_FromString(status_name(q->status))) < 0 ||
        cv_py_put(d, "n_prompt", PyLong_FromLongLong(q->n_prompt)) < 0 ||
        cv_py_put(d, "max_total", PyLong_FromLongLong(q->max_total)) < 0 ||
        cv_py_put(d, "n_preemptions", PyLong_FromLongLong(q->n_preemptions)) < 0 ||
        cv_py_put(d, "arrival", PyLong_FromLongLong(q->arrival)) < 0 ||
        cv_py_put(d, "priority", PyLong_FromLong(q->priority)) < 0) {
        Py_DECREF(d);
        return NULL;
    }
    return d;
}

static PyObject *Sched_stats(SchedObject *self, PyObject *Py_UNUSED(ignored)) {
    cv_sched_stats st;
    cv_scheduler_get_stats(self->s, &st);
    PyObject *d = PyDict_New();
    if (!d) return NULL;
    if (cv_py_put(d, "n_running", PyLong_FromLongLong(st.n_running)) < 0 ||
        cv_py_put(d, "n_waiting", PyLong_FromLongLong(st.n_waiting)) < 0 ||
        cv_py_put(d, "n_preempted_total", PyLong_FromLongLong(st.n_preempted_total)) < 0 ||
        cv_py_put(d, "n_recomputed_tokens", PyLong_FromLongLong(st.n_recomputed_tokens)) < 0 ||
        cv_py_put(d, "n_resumed_tokens", PyLong_FromLongLong(st.n_resumed_tokens)) < 0 ||
        cv_py_put(d, "admission_reserve_tokens", PyLong_FromLongLong(st.admission_reserve_tokens)) < 0 ||
        cv_py_put(d, "running_target", PyLong_FromLongLong(st.running_target)) < 0 ||
        cv_py_put(d, "n_held_back_steps", PyLong_FromLongLong(st.n_limited_steps)) < 0 ||
        cv_py_put(d, "blocks_total", PyLong_FromLongLong(st.blocks_total)) < 0 ||
        cv_py_put(d, "blocks_used", PyLong_FromLongLong(st.blocks_used)) < 0 ||
        cv_py_put(d, "blocks_free", PyLong_FromLongLong(st.blocks_free)) < 0 ||
        cv_py_put(d, "blocks_cached_free", PyLong_FromLongLong(st.blocks_cached_free)) < 0 ||
        cv_py_put(d, "tokens_in_kv", PyLong_FromLongLong(st.tokens_in_kv)) < 0 ||
        cv_py_put(d, "kv_waste", PyFloat_FromDouble(st.kv_waste)) < 0 ||
        cv_py_put(d, "prefix_queries", PyLong_FromLongLong(st.prefix_queries)) < 0 ||
        cv_py_put(d, "prefix_hits", PyLong_FromLongLong(st.prefix_hits)) < 0 ||
        cv_py_put(d, "steps", PyLong_FromLongLong(st.steps)) < 0) {
        Py_DECREF(d);
        return NULL;
    }
    return d;
}

static PyObject *Sched_check(SchedObject *self, PyObject *Py_UNUSED(ignored)) {
    cv_err err = {0};
    int rc = cv_scheduler_check(self->s, &err);
    return check_result(rc, &err, "scheduler");
}

static PyObject *Sched_block_refcounts(SchedObject *self, PyObject *Py_UNUSED(ignored)) {
    return refcount_list(self->kv);
}

static PyObject *Sched_num_unfinished(SchedObject *self, PyObject *Py_UNUSED(ignored)) {
    return PyLong_FromLongLong(cv_scheduler_num_unfinished(self->s));
}

static PyObject *Sched_set_running_target(SchedObject *self, PyObject *args) {
    long long n;
    if (!PyArg_ParseTuple(args, "L", &n)) return NULL;
    cv_scheduler_set_running_target(self->s, n);
    Py_RETURN_NONE;
}

static PyObject *Sched_limit_next_decodes(SchedObject *self, PyObject *args) {
    long long n;
    if (!PyArg_ParseTuple(args, "L", &n)) return NULL;
    cv_scheduler_limit_next_decodes(self->s, n);
    Py_RETURN_NONE;
}

/* Pure C: n steps of schedule + commit (timed) and a fake runner that appends
 * `token` to every sequence whose tokens are all computed and finishes it at
 * max_total. Fills t[n] with seconds per schedule+commit; returns steps run. */
static int64_t fake_steps(SchedObject *self, int64_t n, int32_t token, double *t, int *rc) {
    int64_t i = 0;
    *rc = CV_OK;
    for (; i < n; i++) {
        double t0 = cv_now();
        *rc = cv_scheduler_schedule(self->s, &self->plan);
        cv_scheduler_commit(self->s, &self->plan);
        t[i] = cv_now() - t0;
        if (*rc != CV_OK) return i + 1;
        for (int64_t k = 0; k < self->plan.n_seqs; k++) {
            cv_sequence *q = self->plan.seqs[k];
            if (q->status != CV_SEQ_RUNNING || q->n_computed != q->n_tokens) continue;
            if (q->n_tokens < q->max_total && (*rc = cv_sequence_append(q, token)) != CV_OK) return i + 1;
            if (q->n_tokens >= q->max_total) cv_scheduler_finish(self->s, q, CV_SEQ_FINISHED_LENGTH);
        }
    }
    return i;
}

static PyObject *Sched_bench_steps(SchedObject *self, PyObject *args) {
    long long n;
    int token = 1;
    if (!PyArg_ParseTuple(args, "L|i:bench_steps", &n, &token)) return NULL;
    if (n < 0) return PyErr_Format(PyExc_ValueError, "n_steps must be >= 0, got %lld", n);
    if (self->pending)
        return PyErr_Format(PyExc_RuntimeError, "the previous plan was not committed: call commit() first");
    double *t = PyMem_Malloc((size_t)(n + 1) * sizeof *t);
    if (!t) return PyErr_NoMemory();
    int rc;
    int64_t done;
    Py_BEGIN_ALLOW_THREADS
    done = fake_steps(self, n, (int32_t)token, t, &rc);
    Py_END_ALLOW_THREADS
    PyObject *l = NULL;
    if (rc != CV_OK) {
        PyErr_NoMemory();
    } else if ((l = PyList_New((Py_ssize_t)done))) {
        for (int64_t i = 0; i < done; i++) {
            PyObject *x = PyFloat_FromDouble(t[i]);
            if (!x) { Py_CLEAR(l); break; }
            PyList_SET_ITEM(l, i, x);
        }
    }
    PyMem_Free(t);
    return l;
}

static PyMethodDef Sched_methods[] = {
    {"set_running_target", (PyCFunction)Sched_set_running_target, METH_VARARGS,
     "set_running_target(n): admissions stop while n run (0: no target)."},
    {"limit_next_decodes", (PyCFunction)Sched_limit_next_decodes, METH_VARARGS,
     "limit_next_decodes(n): the next schedule plans at most n decodes (0: no limit)."},
    {"add", (PyCFunction)(void (*)(void))Sched_add, METH_VARARGS | METH_KEYWORDS,
     "add(seq_id, prompt_tokens, max_tokens, priority=0): queue a new sequence."},
    {"fork", (PyCFunction)Sched_fork, METH_VARARGS,
     "fork(child_id, parent_id): a new sequence sharing the parent's computed prompt blocks."},
    {"schedule", (PyCFunction)Sched_schedule, METH_NOARGS,
     "schedule() -> dict(seq_ids, num_new_tokens, start_pos, block_tables, preempted, total_tokens)."},
    {"commit", (PyCFunction)Sched_commit, METH_NOARGS, "commit(): the last plan ran; advance it."},
    {"append_token", (PyCFunction)Sched_append_token, METH_VARARGS,
     "append_token(seq_id, token): a sampled token for a fully computed running sequence."},
    {"finish", (PyCFunction)Sched_finish, METH_VARARGS,
     "finish(seq_id, reason='stopped'): reason is 'stopped', 'length' or 'aborted'."},
    {"abort", (PyCFunction)Sched_abort, METH_VARARGS, "abort(seq_id)."},
    {"seq_info", (PyCFunction)Sched_seq_info, METH_VARARGS, "seq_info(seq_id) -> dict."},
    {"stats", (PyCFunction)Sched_stats, METH_NOARGS, "stats() -> dict."},
    {"check", (PyCFunction)Sched_check, METH_NOARGS,
     "check(): raises AssertionError naming the first broken invariant."},
    {"block_refcounts", (PyCFunction)Sched_block_refcounts, METH_NOARGS,
     "block_refcounts() -> list of the ref count of every block."},
    {"num_unfinished", (PyCFunction)Sched_num_unfinished, METH_NOARGS, "num_unfinished() -> int."},
    {"bench_steps", (PyCFunction)Sched_bench_steps, METH_VARARGS,
     "bench_steps(n_steps, token=1) -> list of seconds per schedule+commit, timed in C, with a "
     "fake runner appending token and finishing sequences at max_tokens."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot Sched_slots[] = {
    {Py_tp_doc, PyDoc_STR("Scheduler(num_blocks, block_size, max_num_seqs, max_num_batched_tokens, "
                        "max_model_len, enable_prefix_caching=True, enable_chunked_prefill=True, "
                        "policy='continuous', max_prefill_tokens_while_decoding=0, admission_reserve=0): the C scheduler with a fake-runner harness.")},
    {Py_tp_new, Sched_new},
    {Py_tp_dealloc, Sched_dealloc},
    {Py_tp_methods, Sched_methods},
    {0, NULL},
};

static PyType_Spec Sched_spec = {
    .name = "conveyor._testing.Scheduler",
    .basicsize = sizeof(SchedObject),
    .flags = CV_PY_TYPE_FLAGS,
    .slots = Sched_slots,
};

/* ---- conveyor._testing.KVManager: the KV manager alone, for tests ----
 *
 *   kv = KVManager(num_blocks, block_size, enable_prefix_caching=True)
 *   kv.add(1, [5, 6, 7])         # a sequence holding these tokens, no blocks
 *   kv.allocate(1, 2)            # two more blocks in its table
 *   kv.compute(1, 3)             # the runner computed 3 more tokens
 */

typedef struct {
    PyObject_HEAD
    cv_kv_manager *m;
    PyObject *seqs;       /* as SchedObject's: seq_id -> address of an owned cv_sequence */
} KVObject;

static PyObject *KV_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"num_blocks", "block_size", "enable_prefix_caching", NULL};
    long long nb, bs;
    int prefix = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "LL|p:KVManager", kwlist, &nb, &bs, &prefix)) return NULL;
    KVObject *self = (KVObject *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    self->seqs = PyDict_New();
    if (!self->seqs) goto fail;
    cv_err err = {0};
    self->m = cv_kv_manager_create(nb, bs, prefix, &err);
    if (!self->m) { cv_py_raise(&err); goto fail; }
    return (PyObject *)self;
fail:
    Py_DECREF(self);
    return NULL;
}

static void KV_dealloc(KVObject *self) {
    PyTypeObject *type = Py_TYPE(self);
    cv_kv_manager_destroy(self->m);
    free_seqs(self->seqs);
    type->tp_free((PyObject *)self);
    Py_DECREF(type);
}

static PyObject *KV_add(KVObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"seq_id", "tokens", "skip_prefix_cache", NULL};
    long long seq_id;
    PyObject *tokens;
    int skip = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "LO|p:add", kwlist, &seq_id, &tokens, &skip)) return NULL;
    cv_sequence *q = add_seq(self->seqs, seq_id, tokens, 0);
    if (!q) return NULL;
    q->skip_prefix_cache = skip;
    Py_RETURN_NONE;
}

/* Appends tokens to a sequence; as unverified proposals (n_spec) when asked. */
static PyObject *KV_append(KVObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"seq_id", "tokens", "proposals", NULL};
    long long seq_id;
    PyObject *tokens;
    int spec = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "LO|p:append", kwlist, &seq_id, &tokens, &spec)) return NULL;
    cv_sequence *q = get_seq(self->seqs, seq_id);
    if (!q) return NULL;
    cv_sequence *t = new_seq_from(-1, tokens, 0);
    if (!t) return NULL;
    for (int64_t i = 0; i < t->n_tokens; i++) {
        if (cv_sequence_append(q, t->tokens[i]) != CV_OK) {
            cv_sequence_free(t);
            return PyErr_NoMemory();
        }
        if (spec) q->n_spec++;
    }
    cv_sequence_free(t);
    Py_RETURN_NONE;
}

static PyObject *KV_allocate(KVObject *self, PyObject *args) {
    long long seq_id, n;
    cv_sequence *q = parse_seq(self->seqs, args, "LL:allocate", &seq_id, &n);
    if (!q) return NULL;
    if (n < 0) return PyErr_Format(PyExc_ValueError, "n must be >= 0, got %lld", n);
    int rc = cv_kv_manager_allocate(self->m, q, n);
    if (rc == CV_ERR_NOMEM) return PyErr_NoMemory();
    if (rc != CV_OK)
        return PyErr_Format(PyExc_ValueError, "%lld blocks asked, %lld free", n,
                            (long long)cv_kv_manager_num_free(self->m));
    Py_RETURN_NONE;
}

static PyObject *KV_free(KVObject *self, PyObject *args) {
    long long seq_id;
    cv_sequence *q = parse_seq(self->seqs, args, "L:free", &seq_id, NULL);
    if (!q) return NULL;
    cv_kv_manager_free(self->m, q);
    Py_RETURN_NONE;
}

/* The runner computed n more tokens of the sequence; newly full blocks are cached. */
static PyObject *KV_compute(KVObject *self, PyObject *args) {
    long long seq_id, n;
    cv_sequence *q = parse_seq(self->seqs, args, "LL:compute", &seq_id, &n);
    if (!q) return NULL;
    int64_t room = cv_kv_num_blocks(q) * cv_kv_manager_block_size(self->m);
    if (room > q->n_tokens) room = q->n_tokens;
    if (n < 0 || q->n_computed + n > room)
        return PyErr_Format(PyExc_ValueError,
                            "sequence %lld: %lld computed, %lld more asked, its blocks and tokens hold %lld",
                            seq_id, (long long)q->n_computed, n, (long long)room);
    q->n_computed += n;
    cv_kv_manager_cache_full(self->m, q);
    Py_RETURN_NONE;
}

static PyObject *KV_fork(KVObject *self, PyObject *args) {
    long long child_id, parent_id;
    if (!PyArg_ParseTuple(args, "LL:fork", &child_id, &parent_id)) return NULL;
    cv_sequence *parent;
    cv_sequence *child = add_child_seq(self->seqs, child_id, parent_id, 0, &parent);
    if (!child) return NULL;
    if (cv_kv_manager_fork(self->m, child, parent) != CV_OK) {
        PyErr_NoMemory();
        drop_seq(self->seqs, child_id, child);
        return NULL;
    }
    Py_RETURN_NONE;
}

/* Speculative verification: the sequence keeps its first n_tokens tokens
 * (its proposals end), and the KV past n_valid is not valid. */
static PyObject *KV_trim(KVObject *self, PyObject *args) {
    long long seq_id, n_tokens, n_valid;
    if (!PyArg_ParseTuple(args, "LLL:trim", &seq_id, &n_tokens, &n_valid)) return NULL;
    cv_sequence *q = get_seq(self->seqs, seq_id);
    if (!q) return NULL;
    if (n_tokens < 0 || n_tokens > q->n_tokens || n_valid < 0)
        return PyErr_Format(PyExc_ValueError, "sequence %lld holds %lld tokens: cannot keep %lld (n_valid %lld)",
                            seq_id, (long long)q->n_tokens, n_tokens, n_valid);
    q->n_tokens = n_tokens;
    q->n_spec = 0;
    cv_kv_manager_trim(self->m, q, n_valid);
    Py_RETURN_NONE;
}

static PyObject *KV_lookup_prefix(KVObject *self, PyObject *args) {
    long long seq_id;
    cv_sequence *q = parse_seq(self->seqs, args, "L:lookup_prefix", &seq_id, NULL);
    if (!q) return NULL;
    if (q->n_tokens < 1) return PyErr_Format(PyExc_ValueError, "sequence %lld holds no tokens", seq_id);
    int64_t n_free = 0;
    int64_t n = cv_kv_manager_lookup_prefix(self->m, q, &n_free);
    return Py_BuildValue("(LL)", (long long)n, (long long)n_free);
}

static PyObject *KV_take_prefix(KVObject *self, PyObject *args) {
    long long seq_id, n_hits;
    cv_sequence *q = parse_seq(self->seqs, args, "LL:take_prefix", &seq_id, &n_hits);
    if (!q) return NULL;
    if (cv_kv_num_blocks(q) != 0)
        return PyErr_Format(PyExc_ValueError, "sequence %lld already holds blocks", seq_id);
    if (cv_kv_manager_take_prefix(self->m, q, n_hits) != CV_OK) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *KV_preempt(KVObject *self, PyObject *args) {
    long long seq_id;
    cv_sequence *q = parse_seq(self->seqs, args, "L:preempt", &seq_id, NULL);
    if (!q) return NULL;
    cv_kv_manager_preempt(self->m, q);
    Py_RETURN_NONE;
}

static PyObject *KV_lookup_resume(KVObject *self, PyObject *args) {
    long long seq_id;
    cv_sequence *q = parse_seq(self->seqs, args, "L:lookup_resume", &seq_id, NULL);
    if (!q) return NULL;
    if (q->n_tokens < 1) return PyErr_Format(PyExc_ValueError, "sequence %lld holds no tokens", seq_id);
    if (cv_kv_num_blocks(q) != 0)
        return PyErr_Format(PyExc_ValueError, "sequence %lld already holds blocks", seq_id);
    int64_t n_blocks = 0, n_free = 0;
    int64_t tokens = cv_kv_manager_lookup_resume(self->m, q, &n_blocks, &n_free);
    return Py_BuildValue("(LLL)", (long long)tokens, (long long)n_blocks, (long long)n_free);
}

static PyObject *KV_take_resume(KVObject *self, PyObject *args) {
    long long seq_id;
    cv_sequence *q = parse_seq(self->seqs, args, "L:take_resume", &seq_id, NULL);
    if (!q) return NULL;
    if (cv_kv_num_blocks(q) != 0)
        return PyErr_Format(PyExc_ValueError, "sequence %lld already holds blocks", seq_id);
    if (cv_kv_manager_take_resume(self->m, q) != CV_OK) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *KV_seq_info(KVObject *self, PyObject *args) {
    long long seq_id;
    cv_sequence *q = parse_seq(self->seqs, args, "L:seq_info", &seq_id, NULL);
    if (!q) return NULL;
    PyObject *d = seq_dict(q);
    if (!d) return NULL;
    if (cv_py_put(d, "n_cached_blocks", PyLong_FromLongLong(q->blocks.n_cached)) < 0) {
        Py_DECREF(d);
        return NULL;
    }
    return d;
}

static PyObject *KV_stats(KVObject *self, PyObject *Py_UNUSED(ignored)) {
    int64_t queries, hits;
    cv_kv_manager_prefix_counts(self->m, &queries, &hits);
    PyObject *d = PyDict_New();
    if (!d) return NULL;
    if (cv_py_put(d, "num_free", PyLong_FromLongLong(cv_kv_manager_num_free(self->m))) < 0 ||
        cv_py_put(d, "num_cached_free", PyLong_FromLongLong(cv_kv_manager_num_cached_free(self->m))) < 0 ||
        cv_py_put(d, "num_touched", PyLong_FromLongLong(cv_kv_manager_num_touched(self->m))) < 0 ||
        cv_py_put(d, "prefix_queries", PyLong_FromLongLong(queries)) < 0 ||
        cv_py_put(d, "prefix_hits", PyLong_FromLongLong(hits)) < 0) {
        Py_DECREF(d);
        return NULL;
    }
    return d;
}

static PyObject *KV_refcounts(KVObject *self, PyObject *Py_UNUSED(ignored)) {
    return refcount_list(self->m);
}

static PyObject *KV_check(KVObject *self, PyObject *Py_UNUSED(ignored)) {
    Py_ssize_t n = PyDict_Size(self->seqs), pos = 0, i = 0;
    const cv_sequence **all = PyMem_Malloc((size_t)(n + 1) * sizeof *all);
    if (!all) return PyErr_NoMemory();
    PyObject *k, *v;
    while (PyDict_Next(self->seqs, &pos, &k, &v) && i < n) all[i++] = PyLong_AsVoidPtr(v);
    cv_err err = {0};
    int rc = cv_kv_manager_check(self->m, all, i, &err);
    PyMem_Free(all);
    return check_result(rc, &err, "KV manager");
}

static PyMethodDef KV_methods[] = {
    {"add", (PyCFunction)(void (*)(void))KV_add, METH_VARARGS | METH_KEYWORDS,
     "add(seq_id, tokens, skip_prefix_cache=False): a sequence holding tokens (its prompt), no blocks."},
    {"append", (PyCFunction)(void (*)(void))KV_append, METH_VARARGS | METH_KEYWORDS,
     "append(seq_id, tokens, proposals=False): more tokens; unverified proposals when proposals is set."},
    {"allocate", (PyCFunction)KV_allocate, METH_VARARGS,
     "allocate(seq_id, n): n more blocks; ValueError (nothing taken) when fewer are free."},
    {"free", (PyCFunction)KV_free, METH_VARARGS, "free(seq_id): every block back; n_computed 0."},
    {"compute", (PyCFunction)KV_compute, METH_VARARGS,
     "compute(seq_id, n): n more tokens computed into its blocks; newly full ones are cached."},
    {"fork", (PyCFunction)KV_fork, METH_VARARGS,
     "fork(child_id, parent_id): a new sequence with the parent's prompt, sharing its computed blocks."},
    {"trim", (PyCFunction)KV_trim, METH_VARARGS,
     "trim(seq_id, n_tokens, n_valid): keep n_tokens tokens (proposals verified); KV past n_valid is invalid."},
    {"lookup_prefix", (PyCFunction)KV_lookup_prefix, METH_VARARGS,
     "lookup_prefix(seq_id) -> (n_hits, n_free_hits)."},
    {"take_prefix", (PyCFunction)KV_take_prefix, METH_VARARGS,
     "take_prefix(seq_id, n_hits): the first n_hits blocks of the last lookup into its empty table."},
    {"preempt", (PyCFunction)KV_preempt, METH_VARARGS,
     "preempt(seq_id): gives back its blocks, keeping those of its computed KV reclaimable."},
    {"lookup_resume", (PyCFunction)KV_lookup_resume, METH_VARARGS,
     "lookup_resume(seq_id) -> (tokens, n_blocks, n_free_hits): the KV a preempted sequence can take back."},
    {"take_resume", (PyCFunction)KV_take_resume, METH_VARARGS,
     "take_resume(seq_id): takes what the last resume lookup found into its empty table."},
    {"seq_info", (PyCFunction)KV_seq_info, METH_VARARGS, "seq_info(seq_id) -> dict."},
    {"stats", (PyCFunction)KV_stats, METH_NOARGS,
     "stats() -> dict(num_free, num_cached_free, num_touched, prefix_queries, prefix_hits)."},
    {"refcounts", (PyCFunction)KV_refcounts, METH_NOARGS, "refcounts() -> the ref count of every block."},
    {"check", (PyCFunction)KV_check, METH_NOARGS,
     "check(): raises AssertionError naming the first broken invariant."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot KV_slots[] = {
    {Py_tp_doc, PyDoc_STR("KVManager(num_blocks, block_size, enable_prefix_caching=True): the C KV manager "
                          "with sequences owned by the harness.")},
    {Py_tp_new, KV_new},
    {Py_tp_dealloc, KV_dealloc},
    {Py_tp_methods, KV_methods},
    {0, NULL},
};

static PyType_Spec KV_spec = {
    .name = "conveyor._testing.KVManager",
    .basicsize = sizeof(KVObject),
    .flags = CV_PY_TYPE_FLAGS,
    .slots = KV_slots,
};

/* step_cost_knee(steps, cap) -> (knee or None, fit or None): the engine's
 * step-time model fed (decode tokens, prompt tokens, seconds[, context tokens])
 * per step. */
static PyObject *py_step_cost_knee(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *steps;
    long long cap;
    if (!PyArg_ParseTuple(args, "OL", &steps, &cap)) return NULL;
    PyObject *seq = PySequence_Fast(steps, "steps must be a sequence of (decode, prompt, seconds[, context])");
    if (!seq) return NULL;
    cv_step_cost c = {0};
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        long long d, p, ctx = 0;
        double t;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "LLd|L", &d, &p, &t, &ctx)) {
            Py_DECREF(seq);
            return NULL;
        }
        cv_step_cost_observe(&c, d, p, ctx, t);
    }
    Py_DECREF(seq);
    const int64_t knee = cv_step_cost_knee(&c, cap);
    PyObject *k = knee > 0 ? PyLong_FromLongLong(knee) : Py_NewRef(Py_None);
    if (!k) return NULL;
    double f[CV_STEP_COST_TERMS];
    if (!cv_step_cost_fit(&c, f)) return Py_BuildValue("(NO)", k, Py_None);
    return Py_BuildValue("(N(dddd))", k, f[0], f[1], f[2], f[3]);
}

static PyMethodDef step_cost_functions[] = {
    {"step_cost_knee", py_step_cost_knee, METH_VARARGS,
     "step_cost_knee(steps, cap) -> (knee batch or None, (A, B_decode, B_prompt, B_context per 1024) or None); "
     "steps: (decode tokens, prompt tokens, seconds[, context tokens])."},
    {NULL, NULL, 0, NULL}};

int cv_py_add_scheduler(PyObject *m) {
    if (PyModule_AddFunctions(m, step_cost_functions) < 0) return -1;
    return cv_py_add_type(m, &Sched_spec) < 0 ? -1 : cv_py_add_type(m, &KV_spec);
}
