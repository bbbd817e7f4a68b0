/* Conveyor's Python exception types and the map from C status codes to them. */
#include "binding.h"

PyObject *cv_ConveyorError;
PyObject *cv_ModelFormatError;
PyObject *cv_UnsupportedError;
PyObject *cv_EngineClosedError;
PyObject *cv_EngineOverloadedError;
PyObject *cv_EngineBusyError;

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
    case CV_ERR_CANCELLED: type = PyExc_KeyboardInterrupt; break;
    case CV_ERR_OVERLOADED: type = cv_EngineOverloadedError; break;
    case CV_ERR_BUSY: type = cv_EngineBusyError; break;
    default: type = cv_ConveyorError; break;
    }
    if (!(err && err->field[0])) {
        PyErr_SetString(type, msg);
        return NULL;
    }
    /* a request or config field is at fault: the exception carries it as .field */
    PyObject *exc = PyObject_CallFunction(type, "s", msg);
    if (!exc) return NULL;
    PyObject *field = PyUnicode_FromString(err->field);
    if (!field || PyObject_SetAttrString(exc, "field", field) < 0) {
        Py_XDECREF(field);
        Py_DECREF(exc);
        return NULL;
    }
    Py_DECREF(field);
    PyErr_SetObject(type, exc);
    Py_DECREF(exc);
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

int cv_py_add_errors(PyObject *m) {
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
    cv_EngineOverloadedError = new_error(m, "EngineOverloadedError", bases,
                                         "The request queue is full (max_queued_requests); retry later.");
    cv_EngineBusyError = new_error(m, "EngineBusyError", bases,
                                   "The engine's background loop runs: the call belongs to the loop's owner "
                                   "only while it is stopped.");
    Py_CLEAR(bases);
    if (!cv_EngineClosedError || !cv_EngineOverloadedError || !cv_EngineBusyError) goto fail;
    return 0;
fail:
    Py_XDECREF(bases);
    return -1;
}
