/* Tokenizer tables built in C: conveyor._core.gguf_score_merges derives the
 * BPE merges of a SentencePiece-style GGUF vocabulary from its scores
 * (csrc/model/score_merges.c) without a Python object per candidate split. */
#include "binding.h"

#include "../model/score_merges.h"

/* A list argument of n items; TypeError naming what otherwise. */
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

static PyObject *py_gguf_score_merges(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kwlist[] = {"tokens", "scores", "types", "max_token_chars", "max_merges", "seed", NULL};
    PyObject *tokens, *scores, *types;
    int max_token_chars;
    long long max_merges;
    unsigned long long seed;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO$iLK", kwlist, &tokens, &scores, &types, &max_token_chars,
                                     &max_merges, &seed))
        return NULL;
    if (check_list(tokens, "tokens", -1) < 0) return NULL;
    const Py_ssize_t n = PyList_GET_SIZE(tokens);
    if (check_list(scores, "scores", n) < 0 || (types != Py_None && check_list(types, "token types", n) < 0))
        return NULL;

    PyObject *result = NULL;
    cv_score_merges merges = {0};
    cv_token_text *text = PyMem_Calloc(n ? (size_t)n : 1, sizeof *text);
    double *score = PyMem_Calloc(n ? (size_t)n : 1, sizeof *score);
    int32_t *type = types == Py_None ? NULL : PyMem_Calloc(n ? (size_t)n : 1, sizeof *type);
    if (!text || !score || (types != Py_None && !type)) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *t = PyList_GET_ITEM(tokens, i);
        if (!PyUnicode_Check(t)) {
            PyErr_Format(cv_ModelFormatError, "GGUF tokenizer: token %zd is a %s, not a str", i, Py_TYPE(t)->tp_name);
            goto done;
        }
        Py_ssize_t len;
        text[i].p = PyUnicode_AsUTF8AndSize(t, &len);
        if (!text[i].p) goto done;
        text[i].len = (size_t)len;
        PyObject *s = PyList_GET_ITEM(scores, i);
        if (!PyFloat_Check(s) && !PyLong_Check(s)) {
            PyErr_Format(cv_ModelFormatError, "GGUF tokenizer: score %zd is a %s, not a number", i, Py_TYPE(s)->tp_name);
            goto done;
        }
        score[i] = PyFloat_AsDouble(s);
        if (score[i] == -1.0 && PyErr_Occurred()) goto done; /* an int too large for a double */
        if (type) {
            PyObject *ty = PyList_GET_ITEM(types, i);
            long v = PyLong_Check(ty) ? PyLong_AsLong(ty) : -1;
            if (v == -1 && PyErr_Occurred()) PyErr_Clear();
            /* any other value is a type that is never split */
            type[i] = v >= INT32_MIN && v <= INT32_MAX ? (int32_t)v : -1;
        }
    }
    cv_err err;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = cv_score_merges_build(&merges, text, score, type, (int64_t)n, max_token_chars, max_merges,
                               (uint64_t)seed, &err);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        cv_py_raise(&err);
        goto done;
    }
    /* the pairs share the token list's str objects */
    result = PyList_New((Py_ssize_t)merges.n);
    for (int64_t j = 0; result && j < merges.n; j++) {
        PyObject *pair = PyTuple_Pack(2, PyList_GET_ITEM(tokens, merges.left[j]),
                                      PyList_GET_ITEM(tokens, merges.right[j]));
        if (!pair) Py_CLEAR(result);
        else PyList_SET_ITEM(result, (Py_ssize_t)j, pair);
    }
done:
    cv_score_merges_free(&merges);
    PyMem_Free(text);
    PyMem_Free(score);
    PyMem_Free(type);
    return result;
}

static PyMethodDef tokenizer_methods[] = {
    {"gguf_score_merges", (PyCFunction)(void (*)(void))py_gguf_score_merges, METH_VARARGS | METH_KEYWORDS,
     "gguf_score_merges(tokens, scores, types, *, max_token_chars, max_merges, seed) -> list of "
     "(left, right) str pairs: the BPE merges equivalent to SentencePiece's score-ordered merging of "
     "tokens (list of str) with scores (list of numbers) and types (list of ints, or None for all "
     "normal). More than max_merges merges is a ModelFormatError."},
    {NULL, NULL, 0, NULL},
};

int cv_py_add_tokenizer(PyObject *m) { return PyModule_AddFunctions(m, tokenizer_methods); }
