/* conveyor._core.Engine: the engine's public C API as a Python type.
 * Python holds request ids; C owns all sequence state. */
#include "arrays.h"

#include <pthread.h>
#include <string.h>

#include "../core/engine.h"

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
    PyObject *seq = PySequence_Fast(obj, what);
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
    if (self->busy_ready) {
        engine_close(self);
        pthread_mutex_destroy(&self->busy);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int Engine_init(EngineObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"model", "dtype", "device", "num_threads", "max_model_len",
                             "max_num_seqs", "max_num_batched_tokens", "block_size",
                             "kv_cache_bytes", "gpu_memory_utilization", "kv_cache_dtype",
                             "enable_prefix_caching", "enable_chunked_prefill", "policy", "seed",
                             "eos_ids", "bos_id", "strip_space_after_bos", "token_bytes",
                             "special_ids", "max_prefill_tokens_while_decoding",
                             "max_queued_requests", NULL};
    PyObject *path_obj = NULL, *eos_obj = NULL, *tok_obj = NULL, *special_obj = NULL;
    const char *dtype_s = "auto", *device = "cpu", *kv_dtype_s = "auto", *policy = "continuous";
    int num_threads = 0, prefix = 1, chunked = 1, strip = 0, bos = -1;
    long long max_model_len = 0, max_num_seqs = 256, max_tokens = 0, block_size = 16;
    long long prefill_cap = 0, max_queued = 0;
    unsigned long long kv_bytes = 0, seed = 0;
    double gpu_util = 0.9;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O&|$ssiLLLLKdsppsKOipOOLL", kwlist,
                                     PyUnicode_FSConverter, &path_obj, &dtype_s, &device,
                                     &num_threads, &max_model_len, &max_num_seqs, &max_tokens,
                                     &block_size, &kv_bytes, &gpu_util, &kv_dtype_s, &prefix,
                                     &chunked, &policy, &seed, &eos_obj, &bos, &strip, &tok_obj,
                                     &special_obj, &prefill_cap, &max_queued))
        return -1;
    int rc = -1;
    int32_t *eos = NULL;
    Py_ssize_t n_eos = 0, n_tok = 0;
    const char **tok_ptrs = NULL;
    size_t *tok_lens = NULL;
    uint8_t *special = NULL;
    PyObject *tok_seq = NULL;
    cv_engine_config cfg;
    memset(&cfg, 0, sizeof cfg);
    if (self->e) { PyErr_SetString(PyExc_RuntimeError, "Engine already initialized"); goto done; }
    if (!self->busy_ready) {
        pthread_mutex_init(&self->busy, NULL);
        self->busy_ready = 1;
    }
    if (cv_py_parse_dtype(dtype_s, "dtype", 1, &cfg.dtype) < 0) goto done;
    if (cv_py_parse_dtype(kv_dtype_s, "kv_cache_dtype", 1, &cfg.kv_dtype) < 0) goto done;
    if (!strcmp(device, "cpu")) cfg.use_cuda = 0;
    else if (!strcmp(device, "cuda")) cfg.use_cuda = 1;
    else { PyErr_Format(PyExc_ValueError, "device must be 'cpu' or 'cuda', got '%s'", device); goto done; }
    if (!strcmp(policy, "continuous")) cfg.policy = CV_SCHED_CONTINUOUS;
    else if (!strcmp(policy, "priority")) cfg.policy = CV_SCHED_PRIORITY;
    else if (!strcmp(policy, "static")) cfg.policy = CV_SCHED_STATIC;
    else {
        PyErr_Format(PyExc_ValueError, "scheduling must be 'continuous', 'priority' or 'static', got '%s'", policy);
        goto done;
    }
    if (read_int_list(eos_obj, "eos_ids", &eos, &n_eos) < 0) goto done;
    if (tok_obj && tok_obj != Py_None) {
        tok_seq = PySequence_Fast(tok_obj, "token_bytes must be a sequence of bytes");
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
    cfg.model_path = PyBytes_AS_STRING(path_obj);
    cfg.num_threads = num_threads;
    cfg.max_model_len = max_model_len;
    cfg.max_num_seqs = max_num_seqs;
    cfg.max_num_batched_tokens = max_tokens;
    cfg.block_size = block_size;
    cfg.kv_cache_bytes = (size_t)kv_bytes;
    cfg.gpu_memory_utilization = gpu_util;
    cfg.enable_prefix_caching = prefix;
    cfg.enable_chunked_prefill = chunked;
    cfg.max_prefill_tokens_while_decoding = prefill_cap;
    cfg.max_queued_requests = max_queued;
    cfg.seed = seed;
    cfg.eos_ids = eos;
    cfg.n_eos = (int)n_eos;
    cfg.bos_id = bos;
    cfg.strip_space_after_bos = strip;
    cfg.n_token_bytes = n_tok;
    cfg.token_bytes = tok_ptrs;
    cfg.token_lens = tok_lens;
    cfg.token_special = special;
    cv_err err = {0};
    cv_engine *e = NULL;
    int crc;
    Py_BEGIN_ALLOW_THREADS
    crc = cv_engine_create(&e, &cfg, &err);
    Py_END_ALLOW_THREADS
    if (crc) { cv_py_raise(&err); goto done; }
    self->e = e;
    self->vocab = cv_engine_vocab_size(e);
    rc = 0;
done:
    Py_XDECREF(path_obj);
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

static PyObject *Engine_add_request(EngineObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"request_id", "prompt", "n", "max_tokens", "min_tokens",
                             "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                             "presence_penalty", "frequency_penalty", "seed", "stop",
                             "include_stop_str_in_output", "stop_token_ids", "ignore_eos",
                             "skip_special_tokens", "logprobs", "priority", "timeout", NULL};
    long long req_id, max_tokens = 16, min_tokens = 0;
    PyObject *prompt_obj, *seed_obj = Py_None, *stop_obj = Py_None, *stop_ids_obj = Py_None,
             *logprobs_obj = Py_None;
    int n = 1, top_k = 0, include_stop = 0, ignore_eos = 0, skip_special = 1, priority = 0;
    float temperature = 1.0f, top_p = 1.0f, min_p = 0.0f, rep = 1.0f, pres = 0.0f, freq = 0.0f;
    double timeout = 0.0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "LO|$iLLffiffffOOpOppOid", kwlist, &req_id,
                                     &prompt_obj, &n, &max_tokens, &min_tokens, &temperature,
                                     &top_p, &top_k, &min_p, &rep, &pres, &freq, &seed_obj,
                                     &stop_obj, &include_stop, &stop_ids_obj, &ignore_eos,
                                     &skip_special, &logprobs_obj, &priority, &timeout))
        return NULL;
    if (check_open(self) < 0) return NULL;
    PyObject *result = NULL;
    PyArrayObject *arr = NULL;
    PyObject *stop_seq = NULL;
    int32_t *stop_ids = NULL;
    Py_ssize_t n_stop_ids = 0, n_stop = 0;
    const char **stop_ptrs = NULL;
    size_t *stop_lens = NULL;
    cv_request_params p;
    memset(&p, 0, sizeof p);

    /* The prompt: any integer array-like. An int32 C-contiguous array is used in
     * place (zero-copy); anything else goes through int64 so that values too big
     * for int32 are reported instead of wrapping. */
    if (PyArray_Check(prompt_obj) && !PyArray_ISINTEGER((PyArrayObject *)prompt_obj)) {
        PyErr_SetString(PyExc_TypeError, "prompt token array must have an integer dtype");
        goto done;
    }
    if (PyArray_Check(prompt_obj) && PyArray_TYPE((PyArrayObject *)prompt_obj) == NPY_INT32) {
        arr = (PyArrayObject *)PyArray_FROMANY(prompt_obj, NPY_INT32, 1, 1,
                                               NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED);
    } else {
        PyArrayObject *wide = (PyArrayObject *)PyArray_FROMANY(
            prompt_obj, NPY_INT64, 1, 1, NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED);
        if (wide) {
            npy_intp n = PyArray_SIZE(wide);
            arr = (PyArrayObject *)PyArray_SimpleNew(1, &n, NPY_INT32);
            if (arr) {
                const int64_t *src = PyArray_DATA(wide);
                int32_t *dst = PyArray_DATA(arr);
                for (npy_intp i = 0; i < n; i++)
                    dst[i] = (src[i] < INT32_MIN || src[i] > INT32_MAX) ? -1 : (int32_t)src[i];
            }
            Py_DECREF(wide);
        }
    }
    if (!arr) {
        if (!PyErr_Occurred() || PyErr_ExceptionMatches(PyExc_ValueError) ||
            PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();
            PyErr_SetString(PyExc_TypeError, "prompt must be a 1-D sequence of integer token ids");
        }
        goto done;
    }
    if (read_int_list(stop_ids_obj, "stop_token_ids", &stop_ids, &n_stop_ids) < 0) goto done;
    if (stop_obj != Py_None) {
        stop_seq = PySequence_Fast(stop_obj, "stop must be a sequence of bytes");
        if (!stop_seq) goto done;
        n_stop = PySequence_Fast_GET_SIZE(stop_seq);
        stop_ptrs = PyMem_Calloc((size_t)n_stop + 1, sizeof *stop_ptrs);
        stop_lens = PyMem_Calloc((size_t)n_stop + 1, sizeof *stop_lens);
        if (!stop_ptrs || !stop_lens) { PyErr_NoMemory(); goto done; }
        for (Py_ssize_t i = 0; i < n_stop; i++) {
            PyObject *b = PySequence_Fast_GET_ITEM(stop_seq, i);
            char *s;
            Py_ssize_t len;
            if (!PyBytes_Check(b) || PyBytes_AsStringAndSize(b, &s, &len) < 0) {
                PyErr_SetString(PyExc_TypeError, "stop strings must be given as bytes");
                goto done;
            }
            stop_ptrs[i] = s;
            stop_lens[i] = (size_t)len;
        }
    }
    p.n = n;
    p.max_tokens = max_tokens;
    p.min_tokens = min_tokens;
    p.sp.temperature = temperature;
    p.sp.top_p = top_p;
    p.sp.top_k = top_k;
    p.sp.min_p = min_p;
    p.sp.repetition_penalty = rep;
    p.sp.presence_penalty = pres;
    p.sp.frequency_penalty = freq;
    p.sp.n_logprobs = -1;
    if (logprobs_obj != Py_None) {
        long lp = PyLong_AsLong(logprobs_obj);
        if (lp == -1 && PyErr_Occurred()) goto done;
        if (lp < 0 || lp > CV_MAX_LOGPROBS) {
            PyErr_Format(PyExc_ValueError, "logprobs must be in [0, %d], got %ld", CV_MAX_LOGPROBS, lp);
            goto done;
        }
        p.sp.n_logprobs = (int32_t)lp;
    }
    if (seed_obj != Py_None) {
        unsigned long long sd = PyLong_AsUnsignedLongLongMask(seed_obj);
        if (PyErr_Occurred()) goto done;
        p.has_seed = 1;
        p.seed = sd;
    }
    p.n_stop = (int)n_stop;
    p.stop = stop_ptrs;
    p.stop_lens = stop_lens;
    p.include_stop_str = include_stop;
    p.n_stop_token_ids = (int)n_stop_ids;
    p.stop_token_ids = stop_ids;
    p.ignore_eos = ignore_eos;
    p.skip_special_tokens = skip_special;
    p.priority = priority;
    p.timeout = timeout;
    cv_err err = {0};
    if (cv_engine_add_request(self->e, req_id, (const int32_t *)PyArray_DATA(arr), PyArray_SIZE(arr),
                              &p, &err)) {
        cv_py_raise(&err);
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(arr);
    Py_XDECREF(stop_seq);
    PyMem_Free(stop_ids);
    PyMem_Free(stop_ptrs);
    PyMem_Free(stop_lens);
    return result;
}

static PyObject *Engine_abort(EngineObject *self, PyObject *arg) {
    if (check_open(self) < 0) return NULL;
    long long id = PyLong_AsLongLong(arg);
    if (id == -1 && PyErr_Occurred()) return NULL;
    if (cv_engine_abort(self->e, id)) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *Engine_step(EngineObject *self, PyObject *Py_UNUSED(ignored)) {
    if (check_open(self) < 0) return NULL;
    cv_err err = {0};
    int rc = 0, detached = 0;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&self->busy);
    /* close() may have detached the engine while this thread waited */
    if (self->e) rc = cv_engine_step(self->e, &err);
    else detached = 1;
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
    default: return NULL;
    }
}

static PyObject *Engine_take_outputs(EngineObject *self, PyObject *Py_UNUSED(ignored)) {
    if (check_open(self) < 0) return NULL;
    cv_event *ev = NULL;
    char *text = NULL;
    size_t n = cv_engine_take_events(self->e, &ev, &text);
    PyObject *list = PyList_New((Py_ssize_t)n);
    if (!list) goto done;
    for (size_t i = 0; i < n; i++) {
        const cv_event *v = &ev[i];
        PyObject *top = Py_None, *metrics = Py_None, *item;
        Py_INCREF(Py_None);
        Py_INCREF(Py_None);
        if (v->n_top > 0) {
            Py_DECREF(top);
            top = PyList_New(v->n_top);
            if (!top) { Py_DECREF(metrics); Py_CLEAR(list); goto done; }
            for (int k = 0; k < v->n_top; k++) {
                PyObject *pair = Py_BuildValue("(if)", v->top_ids[k], (double)v->top_logprobs[k]);
                if (!pair) { Py_DECREF(top); Py_DECREF(metrics); Py_CLEAR(list); goto done; }
                PyList_SET_ITEM(top, k, pair);
            }
        }
        if (v->request_finished) {
            Py_DECREF(metrics);
            metrics = Py_BuildValue("(ddddLL)", v->arrival, v->first_scheduled, v->first_token,
                                    v->finished_time, (long long)v->n_prompt, (long long)v->n_cached_prompt);
            if (!metrics) { Py_DECREF(top); Py_CLEAR(list); goto done; }
        }
        const char *reason = reason_name(v->finish_reason);
        item = Py_BuildValue("(LiifNy#OziiN)", (long long)v->request_id, v->seq_index, v->token,
                             (double)v->logprob, top, text ? text + v->text_off : "",
                             (Py_ssize_t)v->text_len, v->finished ? Py_True : Py_False, reason,
                             v->stop_kind, v->stop_value, metrics);
        if (!item) { Py_CLEAR(list); goto done; }
        PyList_SET_ITEM(list, (Py_ssize_t)i, item);
    }
done:
    free(ev);
    free(text);
    return list;
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
    if (cv_engine_start_loop(self->e, fd, &err)) return cv_py_raise(&err);
    Py_RETURN_NONE;
}

static PyObject *Engine_stop_loop(EngineObject *self, PyObject *Py_UNUSED(ignored)) {
    if (!self->e) Py_RETURN_NONE;
    Py_BEGIN_ALLOW_THREADS
    cv_engine_stop_loop(self->e);
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
    if (cv_py_put(d, "num_running", PyLong_FromLongLong(st.sched.n_running)) < 0 ||
        cv_py_put(d, "num_waiting", PyLong_FromLongLong(st.sched.n_waiting)) < 0 ||
        cv_py_put(d, "num_preemptions", PyLong_FromLongLong(st.sched.n_preempted_total)) < 0 ||
        cv_py_put(d, "blocks_total", PyLong_FromLongLong(st.sched.blocks_total)) < 0 ||
        cv_py_put(d, "blocks_used", PyLong_FromLongLong(st.sched.blocks_used)) < 0 ||
        cv_py_put(d, "blocks_free", PyLong_FromLongLong(st.sched.blocks_free)) < 0 ||
        cv_py_put(d, "blocks_cached_free", PyLong_FromLongLong(st.sched.blocks_cached_free)) < 0 ||
        cv_py_put(d, "tokens_in_kv", PyLong_FromLongLong(st.sched.tokens_in_kv)) < 0 ||
        cv_py_put(d, "kv_waste", PyFloat_FromDouble(st.sched.kv_waste)) < 0 ||
        cv_py_put(d, "prefix_queries", PyLong_FromLongLong(st.sched.prefix_queries)) < 0 ||
        cv_py_put(d, "prefix_hits", PyLong_FromLongLong(st.sched.prefix_hits)) < 0 ||
        cv_py_put(d, "num_blocks", PyLong_FromLongLong(st.num_blocks)) < 0 ||
        cv_py_put(d, "block_size", PyLong_FromLongLong(st.block_size)) < 0 ||
        cv_py_put(d, "max_model_len", PyLong_FromLongLong(st.max_model_len)) < 0 ||
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
        cv_py_put(d, "time_step", PyFloat_FromDouble(st.time_step)) < 0) {
        Py_DECREF(d);
        return NULL;
    }
    return d;
}

static PyObject *Engine_model_config(EngineObject *self, PyObject *Py_UNUSED(ignored)) {
    if (check_open(self) < 0) return NULL;
    const cv_model_config *c = cv_engine_model_config(self->e);
    size_t wbytes;
    int64_t nparams;
    cv_dtype wdt, kvdt;
    cv_engine_weight_info(self->e, &wbytes, &nparams, &wdt, &kvdt);
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
        cv_py_put(d, "eos_ids", cv_py_int32_list(c->eos_ids, c->n_eos)) < 0) {
        Py_DECREF(d);
        return NULL;
    }
    return d;
}

static PyObject *Engine_set_trace(EngineObject *self, PyObject *arg) {
    if (check_open(self) < 0) return NULL;
    int on = PyObject_IsTrue(arg);
    if (on < 0) return NULL;
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

static PyMethodDef Engine_methods[] = {
    {"add_request", (PyCFunction)(void (*)(void))Engine_add_request, METH_VARARGS | METH_KEYWORDS,
     "Validates and queues a request."},
    {"abort", (PyCFunction)Engine_abort, METH_O, "Aborts a request by id."},
    {"step", (PyCFunction)Engine_step, METH_NOARGS, "Runs one engine step (GIL released)."},
    {"take_outputs", (PyCFunction)Engine_take_outputs, METH_NOARGS, "Takes the pending outputs."},
    {"num_unfinished", (PyCFunction)Engine_num_unfinished, METH_NOARGS, "Requests not finished."},
    {"start_loop", (PyCFunction)Engine_start_loop, METH_O, "Starts the background loop."},
    {"stop_loop", (PyCFunction)Engine_stop_loop, METH_NOARGS, "Stops the background loop."},
    {"loop_error", (PyCFunction)Engine_loop_error, METH_NOARGS, "Last background failure."},
    {"close", (PyCFunction)Engine_close, METH_NOARGS, "Frees the engine."},
    {"stats", (PyCFunction)Engine_stats, METH_NOARGS, "Engine statistics."},
    {"model_config", (PyCFunction)Engine_model_config, METH_NOARGS, "The model's config."},
    {"set_trace", (PyCFunction)Engine_set_trace, METH_O, "Turns the step trace on or off."},
    {"take_trace", (PyCFunction)Engine_take_trace, METH_NOARGS, "Takes the step trace: (step, t0, t1, request id, completion index, new tokens, "
     "of them prompt tokens) per scheduled sequence."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject EngineType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "conveyor._core.Engine",
    .tp_basicsize = sizeof(EngineObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The C engine.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Engine_init,
    .tp_dealloc = (destructor)Engine_dealloc,
    .tp_methods = Engine_methods,
};

int cv_py_add_engine(PyObject *m) {
    if (PyType_Ready(&EngineType) < 0) return -1;
    Py_INCREF(&EngineType);
    if (PyModule_AddObject(m, "Engine", (PyObject *)&EngineType) < 0) {
        Py_DECREF(&EngineType);
        return -1;
    }
    return 0;
}
