/* Tokenizer tables built in C from a GGUF vocabulary given as Python lists:
 *   gguf_score_merges(...)  the BPE merges of a SentencePiece-style vocabulary,
 *                           derived from its scores (csrc/model/score_merges.c);
 *   SpmTokenizer(...)       its encoder, straight from the tables with no merge
 *                           list (csrc/model/spm_tokenizer.c). */
#include "binding.h"

#include <string.h>

#include "../model/score_merges.h"
#include "../model/spm_tokenizer.h"

/* The C views of tokens (list of str), scores (list of numbers) and types (list
 * of ints or None), valid while the lists live; free with vocab_lists_free. */
typedef struct vocab_lists {
    cv_token_text *text; /* [n] */
    double *score;       /* [n] */
    int32_t *type;       /* [n], NULL for all normal */
    Py_ssize_t n;
} vocab_lists;

static void vocab_lists_free(vocab_lists *v) {
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

static int vocab_lists_read(vocab_lists *v, PyObject *tokens, PyObject *scores, PyObject *types) {
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
    vocab_lists_free(v);
    return -1;
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
    vocab_lists v;
    if (vocab_lists_read(&v, tokens, scores, types) < 0) return NULL;
    PyObject *result = NULL;
    cv_score_merges merges = {0};
    cv_err err;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = cv_score_merges_build(&merges, v.text, v.score, v.type, (int64_t)v.n, max_token_chars, max_merges,
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
    vocab_lists_free(&v);
    return result;
}

/* ------------------------------------------------------------------ SpmTokenizer */

typedef struct {
    PyObject_HEAD
    cv_spm_tokenizer *spm;
} SpmTokenizerObject;

static int spm_init(SpmTokenizerObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"tokens", "scores", "types", "unk_id", "add_space_prefix", "max_token_chars", "seed", NULL};
    PyObject *tokens, *scores, *types;
    int unk_id, prefix, max_token_chars;
    unsigned long long seed;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO$ipiK", kwlist, &tokens, &scores, &types, &unk_id, &prefix,
                                     &max_token_chars, &seed))
        return -1;
    if (self->spm) {
        PyErr_SetString(PyExc_RuntimeError, "SpmTokenizer is already initialized");
        return -1;
    }
    vocab_lists v;
    if (vocab_lists_read(&v, tokens, scores, types) < 0) return -1;
    cv_err err;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = cv_spm_create(&self->spm, v.text, v.score, v.type, (int64_t)v.n, max_token_chars, unk_id, prefix,
                       (uint64_t)seed, &err);
    Py_END_ALLOW_THREADS
    vocab_lists_free(&v);
    if (rc < 0) {
        cv_py_raise(&err);
        return -1;
    }
    return 0;
}

static PyObject *spm_encode(SpmTokenizerObject *self, PyObject *text) {
    if (!self->spm) {
        PyErr_SetString(PyExc_RuntimeError, "SpmTokenizer is not initialized");
        return NULL;
    }
    if (!PyUnicode_Check(text)) {
        PyErr_Format(PyExc_TypeError, "text must be a str, got %s", Py_TYPE(text)->tp_name);
        return NULL;
    }
    Py_ssize_t len;
    const char *p = PyUnicode_AsUTF8AndSize(text, &len);
    if (!p) return NULL;
    int32_t *ids = NULL;
    size_t n = 0;
    cv_err err;
    int rc;
    Py_BEGIN_ALLOW_THREADS /* text stays referenced by the caller */
    rc = cv_spm_encode(self->spm, p, (size_t)len, &ids, &n, &err);
    Py_END_ALLOW_THREADS
    if (rc < 0) return cv_py_raise(&err);
    PyObject *out = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; out && i < n; i++) {
        PyObject *id = PyLong_FromLong(ids[i]);
        if (!id) Py_CLEAR(out);
        else PyList_SET_ITEM(out, (Py_ssize_t)i, id);
    }
    free(ids);
    return out;
}

static void spm_dealloc(SpmTokenizerObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    cv_spm_free(self->spm);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static PyMethodDef spm_methods[] = {
    {"encode", (PyCFunction)spm_encode, METH_O, "encode(text) -> list of token ids (no BOS/EOS)"},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot spm_slots[] = {
    {Py_tp_doc, "SpmTokenizer(tokens, scores, types, *, unk_id, add_space_prefix, max_token_chars, seed): "
                "the SentencePiece-style encoder of a GGUF vocabulary (tokens: list of str, scores: list of "
                "numbers, types: list of ints or None; unk_id -1 for none), built from its tables."},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_init, spm_init},
    {Py_tp_dealloc, spm_dealloc},
    {Py_tp_methods, spm_methods},
    {0, NULL},
};

static PyType_Spec spm_spec = {"conveyor._core.SpmTokenizer", sizeof(SpmTokenizerObject), 0, CV_PY_TYPE_FLAGS,
                               spm_slots};

static PyMethodDef tokenizer_methods[] = {
    {"gguf_score_merges", (PyCFunction)(void (*)(void))py_gguf_score_merges, METH_VARARGS | METH_KEYWORDS,
     "gguf_score_merges(tokens, scores, types, *, max_token_chars, max_merges, seed) -> list of "
     "(left, right) str pairs: the BPE merges equivalent to SentencePiece's score-ordered merging of "
     "tokens (list of str) with scores (list of numbers) and types (list of ints, or None for all "
     "normal). More than max_merges merges is a ModelFormatError."},
    {NULL, NULL, 0, NULL},
};

int cv_py_add_tokenizer(PyObject *m) {
    if (PyModule_AddFunctions(m, tokenizer_methods) < 0) return -1;
    return cv_py_add_type(m, &spm_spec);
}
