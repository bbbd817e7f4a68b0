/* conveyor._core: module init and error mapping. */
#define CV_BINDING_MAIN
#include "binding.h"

PyObject *cv_ConveyorError;
PyObject *cv_ModelFormatError;
PyObject *cv_UnsupportedError;
PyObject *cv_EngineClosedError;

PyObject *cv_py_raise(const cv_err *err) {
    const char *msg = (err && err->msg[0]) ? err->msg : "conveyor: unknown error";
    int code = err ? err->code : CV_ERR_STATE;
    PyObject *type;
    switch (code) {
    case CV_ERR_INVALID: type = PyExc_ValueError; break;
    case CV_ERR_TYPE: type = PyExc_TypeError; break;
    case CV_ERR_NOTFOUND: type = PyExc_FileNotFoundError; break;
    case CV_ERR_IO: type = PyExc_OSError; break;
    case CV_ERR_FORMAT: type = cv_ModelFormatError; break;
    case CV_ERR_UNSUPPORTED: type = cv_UnsupportedError; break;
    case CV_ERR_NOMEM: type = PyExc_MemoryError; break;
    case CV_ERR_STATE: type = cv_EngineClosedError; break;
    default: type = cv_ConveyorError; break;
    }
    PyErr_SetString(type, msg);
    return NULL;
}

static PyObject *new_error(PyObject *m, const char *name, PyObject *bases, const char *doc) {
    char full[128];
    PyOS_snprintf(full, sizeof full, "conveyor.%s", name);
    PyObject *t = PyErr_NewExceptionWithDoc(full, doc, bases, NULL);
    if (!t) return NULL;
    if (PyModule_AddObjectRef(m, name, t) < 0) { Py_DECREF(t); return NULL; }
    return t;
}

static struct PyModuleDef core_module = {
    PyModuleDef_HEAD_INIT, "_core", "Conveyor's C core.", -1, NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__core(void) {
    import_array();
    PyObject *m = PyModule_Create(&core_module);
    if (!m) return NULL;
    PyObject *bases = NULL;
    cv_ConveyorError = new_error(m, "ConveyorError", NULL, "Base class of Conveyor's errors.");
    if (!cv_ConveyorError) goto fail;
    bases = PyTuple_Pack(2, cv_ConveyorError, PyExc_ValueError);
    if (!bases) goto fail;
    cv_ModelFormatError = new_error(m, "ModelFormatError", bases, "A model file is malformed.");
    cv_UnsupportedError = new_error(m, "UnsupportedError", bases, "A valid input Conveyor does not support.");
    Py_CLEAR(bases);
    if (!cv_ModelFormatError || !cv_UnsupportedError) goto fail;
    bases = PyTuple_Pack(2, cv_ConveyorError, PyExc_RuntimeError);
    if (!bases) goto fail;
    cv_EngineClosedError = new_error(m, "EngineClosedError", bases, "The engine was closed.");
    Py_CLEAR(bases);
    if (!cv_EngineClosedError) goto fail;
    if (cv_py_add_checkpoint(m) < 0 || cv_py_add_kernels(m) < 0 || cv_py_add_scheduler(m) < 0 ||
        cv_py_add_sampler(m) < 0 || cv_py_add_engine(m) < 0 || cv_py_add_cuda(m) < 0 ||
        cv_py_add_model(m) < 0)
        goto fail;
#ifdef __AVX2__
    PyModule_AddStringConstant(m, "simd", "avx2");
#else
    PyModule_AddStringConstant(m, "simd", "none");
#endif
    return m;
fail:
    Py_XDECREF(bases);
    Py_DECREF(m);
    return NULL;
}
