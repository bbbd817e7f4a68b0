/* Llama2cBpe(pieces, scores): llama2.c's encoder (csrc/model/llama2c_bpe.c),
 * run without the GIL. */
#include "arrays.h"

#include "../model/llama2c_bpe.h"

typedef struct {
    PyObject_HEAD
    cv_llama2c_bpe *bpe;
} Llama2cBpeObject;

static int bpe_init(Llama2cBpeObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"pieces", "scores", "seed", NULL};
    PyObject *pieces, *scores;
    unsigned long long seed;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO$K", kwlist, &pieces, &scores, &seed)) return -1;
    if (self->bpe) {
        PyErr_SetString(PyExc_RuntimeError, "Llama2cBpe is already initialized");
        return -1;
    }
    if (!PyList_Check(pieces) || !PyList_Check(scores) || PyList_GET_SIZE(pieces) != PyList_GET_SIZE(scores)) {
        PyErr_SetString(PyExc_TypeError, "Llama2cBpe takes two lists of the same length: pieces and scores");
        return -1;
    }
    const Py_ssize_t n = PyList_GET_SIZE(pieces);
    const size_t m = n ? (size_t)n : 1;
    cv_token_text *text = PyMem_Calloc(m, sizeof *text);
    double *score = PyMem_Calloc(m, sizeof *score);
    int rc = -1;
    if (!text || !score) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *p = PyList_GET_ITEM(pieces, i), *s = PyList_GET_ITEM(scores, i);
        if (!PyBytes_Check(p)) {
            PyErr_Format(PyExc_TypeError, "Llama2cBpe: piece %zd is a %s, not bytes", i, Py_TYPE(p)->tp_name);
            goto done;
        }
        text[i] = (cv_token_text){PyBytes_AS_STRING(p), (size_t)PyBytes_GET_SIZE(p)};
        score[i] = PyFloat_AsDouble(s);
        if (score[i] == -1.0 && PyErr_Occurred()) goto done;
    }
    cv_err err;
    /* with the GIL held: the pieces are read through the lists, which nothing may change meanwhile */
    int crc = cv_llama2c_bpe_create(&self->bpe, text, score, (int64_t)n, (uint64_t)seed, &err);
    if (crc < 0) {
        cv_py_raise(&err);
        goto done;
    }
    rc = 0;
done:
    PyMem_Free(text);
    PyMem_Free(score);
    return rc;
}

static PyObject *bpe_encode(Llama2cBpeObject *self, PyObject *args) {
    PyObject *lead, *data;
    if (!PyArg_ParseTuple(args, "OO:encode", &lead, &data)) return NULL;
    if (!self->bpe) {
        PyErr_SetString(PyExc_RuntimeError, "Llama2cBpe is not initialized");
        return NULL;
    }
    if (!PyList_Check(lead) || !PyBytes_Check(data)) {
        PyErr_SetString(PyExc_TypeError, "Llama2cBpe.encode takes a list of leading ids and bytes");
        return NULL;
    }
    const Py_ssize_t n_lead = PyList_GET_SIZE(lead);
    int32_t *lead_ids = PyMem_Malloc((n_lead ? (size_t)n_lead : 1) * sizeof *lead_ids);
    if (!lead_ids) return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < n_lead; i++) {
        long v = PyLong_AsLong(PyList_GET_ITEM(lead, i));
        if (v == -1 && PyErr_Occurred()) {
            PyMem_Free(lead_ids);
            return NULL;
        }
        lead_ids[i] = v >= INT32_MIN && v <= INT32_MAX ? (int32_t)v : -1;
    }
    const unsigned char *p = (const unsigned char *)PyBytes_AS_STRING(data);
    const size_t len = (size_t)PyBytes_GET_SIZE(data);
    int32_t *ids = NULL;
    size_t n = 0;
    cv_err err;
    int rc;
    Py_BEGIN_ALLOW_THREADS /* data is immutable and stays referenced by the caller */
    rc = cv_llama2c_bpe_encode(self->bpe, lead_ids, (size_t)n_lead, p, len, &ids, &n, &err);
    Py_END_ALLOW_THREADS
    PyMem_Free(lead_ids);
    if (rc < 0) return cv_py_raise(&err);
    PyObject *out = cv_py_int32_list(ids, (int64_t)n);
    free(ids);
    return out;
}

static void bpe_dealloc(Llama2cBpeObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    cv_llama2c_bpe_free(self->bpe);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static PyMethodDef bpe_methods[] = {
    {"encode", (PyCFunction)bpe_encode, METH_VARARGS,
     "encode(lead, data) -> list of token ids: the ids in lead (a list) followed by the UTF-8 bytes data, "
     "merged as llama2.c merges"},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot bpe_slots[] = {
    {Py_tp_doc, "Llama2cBpe(pieces, scores, *, seed): llama2.c's encoder over a tokenizer.bin vocabulary "
                "(pieces: list of bytes, scores: list of numbers), run without the GIL."},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_init, bpe_init},
    {Py_tp_dealloc, bpe_dealloc},
    {Py_tp_methods, bpe_methods},
    {0, NULL},
};

static PyType_Spec bpe_spec = {"conveyor._core.Llama2cBpe", sizeof(Llama2cBpeObject), 0, CV_PY_TYPE_FLAGS,
                               bpe_slots};

int cv_py_add_llama2c_tokenizer(PyObject *m) { return cv_py_add_type(m, &bpe_spec); }
