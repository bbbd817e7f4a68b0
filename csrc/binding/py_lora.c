#include "arrays.h"

#include <stdlib.h>

#include "../model/lora.h"
#include "py_lora.h"

PyObject *cv_py_lora_load(cv_engine *e, PyObject *args) {
    long long slot;
    float scale;
    PyObject *pairs;
    if (!PyArg_ParseTuple(args, "LfO!", &slot, &scale, &PyList_Type, &pairs)) return NULL;
    int64_t max_rank = 0;
    const int64_t n_slots = cv_engine_lora_slots(e, &max_rank);
    if (n_slots == 0) {
        PyErr_SetString(PyExc_ValueError, "LoRA is not enabled: make the engine with enable_lora=True");
        return NULL;
    }
    const Py_ssize_t n = PyList_GET_SIZE(pairs);
    if (n < 1) {
        PyErr_SetString(PyExc_ValueError, "lora_load: no (layer, module, A, B) pairs");
        return NULL;
    }
    int32_t *layers = calloc((size_t)n, sizeof *layers), *modules = calloc((size_t)n, sizeof *modules);
    const float **a = calloc((size_t)n, sizeof *a), **b = calloc((size_t)n, sizeof *b);
    PyArrayObject **held = calloc(2 * (size_t)n, sizeof *held);
    PyObject *result = NULL;
    int64_t rank = -1;
    if (!layers || !modules || !a || !b || !held) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *t = PyList_GET_ITEM(pairs, i);
        int layer, module;
        PyObject *ao, *bo;
        if (!PyTuple_Check(t) || !PyArg_ParseTuple(t, "iiOO", &layer, &module, &ao, &bo)) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "lora_load: pairs must be (layer, module, A, B)");
            goto done;
        }
        if (module < 0 || module >= CV_LORA_N_MODULES) {
            PyErr_Format(PyExc_ValueError, "lora_load: module %d outside [0, %d)", module, CV_LORA_N_MODULES);
            goto done;
        }
        if (!(held[2 * i] = cv_py_want_array(ao, "A", NPY_FLOAT32, 2, 0))) goto done;
        if (!(held[2 * i + 1] = cv_py_want_array(bo, "B", NPY_FLOAT32, 2, 0))) goto done;
        int64_t out, in;
        cv_engine_lora_shape(e, module, &out, &in);
        const npy_intp *as = PyArray_DIMS(held[2 * i]), *bs = PyArray_DIMS(held[2 * i + 1]);
        if (rank < 0) rank = as[0];
        if (as[0] != rank || as[1] != in || bs[0] != out || bs[1] != rank) {
            PyErr_Format(PyExc_ValueError,
                         "lora_load: layer %d module %d: A is (%lld, %lld), B (%lld, %lld); expected (%lld, %lld) "
                         "and (%lld, %lld)",
                         layer, module, (long long)as[0], (long long)as[1], (long long)bs[0], (long long)bs[1],
                         (long long)rank, (long long)in, (long long)out, (long long)rank);
            goto done;
        }
        layers[i] = layer;
        modules[i] = module;
        a[i] = PyArray_DATA(held[2 * i]);
        b[i] = PyArray_DATA(held[2 * i + 1]);
    }
    cv_err err = {0};
    int rc;
    /* it may wait for a step's forward to end (the slot pool's lock): not with the GIL */
    Py_BEGIN_ALLOW_THREADS
    rc = cv_engine_lora_load(e, slot, rank, scale, n, layers, modules, a, b, &err);
    Py_END_ALLOW_THREADS
    if (rc) {
        cv_py_raise(&err);
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    free(held); /* borrowed views: the pairs list keeps the arrays alive */
    free(layers);
    free(modules);
    free(a);
    free(b);
    return result;
}

PyObject *cv_py_lora_unload(cv_engine *e, PyObject *args) {
    long long slot;
    if (!PyArg_ParseTuple(args, "L", &slot)) return NULL;
    cv_err err = {0};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = cv_engine_lora_unload(e, slot, &err);
    Py_END_ALLOW_THREADS
    if (rc) return cv_py_raise(&err);
    Py_RETURN_NONE;
}
