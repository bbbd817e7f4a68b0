/* conveyor._core.Engine: the engine's public C API as a Python type.
 * Python holds request ids; C owns all sequence state. */
#include "arrays.h"

#include <limits.h>
#include <pthread.h>
#include <string.h>
#include <time.h>

#include "../core/engine.h"
#include "../core/kv_cache.h"
#include "engine_config.h"
#include "request_params.h"
#include "py_lora.h"

/* step() runs with the GIL released; `busy` keeps close() (from another thread,
 * or the interpreter's exit) from freeing the engine under a running step. */
typedef struct {
    PyObject_HEAD
    cv_engine *e;
    int64_t vocab;
    pthread_mutex_t busy;
    int busy_ready;
} EngineObject;

/* Detaches the engine (GIL held), then waits for a running step and frees it. */
static void engine_close(EngineObject *self) {
    cv_engine *e = self->e;
    if (!e) return;
    self->e = NULL;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&self->busy);
    cv_engine_destroy(e);
    pthread_mutex_unlock(&self->busy);
    Py_END_ALLOW_THREADS
}

/* Reads a sequence of ints into a new int32 buffer (PyMem). */
static int read_int_list(PyObject *obj, const char *what, int32_t **out, Py_ssize_t *n) {
    *out = NULL;
    *n = 0;
    if (obj == NULL || obj == Py_None) return 0;
    PyObject *seq = PySequence_Tuple(obj); /* a copy: __index__ below may change a list */
    if (!seq) return -1;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
    int32_t *buf = PyMem_Malloc((size_t)(len ? len : 1) * sizeof(int32_t));
    if (!buf) { Py_DECREF(seq); PyErr_NoMemory(); return -1; }
    for (Py_ssize_t i = 0; i < len; i++) {
        long v = PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, i));
        if (v == -1 && PyErr_Occurred()) {
            PyErr_Format(PyExc_TypeError, "%s must contain integers", what);
            PyMem_Free(buf);
            Py_DECREF(seq);
            return -1;
        }
        if (v < INT32_MIN || v > INT32_MAX) v = -1; /* reported as out of vocabulary */
        buf[i] = (int32_t)v;
    }
    Py_DECREF(seq);
    *out = buf;
    *n = len;
    return 0;
}

static void Engine_dealloc(EngineObject *self) {
    PyTypeObject *type = Py_TYPE(self);
    if (self->busy_ready) {
        engine_close(self);
        pthread_mutex_destroy(&self->busy);
    }
    type->tp_free((PyObject *)self);
    Py_DECREF(type);
}

/* Creating an engine loads weights and fills the KV cache: seconds for a big
 * model. It runs on a helper thread while this one, every 50 ms, lets Python
 * run its signal handlers; when one raises (Ctrl-C: KeyboardInterrupt) the
 * build is cancelled and that error propagates. */
typedef struct {
    cv_engine *e;
    const cv_engine_config *cfg;
    cv_err *err;
    atomic_int cancel;
    int rc, finished;
    pthread_mutex_t lock;
    pthread_cond_t cond;
} create_job;

static void *create_thread(void *arg) {
    create_job *j = arg;
    cv_engine_config cfg = *j->cfg;
    cfg.cancel = &j->cancel;
    int rc = cv_engine_create(&j->e, &cfg, j->err);
    pthread_mutex_lock(&j->lock);
    j->rc = rc;
    j->finished = 1;
    pthread_cond_signal(&j->cond);
    pthread_mutex_unlock(&j->lock);
    return NULL;
}

/* Returns the status of cv_engine_create; CV_ERR_CANCELLED with a Python error
 * set when a signal handler raised. Called with the GIL held. */
static int create_interruptibly(cv_engine **out, const cv_engine_config *cfg, cv_err *err) {
    create_job j;
    memset(&j, 0, sizeof j);
    j.cfg = cfg;
    j.err = err;
    atomic_init(&j.cancel, 0);
    pthread_mutex_init(&j.lock, NULL);
    pthread_cond_init(&j.cond, NULL);
    pthread_t th;
    int signalled = 0;
    if (pthread_create(&th, NULL, create_thread, &j) != 0) {
        /* No thread to spare: build here, uninterruptibly. */
        int rc;
        Py_BEGIN_ALLOW_THREADS
        rc = cv_engine_create(out, cfg, err);
        Py_END_ALLOW_THREADS
        pthread_mutex_destroy(&j.lock);
        pthread_cond_destroy(&j.cond);
        return rc;
    }
    for (;;) {
        int finished;
        Py_BEGIN_ALLOW_THREADS
        pthread_mutex_lock(&j.lock);
        if (!j.finished) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_nsec += 50 * 1000 * 1000;
            if (ts.tv_nsec >= 1000000000L) { ts.tv_sec++; ts.tv_nsec -= 1000000000L; }
            pthread_cond_timedwait(&j.cond, &j.lock, &ts);
        }
        finished = j.finished;
        pthread_mutex_unlock(&j.lock);
        Py_END_ALLOW_THREADS
        if (finished) break;
        if (!signalled && PyErr_CheckSignals() < 0) {
            signalled = 1;
            atomic_store(&j.cancel, 1);
        }
    }
    Py_BEGIN_ALLOW_THREADS
    pthread_join(th, NULL);
    pthread_mutex_destroy(&j.lock);
    pthread_cond_destroy(&j.cond);
    Py_END_ALLOW_THREADS
    if (signalled) {
        /* The handler raised: its error wins, even if the build just finished. */
        if (j.rc == CV_OK) {
            Py_BEGIN_ALLOW_THREADS
            cv_engine_destroy(j.e);
            Py_END_ALLOW_THREADS
        }
        return CV_ERR_CANCELLED;
    }
    *out = j.e;
    return j.rc;
}

/* Engine(config, /, *, eos_ids=None, bos_id=-1, strip_space_after_bos=False,
 * token_bytes=None, special_ids=None, **overrides): config is an EngineArgs
 * (read by attribute name) or a model path; any other keyword overrides the
 * config field it names. The keywords named here are the tokenizer's facts. */
static int Engine_init(EngineObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"config", "eos_ids", "bos_id", "strip_space_after_bos", "token_bytes",
                             "special_ids", NULL};
    PyObject *config = NULL, *eos_obj = NULL, *tok_obj = NULL, *special_obj = NULL;
    int strip = 0, bos = -1;
    PyObject *own_kw = PyDict_New(), *overrides = kw ? PyDict_Copy(kw) : PyDict_New();
    if (!own_kw || !overrides) {
        Py_XDECREF(own_kw);
        Py_XDECREF(overrides);
        return -1;
    }
    for (char **k = kwlist; *k; k++) {
        PyObject *v = PyDict_GetItemString(overrides, *k);
        if (v && (PyDict_SetItemString(own_kw, *k, v) < 0 || PyDict_DelItemString(overrides, *k) < 0)) {
            Py_DECREF(own_kw);
            Py_DECREF(overrides);
            return -1;
        }
    }
    int parsed = PyArg_ParseTupleAndKeywords(args, own_kw, "O|$OipOO", kwlist, &config, &eos_obj, &bos, &strip,
                                             &tok_obj, &special_obj);
    Py_DECREF(own_kw); /* the parsed objects stay alive through kw and args */
    if (!parsed) {
        Py_DECREF(overrides);
        return -1;
    }
    int rc = -1;
    int32_t *eos = NULL;
    Py_ssize_t n_eos = 0, n_tok = 0;
    const char **tok_ptrs = NULL;
    size_t *tok_lens = NULL;
    uint8_t *special = NULL;
    PyObject *tok_seq = NULL;
    cv_py_engine_config pc;
    memset(&pc, 0, sizeof pc);
    cv_engine_config *cfg = &pc.cfg;
    if (self->e) { PyErr_SetString(PyExc_RuntimeError, "Engine already initialized"); goto done; }
    if (!self->busy_ready) {
        pthread_mutex_init(&self->busy, NULL);
        self->busy_ready = 1;
    }
    if (cv_py_engine_config_read(&pc, config, overrides) < 0) goto done;
    if (read_int_list(eos_obj, "eos_ids", &eos, &n_eos) < 0) goto done;
    if (tok_obj && tok_obj != Py_None) {
        /* a tuple copy: it keeps every bytes object (pointed into below) alive */
        tok_seq = PySequence_Tuple(tok_obj);
        if (!tok_seq) goto done;
        n_tok = PySequence_Fast_GET_SIZE(tok_seq);
        tok_ptrs = PyMem_Calloc((size_t)n_tok + 1, sizeof *tok_ptrs);
        tok_lens = PyMem_Calloc((size_t)n_tok + 1, sizeof *tok_lens);
        special = PyMem_Calloc((size_t)n_tok + 1, 1);
        if (!tok_ptrs || !tok_lens || !special) { PyErr_NoMemory(); goto done; }
        for (Py_ssize_t i = 0; i < n_tok; i++) {
            PyObject *b = PySequence_Fast_GET_ITEM(tok_seq, i);
            char *p;
            Py_ssize_t len;
            if (!PyBytes_Check(b) || PyBytes_AsStringAndSize(b, &p, &len) < 0) {
                PyErr_Format(PyExc_TypeError, "token_bytes[%zd] must be bytes", i);
                goto done;
            }
            tok_ptrs[i] = p;
            tok_lens[i] = (size_t)len;
        }
        if (special_obj && special_obj != Py_None) {
            int32_t *ids = NULL;
            Py_ssize_t n_ids = 0;
            if (read_int_list(special_obj, "special_ids", &ids, &n_ids) < 0) goto done;
            for (Py_ssize_t i = 0; i < n_ids; i++)
                if (ids[i] >= 0 && ids[i] < n_tok) special[ids[i]] = 1;
            PyMem_Free(ids);
        }
    }
    cfg->eos_ids = eos;
    cfg->n_eos = n_eos > INT_MAX ? INT_MAX : (int)n_eos; /* too many: refused against CV_MAX_EOS */
    cfg->bos_id = bos;
    cfg->strip_space_after_bos = strip;
    cfg->n_token_bytes = n_tok;
    cfg->token_bytes = tok_ptrs;
    cfg->token_lens = tok_lens;
    cfg->token_special = special;
    cv_err err = {0};
    cv_engine *e = NULL;
    int crc = create_interruptibly(&e, cfg, &err);
    if (crc == CV_ERR_CANCELLED && PyErr_Occurred()) goto done; /* the signal handler's error */
    if (crc) { cv_py_raise(&err); goto done; }
    self->e = e;
    self->vocab = cv_engine_vocab_size(e);
    rc = 0;
done:
    cv_py_engine_config_free(&pc);
    Py_DECREF(overrides);
    Py_XDECREF(tok_seq);
    PyMem_Free(eos);
    PyMem_Free(tok_ptrs);
    PyMem_Free(tok_lens);
    PyMem_Free(special);
    return rc;
}

static int check_open(EngineObject *self) {
    if (!self->e) {
        PyErr_SetString(cv_EngineClosedError, "the engine is closed");
        return -1;
    }
    return 0;
}

/* The prompt: any integer array-like, as int32. An int32 C-contiguous array is
 * used in place (zero-copy); anything else goes through int64 so that ids too
 * big for int32 are reported instead of wrapping. */
static PyArrayObject *read_prompt(EngineObject *self, PyObject *prompt_obj) {
    PyArrayObject *arr = NULL;
    if (PyArray_Check(prompt_obj) && !PyArray_ISINTEGER((PyArrayObject *)prompt_obj)) {
        PyErr_SetString(PyExc_TypeError, "prompt token array must have an integer dtype");
        return NULL;
    }
    if (PyArray_Check(prompt_obj) && PyArray_TYPE((PyArrayObject *)prompt_obj) == NPY_INT32)
        return (PyArrayObject *)PyArray_FROMANY(prompt_obj, NPY_INT32, 1, 1,
                                                NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED);
    /* unsigned arrays go through uint64 so that ids >= 2**63 are reported as they are */
    int is_unsigned = PyArray_Check(prompt_obj) && PyArray_ISUNSIGNED((PyArrayObject *)prompt_obj);
    PyArrayObject *wide = (PyArrayObject *)PyArray_FROMANY(prompt_obj, is_unsigned ? NPY_UINT64 : NPY_INT64,
                                                           1, 1, NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED);
    if (wide) {
        npy_intp n = PyArray_SIZE(wide);
        const int64_t *src = PyArray_DATA(wide);
        const uint64_t *usrc = PyArray_DATA(wide);
        for (npy_intp i = 0; i < n; i++)
            if (is_unsigned ? usrc[i] > INT32_MAX : (src[i] < INT32_MIN || src[i] > INT32_MAX)) {
                cv_err err = {0};
                char id[32];
                if (is_unsigned) snprintf(id, sizeof id, "%llu", (unsigned long long)usrc[i]);
                else snprintf(id, sizeof id, "%lld", (long long)src[i]);
                cv_set_field_err(&err, CV_ERR_INVALID, "prompt",
                                 "prompt token id %s is outside the vocabulary [0, %lld) (at index %lld)", id,
                                 (long long)self->vocab, (long long)i);
                Py_DECREF(wide);
                return (PyArrayObject *)cv_py_raise(&err);
            }
        arr = (PyArrayObject *)PyArray_SimpleNew(1, &n, NPY_INT32);
        if (arr) {
            int32_t *dst = PyArray_DATA(arr);
            for (npy_intp i = 0; i < n; i++) dst[i] = is_unsigned ? (int32_t)usrc[i] : (int32_t)src[i];
        }
        Py_DECREF(wide);
    }
    if (!arr && PyErr_ExceptionMatches(PyExc_OverflowError)) {
        /* an int past 64 bits: no vocabulary holds it */
        PyErr_Clear();
        cv_err err = {0};
        cv_set_field_err(&err, CV_ERR_INVALID, "prompt",
                         "a prompt token id does not fit in 64 bits: it is outside the vocabulary [0, %lld)",
                         (long long)self->vocab);
        return (PyArrayObject *)cv_py_raise(&err);
    }
    if (!arr && (!PyErr_Occurred() || PyErr_ExceptionMatches(PyExc_ValueError) ||
                 PyErr_ExceptionMatches(PyExc_TypeError))) {
        PyErr_Clear();
        PyErr_SetString(PyExc_TypeError, "prompt must be a 1-D sequence of integer token ids");
    }
    return arr;
}

/* add_request (queue != 0) or check_request: the shared argument handling. */
static PyObject *submit(EngineObject *self, int64_t req_id, PyObject *prompt_obj, PyObject *sp,
                        int priority, double timeout, int lora_slot, long long lora_id, int accepted,
                        int queue) {
    if (check_open(self) < 0) return NULL;
    PyArrayObject *arr = read_prompt(self, prompt_obj);
    if (!arr) return NULL;
    cv_py_request r;
    if (cv_py_request_read(&r, sp) < 0) { Py_DECREF(arr); return NULL; }
    r.p.priority = priority;
    r.p.timeout = timeout;
    r.p.lora_slot = lora_slot;
    r.p.lora_id = lora_id;
    r.p.accepted = accepted;
    /* Reading the prompt and the params ran Python code (attributes, __index__,
     * __float__, the GC), during which another thread may have closed the
     * engine: look again. From here on the GIL is held, so close() waits. */
    if (check_open(self) < 0) {
        cv_py_request_free(&r);
        Py_DECREF(arr);
        return NULL;
    }
    cv_err err = {0};
    const int32_t *ids = (const int32_t *)PyArray_DATA(arr);
    int rc = queue ? cv_engine_add_request(self->e, req_id, ids, PyArray_SIZE(arr), &r.p, &err)
                   : cv_engine_check_request(self->e, ids, PyArray_SIZE(arr), &r.p, &err);
    cv_py_request_free(&r);
    Py_DECREF(arr);
    if (rc) return cv_py_raise(&err);
    Py_RETURN_NONE;
}

static PyObject *Engine_add_request(EngineObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"request_id", "prompt", "params", "priority", "timeout", "lora_slot", "lora_id",
                             "accepted", NULL};
    long long req_id, lora_id = 0;
    PyObject *prompt_obj, *sp;
    int priority = 0, lora_slot = -1, accepted = 0;
    double timeout = 0.0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "LOO|$idiLp", kwlist, &req_id, &prompt_obj, &sp, &priority,
                                     &timeout, &lora_slot, &lora_id, &accepted))
        return NULL;
    return submit(self, req_id, prompt_obj, sp, priority, timeout, lora_slot, lora_id, accepted, 1);
}

static PyObject *Engine_check_request(EngineObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"prompt", "params", "timeout", NULL};
    PyObject *prompt_obj, *sp;
    double timeout = 0.0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|$d", kwlist, &prompt_obj, &sp, &timeout)) return NULL;
    return submit(self, 0, prompt_obj, sp, 0, timeout, -1, 0, 0, 0);
}

static PyObject *Engine_abort(EngineObject *self, PyObject *arg) {
    long long id = PyLong_AsLongLong(arg); /* may run __index__: the open check comes after */
    if (id == -1 && PyErr_Occurred()) return NULL;
    if (check_open(self) < 0) return NULL;
    if (cv_engine_abort(self->e, id)) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* Guided decoding: set_token_mask(request_id, seq_index, pos, mask or None). */
static PyObject *Engine_set_token_mask(EngineObject *self, PyObject *args) {
    long long req_id, pos;
    int seq_index;
    PyObject *mask_obj;
    if (!PyArg_ParseTuple(args, "LiLO", &req_id, &seq_index, &pos, &mask_obj)) return NULL;
    if (check_open(self) < 0) return NULL;
    int rc;
    if (mask_obj == Py_None) {
        rc = cv_engine_set_token_mask(self->e, req_id, seq_index, pos, NULL);
    } else {
        Py_buffer view;
        if (PyObject_GetBuffer(mask_obj, &view, PyBUF_C_CONTIGUOUS) < 0) return NULL;
        if (check_open(self) < 0) { /* the buffer export may have run Python code */
            PyBuffer_Release(&view);
            return NULL;
        }
        int64_t words = cv_engine_token_mask_words(self->e);
        if (view.len != (Py_ssize_t)(words * 4)) {
            PyBuffer_Release(&view);
            return PyErr_Format(PyExc_ValueError, "a token mask is %lld uint32 words (%lld bytes), got %zd bytes",
                                (long long)words, (long long)(words * 4), view.len);
        }
        rc = cv_engine_set_token_mask(self->e, req_id, seq_index, pos, (const uint32_t *)view.buf);
        PyBuffer_Release(&view);
    }
    return PyBool_FromLong(rc == CV_OK);
}

static PyObject *Engine_token_mask_words(EngineObject *self, PyObject *Py_UNUSED(ignored)) {
    if (check_open(self) < 0) return NULL;
    return PyLong_FromLongLong(cv_engine_token_mask_words(self->e));
}

static PyObject *Engine_step(EngineObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"wait_masks", NULL};
    int wait_masks = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|$p", kwlist, &wait_masks)) return NULL;
    if (check_open(self) < 0) return NULL;
    cv_err err = {0};
    int rc = 0, detached = 0;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&self->busy);
    /* close() may have detached the engine while this thread waited */
    cv_engine *e = self->e; /* close() may clear self->e meanwhile; it waits for busy to free e */
    if (e) {
        rc = cv_engine_set_mask_wait(e, wait_masks, &err);
        if (rc == CV_OK) {
            rc = cv_engine_step(e, &err);
            cv_engine_set_mask_wait(e, 0, NULL);
        }
    } else {
        detached = 1;
    }
    pthread_mutex_unlock(&self->busy);
    Py_END_ALLOW_THREADS
    if (detached) return (void)check_open(self), NULL;
    if (rc < 0) return cv_py_raise(&err);
    return PyLong_FromLong(rc);
}

static const char *reason_name(int r) {
    switch (r) {
    case CV_FINISH_STOP: return "stop";
    case CV_FINISH_LENGTH: return "length";
    case CV_FINISH_ABORT: return "abort";
    case CV_FINISH_TIMEOUT: return "timeout";
    case CV_FINISH_NO_TOKEN: return "error";
    default: return NULL;
    }
}

/* Named records for the engine's outputs (heap types made at module init). */
static PyTypeObject *EventType, *EventMetricsType;

static PyStructSequence_Field event_fields[] = {
    {"request_id", "the engine's request id (int)"},
    {"seq_index", "completion index in [0, n)"},
    {"token", "the sampled token, -1 when none (abort)"},
    {"logprob", "log-probability of the sampled token"},
    {"top_logprobs", "[(token id, logprob)] of the most likely tokens, or None"},
    {"text", "newly visible UTF-8 bytes"},
    {"finished", "this completion is done"},
    {"finish_reason", "'stop', 'length', 'abort' or None"},
    {"stop_kind", "STOP_NONE, STOP_TOKEN or STOP_STRING"},
    {"stop_value", "the stop token id, or the stop string's index"},
    {"metrics", "an EngineEventMetrics when the whole request finished, else None"},
    {"prompt_pos", "> 0: a prompt-logprob event for the prompt token at this position"},
    {"rank", "the token's rank under the raw logits (1: the most likely), or None without logprobs"},
    {NULL, NULL}};
static PyStructSequence_Desc event_desc = {"conveyor._core.EngineEvent",
                                           "One output of one step for one completion.", event_fields, 13};

static PyStructSequence_Field metrics_fields[] = {
    {"arrival", "time.monotonic() when the request was queued"},
    {"first_scheduled", "when it first ran (0: never)"},
    {"first_token", "when its first token was sampled (0: never)"},
    {"finished", "when it finished"},
    {"n_prompt", "prompt tokens"},
    {"n_cached_prompt", "prompt tokens found in the prefix cache"},
    {NULL, NULL}};
static PyStructSequence_Desc metrics_desc = {"conveyor._core.EngineEventMetrics",
                                             "Timings of a finished request.", metrics_fields, 6};

/* Sets item i of a struct sequence, taking the reference (NULL -> error). */
static int set_item(PyObject *rec, Py_ssize_t i, PyObject *v) {
    if (!v) return -1;
    PyStructSequence_SetItem(rec, i, v);
    return 0;
}

static PyObject *make_top(const cv_event *v) {
    if (v->n_top <= 0) Py_RETURN_NONE;
    PyObject *top = PyList_New(v->n_top);
    if (!top) return NULL;
    for (int k = 0; k < v->n_top; k++) {
        PyObject *pair = Py_BuildValue("(if)", v->top_ids[k], (double)v->top_logprobs[k]);
        if (!pair) { Py_DECREF(top); return NULL; }
        PyList_SET_ITEM(top, k, pair);
    }
    return top;
}

static PyObject *make_metrics(const cv_event *v) {
    if (!v->request_finished) Py_RETURN_NONE;
    PyObject *m = PyStructSequence_New(EventMetricsType);
    if (!m) return NULL;
    if (set_item(m, 0, PyFloat_FromDouble(v->arrival)) || set_item(m, 1, PyFloat_FromDouble(v->first_scheduled)) ||
        set_item(m, 2, PyFloat_FromDouble(v->first_token)) || set_item(m, 3, PyFloat_FromDouble(v->finished_time)) ||
        set_item(m, 4, PyLong_FromLongLong(v->n_prompt)) || set_item(m, 5, PyLong_FromLongLong(v->n_cached_prompt))) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

static PyObject *make_event(const cv_event *v, const char *text) {
    PyObject *e = PyStructSequence_New(EventType);
    if (!e) return NULL;
    const char *reason = reason_name(v->finish_reason);
    if (set_item(e, 0, PyLong_FromLongLong(v->request_id)) || set_item(e, 1, PyLong_FromLong(v->seq_index)) ||
        set_item(e, 2, PyLong_FromLong(v->token)) || set_item(e, 3, PyFloat_FromDouble((double)v->logprob)) ||
        set_item(e, 4, make_top(v)) ||
        set_item(e, 5, PyBytes_FromStringAndSize(text ? text + v->text_off : "", (Py_ssize_t)v->text_len)) ||
        set_item(e, 6, PyBool_FromLong(v->finished)) ||
        set_item(e, 7, reason ? PyUnicode_FromString(reason) : Py_NewRef(Py_None)) ||
        set_item(e, 8, PyLong_FromLong(v->stop_kind)) || set_item(e, 9, PyLong_FromLong(v->stop_value)) ||
        set_item(e, 10, make_metrics(v)) || set_item(e, 11, PyLong_FromLongLong(v->prompt_pos)) ||
        set_item(e, 12, v->rank > 0 ? PyLong_FromLongLong(v->rank) : Py_NewRef(Py_None))) {
        Py_DECREF(e);
        return NULL;
    }
    return e;
}

static PyObject *Engine_take_outputs(EngineObject *self, PyObject *Py_UNUSED(ignored)) {
    if (check_open(self) < 0) return NULL;
    cv_event *ev = NULL;
    char *text = NULL;
    size_t n = cv_engine_take_events(self->e, &ev, &text);
    PyObject *list = PyList_New((Py_ssize_t)n);
    if (!list) goto done;
    for (size_t i = 0; i < n; i++) {
        PyObject *item = make_event(&ev[i], text);
        if (!item) { Py_CLEAR(list); goto done; }
        PyList_SET_ITEM(list, (Py_ssize_t)i, item);
    }
done:
    free(ev);
    free(text);
    return list;
}

static PyObject *Engine_num_queued(EngineObject *self, PyObject *Py_UNUSED(ignored)) {
    if (check_open(self) < 0) return NULL;
    return PyLong_FromLongLong(cv_engine_num_queued(self->e));
}

static PyObject *Engine_num_unfinished(EngineObject *self, PyObject *Py_UNUSED(ignored)) {
    if (check_open(self) < 0) return NULL;
    return PyLong_FromLongLong(cv_engine_num_unfinished(self->e));
}

static PyObject *Engine_start_loop(EngineObject *self, PyObject *arg) {
    if (check_open(self) < 0) return NULL;
    int fd = (int)PyLong_AsLong(arg);
    if (fd == -1 && PyErr_Occurred()) return NULL;
    cv_err err = {0};
    int rc = CV_OK;
    /* busy: not while step() runs on another thread, whose loop check passed */
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&self->busy);
    if (self->e) rc = cv_engine_start_loop(self->e, fd, &err);
    pthread_mutex_unlock(&self->busy);
    Py_END_ALLOW_THREADS
    if (check_open(self) < 0) return NULL;
    if (rc) return cv_py_raise(&err);
    Py_RETURN_NONE;
}

static PyObject *Engine_stop_loop(EngineObject *self, PyObject *Py_UNUSED(ignored)) {
    if (!self->e) Py_RETURN_NONE;
    /* busy: one owner call at a time (two stops must not join one thread) */
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&self->busy);
    if (self->e) cv_engine_stop_loop(self->e);
    pthread_mutex_unlock(&self->busy);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *Engine_loop_error(EngineObject *self, PyObject *Py_UNUSED(ignored)) {
    if (check_open(self) < 0) return NULL;
    cv_err err = {0};
    if (cv_engine_loop_error(self->e, &err)) return PyUnicode_FromString(err.msg);
    Py_RETURN_NONE;
}

static PyObject *Engine_close(EngineObject *self, PyObject *Py_UNUSED(ignored)) {
    engine_close(self);
    Py_RETURN_NONE;
}

static PyObject *Engine_stats(EngineObject *self, PyObject *Py_UNUSED(ignored)) {
    if (check_open(self) < 0) return NULL;
    cv_engine_stats st;
    cv_engine_get_stats(self->e, &st);
    PyObject *d = PyDict_New();
    if (!d) return NULL;
    PyObject *prop_at = PyList_New(CV_SPEC_MAX_TOKENS), *acc_at = PyList_New(CV_SPEC_MAX_TOKENS);
    if (!prop_at || !acc_at) goto fail;
    for (int i = 0; i < CV_SPEC_MAX_TOKENS; i++) {
        PyObject *a = PyLong_FromLongLong(st.spec_proposed_at[i]), *b = PyLong_FromLongLong(st.spec_accepted_at[i]);
        if (!a || !b) { Py_XDECREF(a); Py_XDECREF(b); goto fail; }
        PyList_SET_ITEM(prop_at, i, a);
        PyList_SET_ITEM(acc_at, i, b);
    }
    int put_rc = cv_py_put(d, "spec_proposed_at", prop_at); /* takes the reference */
    prop_at = NULL;
    if (put_rc < 0) goto fail;
    put_rc = cv_py_put(d, "spec_accepted_at", acc_at);
    acc_at = NULL;
    if (put_rc < 0) goto fail;
    if (cv_py_put(d, "spec_proposed", PyLong_FromLongLong(st.spec_proposed)) < 0 ||
        cv_py_put(d, "spec_accepted", PyLong_FromLongLong(st.spec_accepted)) < 0 ||
        cv_py_put(d, "spec_steps_disabled", PyLong_FromLongLong(st.spec_steps_disabled)) < 0 ||
        cv_py_put(d, "spec_draft_tokens", PyLong_FromLongLong(st.spec_draft_tokens)) < 0 ||
        cv_py_put(d, "spec_draft_blocks_used", PyLong_FromLongLong(st.spec_draft_blocks_used)) < 0)
        goto fail;
    if (cv_py_put(d, "num_running", PyLong_FromLongLong(st.sched.n_running)) < 0 ||
        cv_py_put(d, "num_waiting", PyLong_FromLongLong(st.sched.n_waiting)) < 0 ||
        cv_py_put(d, "num_preemptions", PyLong_FromLongLong(st.sched.n_preempted_total)) < 0 ||
        cv_py_put(d, "num_recomputed_tokens", PyLong_FromLongLong(st.sched.n_recomputed_tokens)) < 0 ||
        cv_py_put(d, "num_resumed_tokens", PyLong_FromLongLong(st.sched.n_resumed_tokens)) < 0 ||
        cv_py_put(d, "running_target", PyLong_FromLongLong(st.sched.running_target)) < 0 ||
        cv_py_put(d, "num_held_back_steps", PyLong_FromLongLong(st.sched.n_limited_steps)) < 0 ||
        cv_py_put(d, "blocks_total", PyLong_FromLongLong(st.sched.blocks_total)) < 0 ||
        cv_py_put(d, "blocks_used", PyLong_FromLongLong(st.sched.blocks_used)) < 0 ||
        cv_py_put(d, "blocks_free", PyLong_FromLongLong(st.sched.blocks_free)) < 0 ||
        cv_py_put(d, "blocks_cached_free", PyLong_FromLongLong(st.sched.blocks_cached_free)) < 0 ||
        cv_py_put(d, "blocks_touched", PyLong_FromLongLong(st.sched.blocks_touched)) < 0 ||
        cv_py_put(d, "tokens_in_kv", PyLong_FromLongLong(st.sched.tokens_in_kv)) < 0 ||
        cv_py_put(d, "kv_waste", PyFloat_FromDouble(st.sched.kv_waste)) < 0 ||
        cv_py_put(d, "prefix_queries", PyLong_FromLongLong(st.sched.prefix_queries)) < 0 ||
        cv_py_put(d, "prefix_hits", PyLong_FromLongLong(st.sched.prefix_hits)) < 0 ||
        cv_py_put(d, "num_blocks", PyLong_FromLongLong(st.num_blocks)) < 0 ||
        cv_py_put(d, "block_size", PyLong_FromLongLong(st.block_size)) < 0 ||
        cv_py_put(d, "max_model_len", PyLong_FromLongLong(st.max_model_len)) < 0 ||
        cv_py_put(d, "request_room", PyLong_FromLongLong(st.request_room)) < 0 ||
        cv_py_put(d, "max_num_seqs", PyLong_FromLongLong(st.max_num_seqs)) < 0 ||
        cv_py_put(d, "max_num_batched_tokens", PyLong_FromLongLong(st.max_num_batched_tokens)) < 0 ||
        cv_py_put(d, "kv_cache_bytes", PyLong_FromSize_t(st.kv_cache_bytes)) < 0 ||
        cv_py_put(d, "prompt_tokens", PyLong_FromLongLong(st.prompt_tokens_computed)) < 0 ||
        cv_py_put(d, "generation_tokens", PyLong_FromLongLong(st.generation_tokens)) < 0 ||
        cv_py_put(d, "requests_finished", PyLong_FromLongLong(st.requests_finished)) < 0 ||
        cv_py_put(d, "requests_aborted", PyLong_FromLongLong(st.requests_aborted)) < 0 ||
        cv_py_put(d, "requests_timed_out", PyLong_FromLongLong(st.requests_timed_out)) < 0 ||
        cv_py_put(d, "requests_rejected", PyLong_FromLongLong(st.requests_rejected)) < 0 ||
        cv_py_put(d, "num_queued", PyLong_FromLongLong(st.num_queued)) < 0 ||
        cv_py_put(d, "steps", PyLong_FromLongLong(st.steps)) < 0 ||
        cv_py_put(d, "time_schedule", PyFloat_FromDouble(st.time_schedule)) < 0 ||
        cv_py_put(d, "time_build", PyFloat_FromDouble(st.time_build)) < 0 ||
        cv_py_put(d, "time_forward", PyFloat_FromDouble(st.time_forward)) < 0 ||
        cv_py_put(d, "time_sample", PyFloat_FromDouble(st.time_sample)) < 0 ||
        cv_py_put(d, "time_step", PyFloat_FromDouble(st.time_step)) < 0 ||
        cv_py_put(d, "time_propose", PyFloat_FromDouble(st.time_propose)) < 0)
        goto fail;
    return d;
fail:
    Py_XDECREF(prop_at);
    Py_XDECREF(acc_at);
    Py_DECREF(d);
    return NULL;
}

static PyObject *Engine_check_invariants(EngineObject *self, PyObject *Py_UNUSED(ignored)) {
    if (check_open(self) < 0) return NULL;
    cv_err err = {0};
    if (cv_engine_check_invariants(self->e, &err)) return cv_py_raise(&err);
    Py_RETURN_NONE;
}

static PyObject *Engine_model_config(EngineObject *self, PyObject *Py_UNUSED(ignored)) {
    if (check_open(self) < 0) return NULL;
    const cv_model_config *c = cv_engine_model_config(self->e);
    size_t wbytes;
    int64_t nparams;
    cv_dtype wdt, kvdt;
    cv_engine_weight_info(self->e, &wbytes, &nparams, &wdt, &kvdt);
    const cv_dtype ldt = cv_engine_lora_dtype(self->e); /* None where LoRA is off */
    PyObject *d = PyDict_New();
    if (!d) return NULL;
    if (cv_py_put_model_dims(d, c) < 0 ||
        cv_py_put(d, "bos_id", PyLong_FromLong(c->bos_id)) < 0 ||
        cv_py_put(d, "tie_embeddings", PyBool_FromLong(c->tie_embeddings)) < 0 ||
        cv_py_put(d, "rope_theta", PyFloat_FromDouble(c->rope_theta)) < 0 ||
        cv_py_put(d, "weight_bytes", PyLong_FromSize_t(wbytes)) < 0 ||
        cv_py_put(d, "n_params", PyLong_FromLongLong(nparams)) < 0 ||
        cv_py_put(d, "dtype", PyUnicode_FromString(cv_dtype_name(wdt))) < 0 ||
        cv_py_put(d, "kv_cache_dtype", PyUnicode_FromString(cv_dtype_name(kvdt))) < 0 ||
        cv_py_put(d, "embed_bytes", PyLong_FromSize_t(cv_engine_embed_bytes(self->e))) < 0 ||
        cv_py_put(d, "matrix_dtype", PyUnicode_FromString(cv_dtype_name(cv_engine_matrix_dtype(self->e)))) < 0 ||
        cv_py_put(d, "lm_head_dtype", PyUnicode_FromString(cv_dtype_name(cv_engine_lm_head_dtype(self->e)))) < 0 ||
        cv_py_put(d, "lora_dtype",
                  ldt == CV_DTYPE_INVALID ? Py_NewRef(Py_None) : PyUnicode_FromString(cv_dtype_name(ldt))) < 0 ||
        cv_py_put(d, "eos_ids", cv_py_int32_list(c->eos_ids, c->n_eos)) < 0) {
        Py_DECREF(d);
        return NULL;
    }
    return d;
}

static PyObject *Engine_set_trace(EngineObject *self, PyObject *arg) {
    int on = PyObject_IsTrue(arg); /* may run __bool__: the open check comes after */
    if (on < 0) return NULL;
    if (check_open(self) < 0) return NULL;
    cv_engine_set_trace(self->e, on);
    Py_RETURN_NONE;
}

static PyObject *Engine_take_trace(EngineObject *self, PyObject *Py_UNUSED(ignored)) {
    if (check_open(self) < 0) return NULL;
    cv_trace_entry *t = NULL;
    size_t n = cv_engine_take_trace(self->e, &t);
    PyObject *list = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; list && i < n; i++) {
        PyObject *item = Py_BuildValue("(LddLiii)", (long long)t[i].step, t[i].t0, t[i].t1,
                                       (long long)t[i].request_id, t[i].seq_index, t[i].n_new,
                                       t[i].n_prompt_work);
        if (!item) { Py_CLEAR(list); break; }
        PyList_SET_ITEM(list, (Py_ssize_t)i, item);
    }
    free(t);
    return list;
}

static PyObject *Engine_lora_load(EngineObject *self, PyObject *args) {
    if (check_open(self) < 0) return NULL;
    return cv_py_lora_load(self->e, args);
}

static PyObject *Engine_lora_unload(EngineObject *self, PyObject *args) {
    if (check_open(self) < 0) return NULL;
    return cv_py_lora_unload(self->e, args);
}

static PyMethodDef Engine_methods[] = {
    {"lora_load", (PyCFunction)Engine_lora_load, METH_VARARGS,
     "lora_load(slot, scale, pairs)\n\nLoads a LoRA adapter into slot: pairs is a list of (layer, module, A, B), "
     "module an index into (q, k, v, o, gate, up, down), A [rank][in] and B [out][rank] float32."},
    {"lora_unload", (PyCFunction)Engine_lora_unload, METH_VARARGS, "lora_unload(slot)\n\nEmpties a LoRA slot."},
    {"add_request", (PyCFunction)(void (*)(void))Engine_add_request, METH_VARARGS | METH_KEYWORDS,
     "add_request(request_id, prompt, params, *, priority=0, timeout=0.0, lora_slot=-1, lora_id=0, "
     "accepted=False)\n\nValidates (as check_request) and queues a request; params is a SamplingParams; "
     "timeout: seconds from arrival (0: none). EngineOverloadedError when max_queued_requests requests "
     "wait, unless accepted (the caller accepted it earlier and held it)."},
    {"check_request", (PyCFunction)(void (*)(void))Engine_check_request, METH_VARARGS | METH_KEYWORDS,
     "check_request(prompt, params, *, timeout=0.0)\n\nRaises what add_request would raise for this prompt and "
     "SamplingParams (ValueError/TypeError with .field), queueing nothing."},
    {"abort", (PyCFunction)Engine_abort, METH_O, "Aborts a request by id."},
    {"set_token_mask", (PyCFunction)Engine_set_token_mask, METH_VARARGS,
     "set_token_mask(request_id, seq_index, pos, mask)\n\nGuided decoding: posts the allowed-token "
     "bitmask (uint32 words, bit t = token t) for output position pos of a guided completion; None ends "
     "that completion (aborted). Returns False when no such guided completion is live."},
    {"token_mask_words", (PyCFunction)Engine_token_mask_words, METH_NOARGS, "uint32 words per token mask."},
    {"step", (PyCFunction)(void (*)(void))Engine_step, METH_VARARGS | METH_KEYWORDS,
     "step(*, wait_masks=False)\n\nRuns one engine step (GIL released). wait_masks: guided completions "
     "wait for masks another thread is posting (as under the background loop)."},
    {"take_outputs", (PyCFunction)Engine_take_outputs, METH_NOARGS, "Takes the pending outputs."},
    {"num_unfinished", (PyCFunction)Engine_num_unfinished, METH_NOARGS, "Requests not finished."},
    {"num_queued", (PyCFunction)Engine_num_queued, METH_NOARGS,
     "Requests added and not yet scheduled (what max_queued_requests bounds)."},
    {"start_loop", (PyCFunction)Engine_start_loop, METH_O, "Starts the background loop."},
    {"stop_loop", (PyCFunction)Engine_stop_loop, METH_NOARGS, "Stops the background loop."},
    {"loop_error", (PyCFunction)Engine_loop_error, METH_NOARGS, "Last background failure."},
    {"close", (PyCFunction)Engine_close, METH_NOARGS, "Frees the engine."},
    {"stats", (PyCFunction)Engine_stats, METH_NOARGS, "Engine statistics."},
    {"check_invariants", (PyCFunction)Engine_check_invariants, METH_NOARGS,
     "For tests: raises when a scheduler or KV block pool invariant is broken."},
    {"model_config", (PyCFunction)Engine_model_config, METH_NOARGS, "The model's config."},
    {"set_trace", (PyCFunction)Engine_set_trace, METH_O, "Turns the step trace on or off."},
    {"take_trace", (PyCFunction)Engine_take_trace, METH_NOARGS, "Takes the step trace: (step, t0, t1, request id, completion index, new tokens, "
     "of them prompt tokens) per scheduled sequence."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot Engine_slots[] = {
    {Py_tp_doc, "Engine(config, /, *, eos_ids=None, bos_id=-1, strip_space_after_bos=False, token_bytes=None, "
                "special_ids=None, **overrides)\n\nThe C engine. config is an EngineArgs (read by attribute "
                "name) or a model path; any other keyword overrides the config field it names. The C engine "
                "checks every range and names the field at fault in the error's .field."},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_init, Engine_init},
    {Py_tp_dealloc, Engine_dealloc},
    {Py_tp_methods, Engine_methods},
    {0, NULL},
};

static PyType_Spec Engine_spec = {
    .name = "conveyor._core.Engine",
    .basicsize = sizeof(EngineObject),
    .flags = CV_PY_TYPE_FLAGS,
    .slots = Engine_slots,
};

static PyObject *py_kv_bytes_per_token(PyObject *Py_UNUSED(m), PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"n_layers", "n_kv_heads", "head_dim", "dtype", NULL};
    long long n_layers, n_kv_heads, head_dim;
    const char *dtype_s;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "LLLs", kwlist, &n_layers, &n_kv_heads, &head_dim, &dtype_s))
        return NULL;
    if (n_layers < 1 || n_kv_heads < 1 || head_dim < 1) {
        PyErr_SetString(PyExc_ValueError, "n_layers, n_kv_heads and head_dim must be >= 1");
        return NULL;
    }
    cv_dtype dt;
    if (cv_py_parse_kv_dtype(dtype_s, "dtype", 0, &dt) < 0) return NULL;
    return PyLong_FromSize_t(cv_kv_bytes_per_token(n_layers, n_kv_heads, head_dim, dt));
}

static PyMethodDef engine_functions[] = {
    {"kv_bytes_per_token", (PyCFunction)(void (*)(void))py_kv_bytes_per_token, METH_VARARGS | METH_KEYWORDS,
     "kv_bytes_per_token(n_layers, n_kv_heads, head_dim, dtype)\n\nK and V bytes one token takes in "
     "the engine's KV cache (the engine's own formula)."},
    {NULL, NULL, 0, NULL}};

int cv_py_add_engine(PyObject *m) {
    if (PyModule_AddFunctions(m, engine_functions) < 0) return -1;
    if (!EventType && !(EventType = PyStructSequence_NewType(&event_desc))) return -1;
    if (!EventMetricsType && !(EventMetricsType = PyStructSequence_NewType(&metrics_desc))) return -1;
    if (PyModule_AddObjectRef(m, "EngineEvent", (PyObject *)EventType) < 0 ||
        PyModule_AddObjectRef(m, "EngineEventMetrics", (PyObject *)EventMetricsType) < 0)
        return -1;
    /* the C enums, so Python never mirrors their values */
    if (PyModule_AddIntConstant(m, "STOP_NONE", CV_STOP_NONE) < 0 ||
        PyModule_AddIntConstant(m, "STOP_TOKEN", CV_STOP_TOKEN) < 0 ||
        PyModule_AddIntConstant(m, "STOP_STRING", CV_STOP_STRING) < 0 ||
        PyModule_AddIntConstant(m, "FINISH_NONE", CV_FINISH_NONE) < 0 ||
        PyModule_AddIntConstant(m, "FINISH_STOP", CV_FINISH_STOP) < 0 ||
        PyModule_AddIntConstant(m, "FINISH_LENGTH", CV_FINISH_LENGTH) < 0 ||
        PyModule_AddIntConstant(m, "FINISH_ABORT", CV_FINISH_ABORT) < 0 ||
        PyModule_AddIntConstant(m, "DEFAULT_PREFILL_CAP_CPU", CV_DEFAULT_PREFILL_CAP_CPU) < 0 ||
        PyModule_AddIntConstant(m, "DEFAULT_PREFILL_CAP_CUDA", CV_DEFAULT_PREFILL_CAP_CUDA) < 0)
        return -1;
    return cv_py_add_type(m, &Engine_spec);
}
