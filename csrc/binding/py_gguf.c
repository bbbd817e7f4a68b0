/* GGUF metadata as Python values: conveyor._core.gguf_metadata(path) reads a
 * file's key/values without loading its tensors (the tokenizer's source: the C
 * reader takes 0.1 s for a 49k vocabulary), and Checkpoint.metadata. */
#include "binding.h"

#include <string.h>

#include "../model/gguf.h"

/* A GGUF string as str; ModelFormatError naming key when it is not UTF-8. */
static PyObject *gguf_str(cv_gguf_str s, const cv_gguf_kv *kv) {
    PyObject *o = PyUnicode_DecodeUTF8(s.p, (Py_ssize_t)s.len, "strict");
    if (!o && PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
        PyErr_Clear();
        cv_err e;
        cv_set_err(&e, CV_ERR_FORMAT, "GGUF metadata '%.*s' holds a string that is not valid UTF-8",
                   (int)(kv->key.len > 200 ? 200 : kv->key.len), kv->key.p);
        cv_py_raise(&e);
    }
    return o;
}

/* One scalar of type t at p (ints, floats, bools). */
static PyObject *gguf_scalar(cv_gguf_type t, const cv_gguf_kv *kv, uint64_t i) {
    int64_t v;
    double f;
    if (kv->type == CV_GGUF_ARRAY) {
        if (t == CV_GGUF_BOOL) return PyBool_FromLong(kv->value[i] != 0);
        if (cv_gguf_array_int(kv, i, &v)) return PyLong_FromLongLong(v);
        if (cv_gguf_array_float(kv, i, &f)) return PyFloat_FromDouble(f);
        /* a uint64 above INT64_MAX */
        const unsigned char *p = kv->value + i * 8;
        uint64_t u = 0;
        for (int k = 7; k >= 0; k--) u = (u << 8) | p[k];
        return PyLong_FromUnsignedLongLong(u);
    }
    int b;
    if (cv_gguf_kv_bool(kv, &b)) return PyBool_FromLong(b);
    if (cv_gguf_kv_int(kv, &v)) return PyLong_FromLongLong(v);
    if (cv_gguf_kv_float(kv, &f)) return PyFloat_FromDouble(f);
    const unsigned char *p = kv->value;
    uint64_t u = 0;
    for (int k = 7; k >= 0; k--) u = (u << 8) | p[k];
    return PyLong_FromUnsignedLongLong(u);
}

static PyObject *gguf_value(const cv_gguf_kv *kv) {
    cv_gguf_str s;
    if (kv->type == CV_GGUF_STRING) {
        cv_gguf_kv_string(kv, &s);
        return gguf_str(s, kv);
    }
    if (kv->type != CV_GGUF_ARRAY) return gguf_scalar(kv->type, kv, 0);
    if (kv->count > (uint64_t)PY_SSIZE_T_MAX) return PyErr_NoMemory();
    PyObject *list = PyList_New((Py_ssize_t)kv->count);
    if (!list) return NULL;
    const unsigned char *cur = kv->value;
    for (uint64_t i = 0; i < kv->count; i++) {
        PyObject *o = kv->elem_type == CV_GGUF_STRING ? gguf_str(cv_gguf_next_string(&cur), kv)
                                                      : gguf_scalar(kv->elem_type, kv, i);
        if (!o) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, (Py_ssize_t)i, o);
    }
    return list;
}

/* The arrays a GGUF tokenizer is built from: gguf_metadata(path, array_limit=N)
 * converts these whatever their length, and leaves out every other array of more
 * than N elements (a Python list costs ~10x the file's bytes: a 64 MiB array of
 * nothing the tokenizer reads took 700 MiB). */
static const char *const tokenizer_arrays[] = {"tokenizer.ggml.tokens", "tokenizer.ggml.scores",
                                               "tokenizer.ggml.token_type", "tokenizer.ggml.merges", NULL};

static int kept_whole(const cv_gguf_kv *kv) {
    for (int i = 0; tokenizer_arrays[i]; i++)
        if (kv->key.len == strlen(tokenizer_arrays[i]) && !memcmp(kv->key.p, tokenizer_arrays[i], kv->key.len))
            return 1;
    return 0;
}

static PyObject *metadata_dict(const struct cv_gguf_file *f, long long array_limit) {
    PyObject *d = PyDict_New();
    if (!d) return NULL;
    /* in file order, as the Python reader gives them */
    const cv_gguf_kv **order = PyMem_Calloc(f->n_kvs ? f->n_kvs : 1, sizeof *order);
    if (!order) {
        Py_DECREF(d);
        return PyErr_NoMemory();
    }
    for (size_t i = 0; i < f->n_kvs; i++) order[f->kvs[i].index] = &f->kvs[i];
    for (size_t i = 0; i < f->n_kvs; i++) {
        const cv_gguf_kv *kv = order[i];
        if (array_limit >= 0 && kv->type == CV_GGUF_ARRAY && kv->count > (uint64_t)array_limit && !kept_whole(kv))
            continue;
        PyObject *key = gguf_str(kv->key, kv);
        PyObject *val = key ? gguf_value(kv) : NULL;
        if (!val || PyDict_SetItem(d, key, val) < 0) {
            Py_XDECREF(key);
            Py_XDECREF(val);
            Py_DECREF(d);
            PyMem_Free(order);
            return NULL;
        }
        Py_DECREF(key);
        Py_DECREF(val);
    }
    PyMem_Free(order);
    return d;
}

PyObject *cv_py_gguf_metadata(const struct cv_gguf_file *f) { return metadata_dict(f, -1); }

static PyObject *py_gguf_metadata(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kwlist[] = {"path", "array_limit", NULL};
    PyObject *bytes = NULL;
    long long array_limit = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O&|$L", kwlist, PyUnicode_FSConverter, &bytes, &array_limit))
        return NULL;
    const char *path = PyBytes_AS_STRING(bytes);
    cv_gguf_file f;
    cv_err err;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = cv_gguf_open(&f, path, path, &err);
    Py_END_ALLOW_THREADS
    PyObject *d = rc < 0 ? cv_py_raise(&err) : metadata_dict(&f, array_limit);
    if (rc >= 0) cv_gguf_close(&f);
    Py_DECREF(bytes);
    return d;
}

static PyMethodDef gguf_methods[] = {
    {"gguf_metadata", (PyCFunction)(void (*)(void))py_gguf_metadata, METH_VARARGS | METH_KEYWORDS,
     "gguf_metadata(path, *, array_limit=-1) -> dict of the GGUF key/values in file order (arrays as "
     "lists). array_limit >= 0: arrays longer than that are left out, except the tokenizer's "
     "(tokenizer.ggml.tokens, scores, token_type, merges)."},
    {NULL, NULL, 0, NULL},
};

int cv_py_add_gguf(PyObject *m) { return PyModule_AddFunctions(m, gguf_methods); }
