/* A GGUF vocabulary given as Python lists, read into C arrays: see vocab_lists.h. */
#include "vocab_lists.h"

#include <string.h>

void cv_vocab_lists_free(cv_vocab_lists *v) {
    PyMem_Free(v->text);
    PyMem_Free(v->score);
    PyMem_Free(v->type);
    v->text = NULL;
    v->score = NULL;
    v->type = NULL;
}

/* A list argument of n items (any n when n < 0); an exception naming what otherwise. */
static int check_list(PyObject *o, const char *what, Py_ssize_t n) {
    if (!PyList_Check(o)) {
        PyErr_Format(PyExc_TypeError, "%s must be a list, got %s", what, Py_TYPE(o)->tp_name);
        return -1;
    }
    if (n >= 0 && PyList_GET_SIZE(o) != n) {
        PyErr_Format(cv_ModelFormatError, "GGUF tokenizer: %zd %s for %zd tokens", PyList_GET_SIZE(o), what, n);
        return -1;
    }
    return 0;
}

int cv_vocab_lists_read(cv_vocab_lists *v, PyObject *tokens, PyObject *scores, PyObject *types) {
    memset(v, 0, sizeof *v);
    if (check_list(tokens, "tokens", -1) < 0) return -1;
    const Py_ssize_t n = PyList_GET_SIZE(tokens);
    if (check_list(scores, "scores", n) < 0 || (types != Py_None && check_list(types, "token types", n) < 0))
        return -1;
    const size_t m = n ? (size_t)n : 1;
    v->n = n;
    v->text = PyMem_Calloc(m, sizeof *v->text);
    v->score = PyMem_Calloc(m, sizeof *v->score);
    v->type = types == Py_None ? NULL : PyMem_Calloc(m, sizeof *v->type);
    if (!v->text || !v->score || (types != Py_None && !v->type)) {
        PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *t = PyList_GET_ITEM(tokens, i);
        if (!PyUnicode_Check(t)) {
            PyErr_Format(cv_ModelFormatError, "GGUF tokenizer: token %zd is a %s, not a str", i, Py_TYPE(t)->tp_name);
            goto fail;
        }
        Py_ssize_t len;
        v->text[i].p = PyUnicode_AsUTF8AndSize(t, &len);
        if (!v->text[i].p) goto fail;
        v->text[i].len = (size_t)len;
        PyObject *s = PyList_GET_ITEM(scores, i);
        if (!PyFloat_Check(s) && !PyLong_Check(s)) {
            PyErr_Format(cv_ModelFormatError, "GGUF tokenizer: score %zd is a %s, not a number", i, Py_TYPE(s)->tp_name);
            goto fail;
        }
        v->score[i] = PyFloat_AsDouble(s);
        if (v->score[i] == -1.0 && PyErr_Occurred()) goto fail; /* an int too large for a double */
        if (v->type) {
            PyObject *ty = PyList_GET_ITEM(types, i);
            long x = PyLong_Check(ty) ? PyLong_AsLong(ty) : -1;
            if (x == -1 && PyErr_Occurred()) PyErr_Clear();
            /* any other value is a type that is neither split nor cut out */
            v->type[i] = x >= INT32_MIN && x <= INT32_MAX ? (int32_t)x : -1;
        }
    }
    return 0;
fail:
    cv_vocab_lists_free(v);
    return -1;
}
