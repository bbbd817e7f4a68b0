/* Binding of the sampler and stop-string parts, for tests and tools:
 *   sample(logits, *, ...)           -> [(token, logprob | None, [(id, lp), ...]), ...]
 *   process_logits(logits, *, ...)   -> float32 array: the draw's log-weights
 *   rng_uint64(seed, n) / rng_uniform(seed, n): the raw per-sequence stream
 *   stop_find(stops, text, new_from) -> (index, match_start) | None
 *   stop_holdback(stops, text)       -> int
 * Every argument is checked here; the C parts see only valid input. */
#include "../binding/binding.h"

#include <string.h>

#include "../core/sampler.h"
#include "../core/stop.h"

/* Most draws one sample() call may ask for (results are held in memory). */
#define MAX_DRAWS 1000000

/* ---- argument helpers ------------------------------------------------- */

/* Copies a 1-D float32 array into a new PyMem buffer *out ([*n]). */
static int copy_logits(PyObject *obj, float **out, int64_t *n) {
    if (!PyArray_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "logits must be a numpy.ndarray of float32, got %s",
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    PyArrayObject *a = (PyArrayObject *)obj;
    if (PyArray_TYPE(a) != NPY_FLOAT32 || PyArray_ISBYTESWAPPED(a)) {
        PyErr_Format(PyExc_TypeError, "logits must have dtype float32 (native byte order), got %R",
                     (PyObject *)PyArray_DESCR(a));
        return -1;
    }
    if (PyArray_NDIM(a) != 1) {
        PyErr_Format(PyExc_ValueError, "logits must be 1-D (one vocabulary row), got %d dimensions",
                     PyArray_NDIM(a));
        return -1;
    }
    npy_intp len = PyArray_DIM(a, 0);
    if (len <= 0 || (int64_t)len > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "logits must hold 1 .. %d values, got %zd", INT32_MAX,
                     (Py_ssize_t)len);
        return -1;
    }
    float *buf = PyMem_Malloc((size_t)len * sizeof *buf);
    if (!buf) {
        PyErr_NoMemory();
        return -1;
    }
    if (PyArray_IS_C_CONTIGUOUS(a)) {
        memcpy(buf, PyArray_DATA(a), (size_t)len * sizeof *buf);
    } else {
        const char *base = PyArray_BYTES(a);
        npy_intp stride = PyArray_STRIDE(a, 0);
        for (npy_intp i = 0; i < len; i++) memcpy(&buf[i], base + i * stride, sizeof *buf);
    }
    *out = buf;
    *n = (int64_t)len;
    return 0;
}

/* Reads a sequence of token ids in [0, vocab) into a new PyMem buffer. */
static int parse_ids(PyObject *obj, const char *name, int64_t vocab, int32_t **out, int64_t *n) {
    *out = NULL;
    *n = 0;
    if (!obj || obj == Py_None) return 0;
    PyObject *seq = PySequence_Fast(obj, "");
    if (!seq) {
        PyErr_Format(PyExc_TypeError, "%s must be a sequence of ints, got %s", name,
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    int rc = -1;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
    int32_t *ids = PyMem_Malloc((size_t)(len > 0 ? len : 1) * sizeof *ids);
    if (!ids) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < len; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyIndex_Check(item)) {
            PyErr_Format(PyExc_TypeError, "%s[%zd] must be an int, got %s", name, i,
                         Py_TYPE(item)->tp_name);
            goto done;
        }
        long long v = PyLong_AsLongLong(item);
        if (v == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "%s[%zd] is out of range", name, i);
            goto done;
        }
        if (v < 0 || v >= vocab) {
            PyErr_Format(PyExc_ValueError, "%s[%zd] = %lld is not a token id in [0, %lld)", name, i,
                         v, (long long)vocab);
            goto done;
        }
        ids[i] = (int32_t)v;
    }
    *out = ids;
    *n = (int64_t)len;
    ids = NULL;
    rc = 0;
done:
    PyMem_Free(ids);
    Py_DECREF(seq);
    return rc;
}

static int parse_seed(PyObject *obj, uint64_t *seed) {
    *seed = 0;
    if (!obj) return 0;
    if (!PyIndex_Check(obj) || PyBool_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "seed must be an int, got %s", Py_TYPE(obj)->tp_name);
        return -1;
    }
    PyObject *num = PyNumber_Index(obj);
    if (!num) return -1;
    unsigned long long v = PyLong_AsUnsignedLongLong(num);
    Py_DECREF(num);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_SetString(PyExc_ValueError, "seed must be in [0, 2**64)");
        return -1;
    }
    *seed = (uint64_t)v;
    return 0;
}

/* Everything sample() and process_logits() take, parsed and checked. */
typedef struct sample_args {
    float *logits; /* [vocab] private copy of the caller's row */
    int64_t vocab;
    cv_sampling_params p;
    int32_t *prompt, *output, *banned; /* [n_prompt], [n_output], [n_banned] */
    int64_t n_prompt, n_output, n_banned;
    uint64_t seed;
    int64_t n_draws;
} sample_args;

static void free_args(sample_args *a) {
    PyMem_Free(a->logits);
    PyMem_Free(a->prompt);
    PyMem_Free(a->output);
    PyMem_Free(a->banned);
    memset(a, 0, sizeof *a);
}

/* with_draws: also accept seed, n_logprobs, n_draws (sample() only). */
static int parse_args(sample_args *a, PyObject *args, PyObject *kw, int with_draws) {
    static char *kw_sample[] = {"logits", "temperature", "top_p", "top_k", "min_p",
                                "repetition_penalty", "presence_penalty", "frequency_penalty",
                                "prompt", "output", "banned", "seed", "n_logprobs", "n_draws",
                                NULL};
    static char *kw_process[] = {"logits", "temperature", "top_p", "top_k", "min_p",
                                 "repetition_penalty", "presence_penalty", "frequency_penalty",
                                 "prompt", "output", "banned", NULL};
    PyObject *logits = NULL, *prompt = NULL, *output = NULL, *banned = NULL, *seed = NULL;
    double temperature = 1.0, top_p = 1.0, min_p = 0.0, rep = 1.0, pres = 0.0, freq = 0.0;
    long long top_k = 0, n_logprobs = -1, n_draws = 1;
    cv_err err = {0};
    memset(a, 0, sizeof *a);
    int ok = with_draws
                 ? PyArg_ParseTupleAndKeywords(args, kw, "O|$ddLddddOOOOLL:sample", kw_sample,
                                               &logits, &temperature, &top_p, &top_k, &min_p, &rep,
                                               &pres, &freq, &prompt, &output, &banned, &seed,
                                               &n_logprobs, &n_draws)
                 : PyArg_ParseTupleAndKeywords(args, kw, "O|$ddLddddOOO:process_logits",
                                               kw_process, &logits, &temperature, &top_p, &top_k,
                                               &min_p, &rep, &pres, &freq, &prompt, &output,
                                               &banned);
    if (!ok) return -1;
    if (top_k < -1 || top_k > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "top_k must be -1, 0 (off) or in [1, %d], got %lld",
                     INT32_MAX, top_k);
        return -1;
    }
    if (n_logprobs < -1 || n_logprobs > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "n_logprobs must be -1 (none) or in [0, %d], got %lld",
                     CV_MAX_LOGPROBS, n_logprobs);
        return -1;
    }
    if (n_draws < 1 || n_draws > MAX_DRAWS) {
        PyErr_Format(PyExc_ValueError, "n_draws must be in [1, %d], got %lld", MAX_DRAWS, n_draws);
        return -1;
    }
    cv_sampling_params_init(&a->p);
    /* doubles beyond float range become inf and fail the check below */
    a->p.temperature = (float)temperature;
    a->p.top_p = (float)top_p;
    a->p.min_p = (float)min_p;
    a->p.repetition_penalty = (float)rep;
    a->p.presence_penalty = (float)pres;
    a->p.frequency_penalty = (float)freq;
    a->p.top_k = (int32_t)top_k;
    a->p.n_logprobs = n_logprobs == -1 ? CV_NO_LOGPROBS : (int32_t)n_logprobs;
    if (cv_sampling_params_check(&a->p, &err) != CV_OK) {
        cv_py_raise(&err);
        return -1;
    }
    a->n_draws = n_draws;
    if (parse_seed(seed, &a->seed) < 0) goto fail;
    if (copy_logits(logits, &a->logits, &a->vocab) < 0) goto fail;
    if (parse_ids(prompt, "prompt", a->vocab, &a->prompt, &a->n_prompt) < 0 ||
        parse_ids(output, "output", a->vocab, &a->output, &a->n_output) < 0 ||
        parse_ids(banned, "banned", a->vocab, &a->banned, &a->n_banned) < 0)
        goto fail;
    return 0;
fail:
    free_args(a);
    return -1;
}

/* ---- sample / process_logits ------------------------------------------ */

static PyObject *py_sample(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    sample_args a;
    PyObject *result = NULL;
    cv_sampler *s = NULL;
    float *work = NULL;           /* [vocab] the row each draw processes */
    int32_t *tokens = NULL;       /* [n_draws] */
    cv_sample_info *infos = NULL; /* [n_draws] when logprobs are asked for */
    if (parse_args(&a, args, kw, 1) < 0) return NULL;
    const int want_lp = a.p.n_logprobs >= 0;
    work = PyMem_Malloc((size_t)a.vocab * sizeof *work);
    tokens = PyMem_Malloc((size_t)a.n_draws * sizeof *tokens);
    if (want_lp) infos = PyMem_Malloc((size_t)a.n_draws * sizeof *infos);
    s = cv_sampler_create(a.vocab);
    if (!work || !tokens || (want_lp && !infos) || !s) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    cv_rng rng;
    cv_rng_seed(&rng, a.seed);
    for (int64_t i = 0; i < a.n_draws; i++) {
        /* sampling rewrites the row, so every draw starts from the caller's logits */
        memcpy(work, a.logits, (size_t)a.vocab * sizeof *work);
        tokens[i] = cv_sampler_sample(s, work, &a.p, a.prompt, a.n_prompt, a.output, a.n_output,
                                      a.banned, a.n_banned, &rng, want_lp ? &infos[i] : NULL);
    }
    Py_END_ALLOW_THREADS
    result = PyList_New((Py_ssize_t)a.n_draws);
    if (!result) goto done;
    for (int64_t i = 0; i < a.n_draws; i++) {
        PyObject *top = PyList_New(0), *item = NULL;
        if (!top) goto fail;
        if (want_lp) {
            for (int32_t j = 0; j < infos[i].n_top; j++) {
                PyObject *pair = Py_BuildValue("(id)", (int)infos[i].top_ids[j],
                                               (double)infos[i].top_logprobs[j]);
                int bad = !pair || PyList_Append(top, pair) < 0;
                Py_XDECREF(pair);
                if (bad) {
                    Py_DECREF(top);
                    goto fail;
                }
            }
            item = Py_BuildValue("(idN)", (int)tokens[i], (double)infos[i].logprob, top);
        } else {
            item = Py_BuildValue("(iON)", (int)tokens[i], Py_None, top);
        }
        if (!item) goto fail; /* N stole top even on failure */
        PyList_SET_ITEM(result, (Py_ssize_t)i, item);
    }
    goto done;
fail:
    Py_CLEAR(result);
done:
    cv_sampler_destroy(s);
    PyMem_Free(work);
    PyMem_Free(tokens);
    PyMem_Free(infos);
    free_args(&a);
    return result;
}

static PyObject *py_process_logits(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    sample_args a;
    PyObject *result = NULL;
    cv_sampler *s = NULL;
    if (parse_args(&a, args, kw, 0) < 0) return NULL;
    s = cv_sampler_create(a.vocab);
    if (!s) {
        PyErr_NoMemory();
        goto done;
    }
    npy_intp dims[1] = {(npy_intp)a.vocab};
    result = PyArray_SimpleNew(1, dims, NPY_FLOAT32);
    if (!result) goto done;
    float *out = PyArray_DATA((PyArrayObject *)result); /* [vocab], not yet visible to anyone */
    Py_BEGIN_ALLOW_THREADS
    cv_sampler_process(s, out, a.logits, &a.p, a.prompt, a.n_prompt, a.output, a.n_output,
                       a.banned, a.n_banned);
    Py_END_ALLOW_THREADS
done:
    cv_sampler_destroy(s);
    free_args(&a);
    return result;
}

/* ---- raw random stream ------------------------------------------------ */

/* The first n outputs of the stream seed gives a sequence: raw uint64 words,
 * or (uniform) doubles in [0, 1). fmt names the function for PyArg. */
static PyObject *rng_stream(PyObject *args, PyObject *kw, const char *fmt, int uniform) {
    static char *kwlist[] = {"seed", "n", NULL};
    PyObject *seed_obj = NULL;
    uint64_t seed;
    Py_ssize_t n = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, fmt, kwlist, &seed_obj, &n)) return NULL;
    if (parse_seed(seed_obj, &seed) < 0) return NULL;
    if (n < 0 || n > 100000000) {
        PyErr_Format(PyExc_ValueError, "n must be in [0, 100000000], got %zd", n);
        return NULL;
    }
    npy_intp dims[1] = {(npy_intp)n};
    PyObject *r = PyArray_SimpleNew(1, dims, uniform ? NPY_FLOAT64 : NPY_UINT64);
    if (!r) return NULL;
    cv_rng rng;
    cv_rng_seed(&rng, seed);
    if (uniform) {
        double *out = PyArray_DATA((PyArrayObject *)r); /* [n] */
        for (Py_ssize_t i = 0; i < n; i++) out[i] = cv_rng_uniform(&rng);
    } else {
        uint64_t *out = PyArray_DATA((PyArrayObject *)r); /* [n] */
        for (Py_ssize_t i = 0; i < n; i++) out[i] = cv_rng_next(&rng);
    }
    return r;
}

static PyObject *py_rng_uint64(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    return rng_stream(args, kw, "On:rng_uint64", 0);
}

static PyObject *py_rng_uniform(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    return rng_stream(args, kw, "On:rng_uniform", 1);
}

/* The generators themselves, for checks against their published test vectors. */
static PyObject *py_splitmix64(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kwlist[] = {"seed", "n", NULL};
    PyObject *seed_obj = NULL;
    uint64_t x;
    Py_ssize_t n = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "On:splitmix64", kwlist, &seed_obj, &n)) return NULL;
    if (parse_seed(seed_obj, &x) < 0) return NULL;
    if (n < 0 || n > 1000000) return PyErr_Format(PyExc_ValueError, "n must be in [0, 1000000], got %zd", n);
    npy_intp dims[1] = {(npy_intp)n};
    PyObject *r = PyArray_SimpleNew(1, dims, NPY_UINT64);
    if (!r) return NULL;
    uint64_t *out = PyArray_DATA((PyArrayObject *)r);
    for (Py_ssize_t i = 0; i < n; i++) out[i] = cv_splitmix64(&x);
    return r;
}

static PyObject *py_xoshiro256ss(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kwlist[] = {"state", "n", NULL};
    PyObject *state_obj = NULL;
    Py_ssize_t n = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "On:xoshiro256ss", kwlist, &state_obj, &n)) return NULL;
    if (n < 0 || n > 1000000) return PyErr_Format(PyExc_ValueError, "n must be in [0, 1000000], got %zd", n);
    PyObject *seq = PySequence_Fast(state_obj, "state must be a sequence of 4 ints");
    if (!seq) return NULL;
    cv_rng rng;
    int ok = PySequence_Fast_GET_SIZE(seq) == 4;
    for (int i = 0; ok && i < 4; i++) ok = parse_seed(PySequence_Fast_GET_ITEM(seq, i), &rng.s[i]) == 0;
    Py_DECREF(seq);
    if (!ok) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "state must hold 4 ints");
        return NULL;
    }
    npy_intp dims[1] = {(npy_intp)n};
    PyObject *r = PyArray_SimpleNew(1, dims, NPY_UINT64);
    if (!r) return NULL;
    uint64_t *out = PyArray_DATA((PyArrayObject *)r);
    for (Py_ssize_t i = 0; i < n; i++) out[i] = cv_rng_next(&rng);
    return r;
}

/* ---- stop strings ----------------------------------------------------- */

/* Builds a stop set from a sequence of bytes objects. */
static int parse_stops(PyObject *obj, cv_stop_set *set) {
    memset(set, 0, sizeof *set);
    PyObject *seq = PySequence_Fast(obj, "");
    if (!seq || PyBytes_Check(obj)) {
        Py_XDECREF(seq);
        PyErr_Format(PyExc_TypeError, "stop_strings must be a list of bytes, got %s",
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    int rc = -1;
    const char **strs = NULL;
    size_t *lens = NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n > 1000000) {
        PyErr_Format(PyExc_ValueError, "too many stop strings: %zd", n);
        goto done;
    }
    strs = PyMem_Malloc((size_t)(n > 0 ? n : 1) * sizeof *strs);
    lens = PyMem_Malloc((size_t)(n > 0 ? n : 1) * sizeof *lens);
    if (!strs || !lens) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyBytes_Check(item)) {
            PyErr_Format(PyExc_TypeError, "stop_strings[%zd] must be bytes, got %s", i,
                         Py_TYPE(item)->tp_name);
            goto done;
        }
        if (PyBytes_GET_SIZE(item) == 0) {
            PyErr_Format(PyExc_ValueError, "stop_strings[%zd] is empty", i);
            goto done;
        }
        strs[i] = PyBytes_AS_STRING(item);
        lens[i] = (size_t)PyBytes_GET_SIZE(item);
    }
    int st = cv_stop_set_init(set, strs, lens, (int)n);
    if (st == CV_ERR_NOMEM) {
        PyErr_NoMemory();
        goto done;
    }
    if (st != CV_OK) {
        PyErr_SetString(PyExc_ValueError, "invalid stop strings");
        goto done;
    }
    rc = 0;
done:
    PyMem_Free(strs);
    PyMem_Free(lens);
    Py_DECREF(seq);
    return rc;
}

static PyObject *py_stop_find(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kwlist[] = {"stop_strings", "text", "new_from", NULL};
    PyObject *stops;
    Py_buffer text = {0};
    Py_ssize_t new_from = 0;
    cv_stop_set set;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "Oy*n:stop_find", kwlist, &stops, &text, &new_from))
        return NULL;
    PyObject *result = NULL;
    if (new_from < 0 || new_from > text.len) {
        PyErr_Format(PyExc_ValueError, "new_from must be in [0, len(text)] = [0, %zd], got %zd",
                     text.len, new_from);
        goto done;
    }
    if (parse_stops(stops, &set) < 0) goto done;
    size_t start = 0;
    int idx = cv_stop_find(&set, text.buf, (size_t)text.len, (size_t)new_from, &start);
    cv_stop_set_free(&set);
    if (idx < 0) {
        Py_INCREF(Py_None);
        result = Py_None;
    } else {
        result = Py_BuildValue("(in)", idx, (Py_ssize_t)start);
    }
done:
    PyBuffer_Release(&text);
    return result;
}

static PyObject *py_stop_holdback(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kwlist[] = {"stop_strings", "text", NULL};
    PyObject *stops;
    Py_buffer text = {0};
    cv_stop_set set;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "Oy*:stop_holdback", kwlist, &stops, &text))
        return NULL;
    PyObject *result = NULL;
    if (parse_stops(stops, &set) == 0) {
        size_t k = cv_stop_holdback(&set, text.buf, (size_t)text.len);
        cv_stop_set_free(&set);
        result = PyLong_FromSize_t(k);
    }
    PyBuffer_Release(&text);
    return result;
}

static PyMethodDef sampler_methods[] = {
    {"sample", (PyCFunction)(void (*)(void))py_sample, METH_VARARGS | METH_KEYWORDS,
     "sample(logits, *, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0,\n"
     "       presence_penalty=0.0, frequency_penalty=0.0, prompt=(), output=(), banned=(),\n"
     "       seed=0, n_logprobs=-1, n_draws=1)\n"
     "Draws n_draws tokens one after another from one random stream seeded once, each from\n"
     "the same float32 logits row. Returns [(token, logprob or None, [(id, logprob), ...])]."},
    {"process_logits", (PyCFunction)(void (*)(void))py_process_logits,
     METH_VARARGS | METH_KEYWORDS,
     "process_logits(logits, *, <sample's parameters without seed, n_logprobs, n_draws>)\n"
     "The log-weights a draw uses: processed logit / temperature at the surviving tokens,\n"
     "-inf elsewhere (greedy: only the argmax)."},
    {"rng_uint64", (PyCFunction)(void (*)(void))py_rng_uint64, METH_VARARGS | METH_KEYWORDS,
     "rng_uint64(seed, n) -> uint64 array: the first n outputs of a sequence's stream."},
    {"splitmix64", (PyCFunction)(void (*)(void))py_splitmix64, METH_VARARGS | METH_KEYWORDS,
     "splitmix64(seed, n) -> uint64 array: the generator's first n outputs."},
    {"xoshiro256ss", (PyCFunction)(void (*)(void))py_xoshiro256ss, METH_VARARGS | METH_KEYWORDS,
     "xoshiro256ss(state, n) -> uint64 array: xoshiro256** from a 4-word state."},
    {"rng_uniform", (PyCFunction)(void (*)(void))py_rng_uniform, METH_VARARGS | METH_KEYWORDS,
     "rng_uniform(seed, n) -> float64 array: the first n uniforms in [0, 1)."},
    {"stop_find", (PyCFunction)(void (*)(void))py_stop_find, METH_VARARGS | METH_KEYWORDS,
     "stop_find(stop_strings, text, new_from) -> (index, match_start) or None\n"
     "The earliest-starting stop string match that ends after byte new_from (ties: first listed)."},
    {"stop_holdback", (PyCFunction)(void (*)(void))py_stop_holdback, METH_VARARGS | METH_KEYWORDS,
     "stop_holdback(stop_strings, text) -> int: trailing bytes that may begin a stop string."},
    {NULL, NULL, 0, NULL},
};

int cv_py_add_sampler(PyObject *m) {
    return PyModule_AddFunctions(m, sampler_methods);
}
