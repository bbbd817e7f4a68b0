/* SpmTokenizer(...): the SentencePiece-style encoder of a GGUF vocabulary given
 * as Python lists, built in C straight from its tables with no merge list
 * (csrc/model/spm_tokenizer.c). */
#include "arrays.h"

#include "../model/spm_tokenizer.h"
#include "vocab_lists.h"

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
    cv_vocab_lists v;
    if (cv_vocab_lists_read(&v, tokens, scores, types) < 0) return -1;
    cv_err err;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = cv_spm_create(&self->spm, v.text, v.score, v.type, (int64_t)v.n, max_token_chars, unk_id, prefix,
                       (uint64_t)seed, &err);
    Py_END_ALLOW_THREADS
    cv_vocab_lists_free(&v);
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
    PyObject *out = cv_py_int32_list(ids, (int64_t)n);
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

int cv_py_add_tokenizer(PyObject *m) { return cv_py_add_type(m, &spm_spec); }
