/* Conveyor's Python exception types and the map from C status codes to them. */
#include "binding.h"

#include <string.h>

#define CORE_MODULE "conveyor._core"

static const char *const error_names[CV_PY_EXC_KINDS] = {
    "ConveyorError",     "ModelFormatError",      "UnsupportedError",
    "EngineClosedError", "EngineOverloadedError", "EngineBusyError",
};
static const char *const error_docs[CV_PY_EXC_KINDS] = {
    "Base class of Conveyor's errors.",
    "A model file is malformed.",
    "A valid input Conveyor does not support.",
    "The engine was closed.",
    "The request queue is full (max_queued_requests); retry later.",
    "The engine's background loop runs: the call belongs to the loop's owner only while it is stopped.",
};

/* The builtin class each kind also derives from (and stands in for it when
 * conveyor._core is not loaded). */
static PyObject *builtin_base(cv_py_error_kind kind) {
    return (kind == CV_PY_EXC_MODEL_FORMAT || kind == CV_PY_EXC_UNSUPPORTED) ? PyExc_ValueError : PyExc_RuntimeError;
}

/* The state of the loaded conveyor._core, or NULL when it is not loaded (or
 * sys.modules holds something else under its name). Leaves any pending
 * exception as it was. The state stays alive while sys.modules holds the module. */
static cv_py_core_state *core_state(void) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    cv_py_core_state *st = NULL;
    PyObject *name = PyUnicode_FromString(CORE_MODULE);
    PyObject *mod = name ? PyImport_GetModule(name) : NULL;
    if (mod && PyModule_Check(mod)) {
        PyModuleDef *def = PyModule_GetDef(mod);
        if (def && def->m_size == (Py_ssize_t)sizeof(cv_py_core_state) && def->m_name &&
            strcmp(def->m_name, CORE_MODULE) == 0)
            st = PyModule_GetState(mod);
    }
    Py_XDECREF(mod);
    Py_XDECREF(name);
    PyErr_Clear();
    PyErr_Restore(type, value, tb);
    return st;
}

PyObject *cv_py_error(cv_py_error_kind kind) {
    const cv_py_core_state *st = core_state();
    if (st && (unsigned)kind < CV_PY_EXC_KINDS && st->errors[kind]) return st->errors[kind];
    return builtin_base(kind);
}

PyObject *cv_py_raise(const cv_err *err) {
    const char *msg = (err && err->msg[0]) ? err->msg : "conveyor: unknown error";
    int code = err ? err->code : CV_ERR_STATE;
    PyObject *type;
    switch (code) {
    case CV_ERR_INVALID: type = PyExc_ValueError; break;
    case CV_ERR_TYPE: type = PyExc_TypeError; break;
    case CV_ERR_NOTFOUND: type = PyExc_FileNotFoundError; break;
    case CV_ERR_IO: type = PyExc_OSError; break;
    case CV_ERR_FORMAT: type = cv_py_error(CV_PY_EXC_MODEL_FORMAT); break;
    case CV_ERR_UNSUPPORTED: type = cv_py_error(CV_PY_EXC_UNSUPPORTED); break;
    case CV_ERR_NOMEM: type = PyExc_MemoryError; break;
    case CV_ERR_STATE: type = cv_py_error(CV_PY_EXC_ENGINE_CLOSED); break;
    case CV_ERR_CANCELLED: type = PyExc_KeyboardInterrupt; break;
    case CV_ERR_OVERLOADED: type = cv_py_error(CV_PY_EXC_ENGINE_OVERLOADED); break;
    case CV_ERR_BUSY: type = cv_py_error(CV_PY_EXC_ENGINE_BUSY); break;
    default: type = cv_py_error(CV_PY_EXC_BASE); break;
    }
    /* a message may quote a file's bytes (a tensor name) or be cut inside a character:
     * invalid UTF-8 is replaced, so the error is still the one raised */
    PyObject *text = PyUnicode_DecodeUTF8(msg, (Py_ssize_t)strlen(msg), "replace");
    if (!text) return NULL;
    if (!(err && err->field[0])) {
        PyErr_SetObject(type, text);
        Py_DECREF(text);
        return NULL;
    }
    /* a request or config field is at fault: the exception carries it as .field */
    PyObject *exc = PyObject_CallOneArg(type, text);
    Py_DECREF(text);
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

int cv_py_add_errors(PyObject *m, cv_py_core_state *st) {
    /* ConveyorError first: every other kind derives from it and from its builtin base */
    for (int k = 0; k < CV_PY_EXC_KINDS; k++) {
        PyObject *bases = NULL;
        if (k != CV_PY_EXC_BASE && !(bases = PyTuple_Pack(2, st->errors[CV_PY_EXC_BASE], builtin_base(k))))
            return -1;
        st->errors[k] = new_error(m, error_names[k], bases, error_docs[k]);
        Py_XDECREF(bases);
        if (!st->errors[k]) return -1;
    }
    return 0;
}

int cv_py_add_core_errors(PyObject *m) {
    PyObject *core = PyImport_ImportModule(CORE_MODULE);
    if (!core) return -1;
    const cv_py_core_state *st = core_state();
    Py_DECREF(core);
    if (!st) {
        PyErr_SetString(PyExc_ImportError, CORE_MODULE " is not Conveyor's core module");
        return -1;
    }
    for (int k = 0; k < CV_PY_EXC_KINDS; k++)
        if (PyModule_AddObjectRef(m, error_names[k], st->errors[k]) < 0) return -1;
    return 0;
}
