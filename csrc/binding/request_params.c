/* Reads a SamplingParams (any object with its attribute names) into a
 * cv_request_params. Only type conversion happens here: every range is the C
 * engine's to check (cv_request_params_check, cv_engine_check_request). */
#include "request_params.h"

#include <float.h>
#include <math.h>
#include <string.h>

#include "../core/engine.h"

/* Raises exc_type with `field` set on the exception. */
static int field_error(PyObject *exc_type, const char *field, const char *msg) {
    cv_err err = {0};
    err.code = exc_type == PyExc_TypeError ? CV_ERR_TYPE : CV_ERR_INVALID;
    snprintf(err.field, sizeof err.field, "%s", field);
    snprintf(err.msg, sizeof err.msg, "%s", msg);
    cv_py_raise(&err);
    return -1;
}

static PyObject *get_attr(PyObject *obj, const char *name) {
    return PyObject_GetAttrString(obj, name);
}

/* A tuple copy of a sequence: what it holds cannot change while it is read
 * (a caller's list could, through any Python code a conversion or the GC
 * runs). A non-iterable raises TypeError(msg). */
static PyObject *snapshot(PyObject *v, const char *msg) {
    PyObject *t = PySequence_Tuple(v);
    if (!t && PyErr_ExceptionMatches(PyExc_TypeError)) {
        PyErr_Clear();
        PyErr_SetString(PyExc_TypeError, msg);
    }
    return t;
}

/* An int attribute within [lo, hi] (the C type's range; lo itself may be a
 * reserved "unset" value, so it is excluded). None -> none_value. */
static int get_int(PyObject *obj, const char *name, long long lo, long long hi, long long none_value,
                   long long *out) {
    PyObject *v = get_attr(obj, name);
    if (!v) return -1;
    if (v == Py_None) { Py_DECREF(v); *out = none_value; return 0; }
    if (!PyLong_Check(v) || PyBool_Check(v)) {
        Py_DECREF(v);
        char msg[96];
        snprintf(msg, sizeof msg, "%s must be an int", name);
        return field_error(PyExc_TypeError, name, msg);
    }
    int overflow = 0;
    long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    Py_DECREF(v);
    if (x == -1 && PyErr_Occurred()) return -1;
    if (overflow || x <= lo || x > hi) {
        char msg[128];
        snprintf(msg, sizeof msg, "%s is out of range (it must fit in %d bits)", name,
                 hi > INT32_MAX ? 64 : 32);
        return field_error(PyExc_ValueError, name, msg);
    }
    *out = x;
    return 0;
}

static int get_float(PyObject *obj, const char *name, float *out) {
    PyObject *v = get_attr(obj, name);
    if (!v) return -1;
    double d = PyFloat_AsDouble(v);
    Py_DECREF(v);
    if (d == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        char msg[96];
        snprintf(msg, sizeof msg, "%s must be a number", name);
        return field_error(PyExc_TypeError, name, msg);
    }
    /* beyond float range -> inf, which the range check rejects; a nonzero value below
     * float's smallest keeps its sign as that smallest, so top_p=1e-300 stays > 0 */
    float f = (float)d;
    if (f == 0.0f && d != 0.0) f = copysignf(FLT_TRUE_MIN, (float)d);
    *out = f;
    return 0;
}

static int get_bool(PyObject *obj, const char *name, int *out) {
    PyObject *v = get_attr(obj, name);
    if (!v) return -1;
    int b = PyObject_IsTrue(v);
    Py_DECREF(v);
    if (b < 0) return -1;
    *out = b;
    return 0;
}

/* seed: None, or an int in [-2**63, 2**64) taken modulo 2**64. */
static int get_seed(PyObject *obj, int *has, uint64_t *out) {
    PyObject *v = get_attr(obj, "seed");
    if (!v) return -1;
    *has = 0;
    if (v == Py_None) { Py_DECREF(v); return 0; }
    if (!PyLong_Check(v) || PyBool_Check(v)) {
        Py_DECREF(v);
        return field_error(PyExc_TypeError, "seed", "seed must be an int");
    }
    int overflow = 0;
    long long s = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (!overflow) {
        *out = (uint64_t)s;
    } else if (overflow > 0) {
        unsigned long long u = PyLong_AsUnsignedLongLong(v);
        if (PyErr_Occurred()) {
            PyErr_Clear();
            Py_DECREF(v);
            return field_error(PyExc_ValueError, "seed", "seed must be in [-2**63, 2**64)");
        }
        *out = u;
    } else {
        Py_DECREF(v);
        return field_error(PyExc_ValueError, "seed", "seed must be in [-2**63, 2**64)");
    }
    Py_DECREF(v);
    *has = 1;
    return 0;
}

static int as_token_id(PyObject *t, const char *field, int32_t *out);

static int get_stop_ids(PyObject *obj, cv_py_request *r) {
    PyObject *v = get_attr(obj, "stop_token_ids");
    if (!v) return -1;
    int rc = -1;
    PyObject *seq = NULL;
    if (v == Py_None) { rc = 0; goto done; }
    seq = snapshot(v, "stop_token_ids must be a list of int");
    if (!seq) goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n > INT32_MAX) { field_error(PyExc_ValueError, "stop_token_ids", "stop_token_ids is too long"); goto done; }
    r->stop_ids = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(int32_t));
    if (!r->stop_ids) { PyErr_NoMemory(); goto done; }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *t = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyLong_Check(t) || PyBool_Check(t)) {
            field_error(PyExc_TypeError, "stop_token_ids", "stop_token_ids must contain only int");
            goto done;
        }
        if (as_token_id(t, "stop_token_ids", &r->stop_ids[i]) < 0) goto done;
    }
    r->p.n_stop_token_ids = (int)n;
    r->p.stop_token_ids = r->stop_ids;
    rc = 0;
done:
    Py_XDECREF(seq);
    Py_DECREF(v);
    return rc;
}

/* stop: the list property stop_strings (str), encoded to UTF-8 bytes. */
static int get_stops(PyObject *obj, cv_py_request *r) {
    PyObject *v = get_attr(obj, "stop_strings");
    if (!v) return -1;
    int rc = -1;
    r->stop_list = snapshot(v, "stop must be a list of str");
    Py_DECREF(v);
    if (!r->stop_list) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(r->stop_list);
    r->stop_bytes = PyList_New(n);
    r->stop_ptrs = PyMem_Calloc((size_t)n + 1, sizeof *r->stop_ptrs);
    r->stop_lens = PyMem_Calloc((size_t)n + 1, sizeof *r->stop_lens);
    if (!r->stop_bytes) goto done;
    if (!r->stop_ptrs || !r->stop_lens) { PyErr_NoMemory(); goto done; }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *s = PySequence_Fast_GET_ITEM(r->stop_list, i);
        if (!PyUnicode_Check(s)) {
            field_error(PyExc_TypeError, "stop", "stop must contain only str");
            goto done;
        }
        PyObject *b = PyUnicode_AsUTF8String(s);
        if (!b) {
            PyErr_Clear();
            field_error(PyExc_ValueError, "stop", "stop: a stop string is not valid text (a lone surrogate)");
            goto done;
        }
        PyList_SET_ITEM(r->stop_bytes, i, b);
        r->stop_ptrs[i] = PyBytes_AS_STRING(b);
        r->stop_lens[i] = (size_t)PyBytes_GET_SIZE(b);
    }
    r->p.n_stop = (int)n;
    r->p.stop = r->stop_ptrs;
    r->p.stop_lens = r->stop_lens;
    rc = 0;
done:
    return rc;
}

/* ---- logit controls ------------------------------------------------------ */

/* A Python int as int32. One beyond int32 is outside every vocabulary: it is
 * refused here, named as given (the C check sees only int32 values). */
static int as_token_id(PyObject *t, const char *field, int32_t *out) {
    if (!PyLong_Check(t) || PyBool_Check(t)) {
        char msg[96];
        snprintf(msg, sizeof msg, "%s must contain only int token ids", field);
        return field_error(PyExc_TypeError, field, msg);
    }
    int overflow = 0;
    long long x = PyLong_AsLongLongAndOverflow(t, &overflow);
    if (x == -1 && PyErr_Occurred()) return -1;
    if (overflow || x > INT32_MAX || x < INT32_MIN) {
        PyObject *s = PyObject_Str(t);
        const char *txt = s ? PyUnicode_AsUTF8(s) : NULL;
        if (!txt) PyErr_Clear();
        char msg[160];
        snprintf(msg, sizeof msg, "%s contains %.40s%s, outside the vocabulary", field, txt ? txt : "an id",
                 txt && strlen(txt) > 40 ? "..." : "");
        Py_XDECREF(s);
        return field_error(PyExc_ValueError, field, msg);
    }
    *out = (int32_t)x;
    return 0;
}

/* A list of int token ids (None: *n = -1) into a PyMem array. */
static int get_id_list(PyObject *obj, const char *name, int32_t **ids, int32_t *n) {
    PyObject *v = get_attr(obj, name);
    if (!v) return -1;
    int rc = -1;
    PyObject *seq = NULL;
    *n = -1;
    if (v == Py_None) { rc = 0; goto done; }
    char msg[96];
    snprintf(msg, sizeof msg, "%s must be a list of int", name);
    seq = snapshot(v, msg);
    if (!seq) goto done;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
    if (len > INT32_MAX / 2) { field_error(PyExc_ValueError, name, "the list is too long"); goto done; }
    *ids = PyMem_Malloc((size_t)(len ? len : 1) * sizeof(int32_t));
    if (!*ids) { PyErr_NoMemory(); goto done; }
    for (Py_ssize_t i = 0; i < len; i++)
        if (as_token_id(PySequence_Fast_GET_ITEM(seq, i), name, &(*ids)[i]) < 0) goto done;
    *n = (int32_t)len;
    rc = 0;
done:
    Py_XDECREF(seq);
    Py_DECREF(v);
    return rc;
}

/* logit_bias: None or a dict {int token id: number}. The items are copied
 * first: converting a value may run Python code (an int subclass's
 * __float__) that changes the dict, and the arrays are sized from the copy. */
static int get_logit_bias(PyObject *obj, cv_py_request *r) {
    PyObject *v = get_attr(obj, "logit_bias");
    if (!v) return -1;
    int rc = -1;
    PyObject *items = NULL;
    if (v == Py_None) { rc = 0; goto done; }
    if (!PyDict_Check(v)) { field_error(PyExc_TypeError, "logit_bias", "logit_bias must be a dict {token id: bias}"); goto done; }
    items = PyDict_Items(v);
    if (!items) goto done;
    Py_ssize_t n = PyList_GET_SIZE(items);
    if (n > INT32_MAX / 2) { field_error(PyExc_ValueError, "logit_bias", "logit_bias is too large"); goto done; }
    r->bias_ids = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(int32_t));
    r->bias_values = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(float));
    if (!r->bias_ids || !r->bias_values) { PyErr_NoMemory(); goto done; }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *pair = PyList_GET_ITEM(items, i); /* (key, value): the copy keeps both alive */
        PyObject *key = PyTuple_GET_ITEM(pair, 0), *val = PyTuple_GET_ITEM(pair, 1);
        if (as_token_id(key, "logit_bias", &r->bias_ids[i]) < 0) goto done;
        if (PyBool_Check(val) || !(PyLong_Check(val) || PyFloat_Check(val))) {
            field_error(PyExc_TypeError, "logit_bias", "logit_bias values must be numbers");
            goto done;
        }
        double d = PyFloat_AsDouble(val);
        if (d == -1.0 && PyErr_Occurred()) {
            PyErr_Clear();
            d = NAN; /* beyond double: the range check names it */
        }
        r->bias_values[i] = (float)d;
    }
    r->p.sp.ctl.n_bias = (int32_t)n;
    r->p.sp.ctl.bias_ids = r->bias_ids;
    r->p.sp.ctl.bias_values = r->bias_values;
    rc = 0;
done:
    Py_XDECREF(items);
    Py_DECREF(v);
    return rc;
}

/* bad_words arrive tokenized (the engine's tokenizer runs in Python): the
 * attribute _bad_words_token_ids, a list of lists of int, or None. The outer
 * list and every word are copied to tuples before anything is sized, so that
 * a __len__ or an iterator that changes the lists cannot make the counts stale. */
static int get_bad_words(PyObject *obj, cv_py_request *r) {
    PyObject *v = PyObject_GetAttrString(obj, "_bad_words_token_ids");
    if (!v) { PyErr_Clear(); return 0; } /* an object without it asks for none */
    int rc = -1;
    PyObject *words = NULL;
    if (v == Py_None) { rc = 0; goto done; }
    PyObject *outer = snapshot(v, "bad_words token ids must be a list of lists of int");
    if (!outer) goto done;
    Py_ssize_t n = PyTuple_GET_SIZE(outer), total = 0;
    words = PyTuple_New(n);
    if (!words) { Py_DECREF(outer); goto done; }
    for (Py_ssize_t w = 0; w < n; w++) {
        PyObject *word = snapshot(PyTuple_GET_ITEM(outer, w), "bad_words token ids must be lists of int");
        if (!word) { Py_DECREF(outer); goto done; }
        PyTuple_SET_ITEM(words, w, word);
    }
    Py_DECREF(outer);
    if (n > INT32_MAX / 4) { field_error(PyExc_ValueError, "bad_words", "bad_words is too long"); goto done; }
    for (Py_ssize_t w = 0; w < n; w++) {
        total += PyTuple_GET_SIZE(PyTuple_GET_ITEM(words, w));
        if (total > INT32_MAX / 4) { field_error(PyExc_ValueError, "bad_words", "bad_words is too long"); goto done; }
    }
    r->bad_start = PyMem_Malloc((size_t)(n + 1) * sizeof(int32_t));
    r->bad_tokens = PyMem_Malloc((size_t)(total ? total : 1) * sizeof(int32_t));
    if (!r->bad_start || !r->bad_tokens) { PyErr_NoMemory(); goto done; }
    int32_t at = 0;
    for (Py_ssize_t w = 0; w < n; w++) {
        r->bad_start[w] = at;
        PyObject *word = PyTuple_GET_ITEM(words, w);
        for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(word); j++)
            if (as_token_id(PyTuple_GET_ITEM(word, j), "bad_words", &r->bad_tokens[at++]) < 0) goto done;
    }
    r->bad_start[n] = at;
    r->p.sp.ctl.n_bad_words = (int32_t)n;
    r->p.sp.ctl.bad_word_start = r->bad_start;
    r->p.sp.ctl.bad_word_tokens = r->bad_tokens;
    rc = 0;
done:
    Py_XDECREF(words);
    Py_DECREF(v);
    return rc;
}

static int get_logit_controls(PyObject *sp, cv_py_request *r) {
    int32_t n_allowed;
    if (get_logit_bias(sp, r) < 0 || get_id_list(sp, "allowed_token_ids", &r->allowed_ids, &n_allowed) < 0 ||
        get_bad_words(sp, r) < 0)
        return -1;
    if (n_allowed >= 0) {
        r->p.sp.ctl.has_allowed = 1;
        r->p.sp.ctl.n_allowed = n_allowed;
        r->p.sp.ctl.allowed_ids = r->allowed_ids;
    }
    return 0;
}

int cv_py_request_read(cv_py_request *r, PyObject *sp) {
    memset(r, 0, sizeof *r);
    cv_sampling_params_init(&r->p.sp);
    long long n, max_tokens, min_tokens, top_k, logprobs, prompt_logprobs, best_of;
    if (get_int(sp, "n", INT32_MIN, INT32_MAX, 1, &n) < 0 ||
        get_int(sp, "max_tokens", INT64_MIN, INT64_MAX, CV_MAX_TOKENS_REST, &max_tokens) < 0 ||
        get_int(sp, "min_tokens", INT64_MIN, INT64_MAX, 0, &min_tokens) < 0 ||
        get_int(sp, "top_k", INT32_MIN, INT32_MAX, 0, &top_k) < 0 ||
        get_int(sp, "logprobs", CV_NO_LOGPROBS, INT32_MAX, CV_NO_LOGPROBS, &logprobs) < 0 ||
        get_float(sp, "temperature", &r->p.sp.temperature) < 0 ||
        get_float(sp, "top_p", &r->p.sp.top_p) < 0 ||
        get_float(sp, "min_p", &r->p.sp.min_p) < 0 ||
        get_float(sp, "repetition_penalty", &r->p.sp.repetition_penalty) < 0 ||
        get_float(sp, "presence_penalty", &r->p.sp.presence_penalty) < 0 ||
        get_float(sp, "frequency_penalty", &r->p.sp.frequency_penalty) < 0 ||
        get_seed(sp, &r->p.has_seed, &r->p.seed) < 0 ||
        get_bool(sp, "include_stop_str_in_output", &r->p.include_stop_str) < 0 ||
        get_bool(sp, "ignore_eos", &r->p.ignore_eos) < 0 ||
        get_bool(sp, "skip_special_tokens", &r->p.skip_special_tokens) < 0 ||
        get_stop_ids(sp, r) < 0 || get_stops(sp, r) < 0 ||
        get_int(sp, "prompt_logprobs", CV_NO_LOGPROBS, INT32_MAX, CV_NO_LOGPROBS, &prompt_logprobs) < 0 ||
        get_int(sp, "best_of", INT32_MIN, INT32_MAX, 0, &best_of) < 0 || get_logit_controls(sp, r) < 0) {
        cv_py_request_free(r);
        return -1;
    }
    r->p.n = (int32_t)n;
    r->p.max_tokens = max_tokens;
    r->p.min_tokens = min_tokens;
    r->p.sp.top_k = (int32_t)top_k;
    r->p.sp.n_logprobs = (int32_t)logprobs;
    /* Guided decoding: the grammar runs in Python; C only learns the request is masked. */
    PyObject *g = PyObject_HasAttrString(sp, "guided_decoding") ? get_attr(sp, "guided_decoding") : NULL;
    if (g) {
        r->p.guided = g != Py_None;
        Py_DECREF(g);
    } else if (PyErr_Occurred()) {
        cv_py_request_free(r);
        return -1;
    }
    r->p.prompt_logprobs = (int32_t)prompt_logprobs;
    r->p.best_of = (int32_t)best_of;
    return 0;
}

void cv_py_request_free(cv_py_request *r) {
    PyMem_Free(r->stop_ids);
    PyMem_Free(r->stop_ptrs);
    PyMem_Free(r->stop_lens);
    Py_XDECREF(r->stop_bytes);
    Py_XDECREF(r->stop_list);
    PyMem_Free(r->bias_ids);
    PyMem_Free(r->bias_values);
    PyMem_Free(r->allowed_ids);
    PyMem_Free(r->bad_start);
    PyMem_Free(r->bad_tokens);
    memset(r, 0, sizeof *r);
}

static PyObject *py_check_sampling_params(PyObject *Py_UNUSED(m), PyObject *sp) {
    cv_py_request r;
    if (cv_py_request_read(&r, sp) < 0) return NULL;
    cv_err err = {0};
    int rc = cv_request_params_check(&r.p, &err);
    cv_py_request_free(&r);
    if (rc) return cv_py_raise(&err);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"check_sampling_params", py_check_sampling_params, METH_O,
     "check_sampling_params(params)\n\nRaises ValueError/TypeError (with .field naming the field) when "
     "the engine would refuse these SamplingParams whatever the prompt."},
    {NULL, NULL, 0, NULL}};

int cv_py_add_request_params(PyObject *m) {
    if (PyModule_AddFunctions(m, methods) < 0) return -1;
    if (PyModule_AddIntConstant(m, "MAX_LOGPROBS", CV_MAX_LOGPROBS) < 0) return -1;
    if (PyModule_AddIntConstant(m, "MAX_BAD_WORDS", CV_MAX_BAD_WORDS) < 0) return -1;
    if (PyModule_AddIntConstant(m, "MAX_N", CV_MAX_N) < 0) return -1;
    return 0;
}
