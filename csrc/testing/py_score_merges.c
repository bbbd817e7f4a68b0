/* gguf_score_merges(...): the BPE merge list a SentencePiece-style GGUF
 * vocabulary's scores give (csrc/model/score_merges.c). The product encodes
 * straight from the tables (conveyor._core.SpmTokenizer); the tests run HF
 * `tokenizers` over this list as the encoder's reference. */
#include "testing.h"

#include "../binding/vocab_lists.h"
#include "../model/score_merges.h"

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
    cv_vocab_lists v;
    if (cv_vocab_lists_read(&v, tokens, scores, types) < 0) return NULL;
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
    cv_vocab_lists_free(&v);
    return result;
}

static PyMethodDef score_merges_methods[] = {
    {"gguf_score_merges", (PyCFunction)(void (*)(void))py_gguf_score_merges, METH_VARARGS | METH_KEYWORDS,
     "gguf_score_merges(tokens, scores, types, *, max_token_chars, max_merges, seed) -> list of "
     "(left, right) str pairs: the BPE merges equivalent to SentencePiece's score-ordered merging of "
     "tokens (list of str) with scores (list of numbers) and types (list of ints, or None for all "
     "normal). More than max_merges merges is a ModelFormatError."},
    {NULL, NULL, 0, NULL},
};

int cv_py_add_score_merges(PyObject *m) { return PyModule_AddFunctions(m, score_merges_methods); }
