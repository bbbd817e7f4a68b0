/* Shared declarations of the CPython bindings: conveyor._core (the files in
 * csrc/binding/) and conveyor._testing (csrc/testing/), which also links the
 * helpers here (arrays.c, errors.c). The bindings see only the public C API of
 * each part. */
#ifndef CV_BINDING_H
#define CV_BINDING_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define PY_ARRAY_UNIQUE_SYMBOL cv_numpy_api
#ifndef CV_BINDING_MAIN
#define NO_IMPORT_ARRAY
#endif
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>

#include "../../base/common.h"

/* Conveyor's exception types. They live in the module state of conveyor._core
 * (created once per module object, by multi-phase init) and are its attributes;
 * conveyor._testing hands out the same objects, so `except conveyor.X` catches
 * them whichever module raised. cv_py_error(kind) finds them from anywhere in
 * either module (a borrowed reference; never NULL: without conveyor._core
 * loaded it answers the builtin base of the kind, ValueError or RuntimeError). */
typedef enum cv_py_error_kind {
    CV_PY_EXC_BASE,              /* ConveyorError: base class of all conveyor errors */
    CV_PY_EXC_MODEL_FORMAT,      /* ModelFormatError: malformed model file (also a ValueError) */
    CV_PY_EXC_UNSUPPORTED,       /* UnsupportedError: valid but unsupported (also a ValueError) */
    CV_PY_EXC_ENGINE_CLOSED,     /* EngineClosedError: use after close (also a RuntimeError) */
    CV_PY_EXC_ENGINE_OVERLOADED, /* EngineOverloadedError: the request queue is full (also a RuntimeError) */
    CV_PY_EXC_ENGINE_BUSY,       /* EngineBusyError: the background loop runs (also a RuntimeError) */
    CV_PY_EXC_KINDS
} cv_py_error_kind;
PyObject *cv_py_error(cv_py_error_kind kind);
/* the names the parts raise with */
#define cv_ConveyorError cv_py_error(CV_PY_EXC_BASE)
#define cv_ModelFormatError cv_py_error(CV_PY_EXC_MODEL_FORMAT)
#define cv_UnsupportedError cv_py_error(CV_PY_EXC_UNSUPPORTED)
#define cv_EngineClosedError cv_py_error(CV_PY_EXC_ENGINE_CLOSED)
#define cv_EngineOverloadedError cv_py_error(CV_PY_EXC_ENGINE_OVERLOADED)
#define cv_EngineBusyError cv_py_error(CV_PY_EXC_ENGINE_BUSY)

/* The module state of conveyor._core: the exception types, [cv_py_error_kind]. */
typedef struct cv_py_core_state {
    PyObject *errors[CV_PY_EXC_KINDS];
} cv_py_core_state;
/* Creates the exception types into st and adds them to m (0 ok, -1 error). */
int cv_py_add_errors(PyObject *m, cv_py_core_state *st);
/* Adds the exception types of a loaded conveyor._core to m (conveyor._testing). */
int cv_py_add_core_errors(PyObject *m);

/* Raises the Python exception for a C status code with err's message and
 * returns NULL; when err->field is set the exception's .field attribute
 * names the request or engine config field at fault. */
PyObject *cv_py_raise(const cv_err *err);

/* Creates the heap type of spec (tied to module m) and adds it to m under its
 * short name ("conveyor._core.Engine" -> Engine); 0 ok, -1 error. Every
 * type's tp_dealloc frees the instance and then drops its reference to the
 * type, as heap types require. */
static inline int cv_py_add_type(PyObject *m, PyType_Spec *spec) {
    PyObject *type = PyType_FromModuleAndSpec(m, spec, NULL);
    const int rc = type ? PyModule_AddType(m, (PyTypeObject *)type) : -1;
    Py_XDECREF(type);
    return rc;
}

/* The flags of every conveyor._core and conveyor._testing class: like the static types they
 * replaced, they are neither subclassable nor mutable. No Py_TPFLAGS_HAVE_GC:
 * no instance holds a reference that could be part of a cycle. */
#define CV_PY_TYPE_FLAGS (Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE)

/* Each part of conveyor._core registers its types and functions on the module
 * (0 ok, -1 error); the test hooks of conveyor._testing are in csrc/testing/. */
int cv_py_add_checkpoint(PyObject *m);  /* py_checkpoint.c  */
int cv_py_add_engine(PyObject *m);      /* py_engine.c      */
int cv_py_add_request_params(PyObject *m); /* request_params.c */
int cv_py_add_gguf(PyObject *m);        /* py_gguf.c        */
int cv_py_add_kernel_info(PyObject *m); /* py_kernel_info.c */
int cv_py_add_tokenizer(PyObject *m);   /* py_tokenizer.c   */
int cv_py_add_json_scan(PyObject *m);   /* py_json_scan.c   */
int cv_py_add_llama2c_tokenizer(PyObject *m); /* py_llama2c_tokenizer.c */

/* A GGUF file's key/values as a dict in file order (py_gguf.c). */
struct cv_gguf_file;
PyObject *cv_py_gguf_metadata(const struct cv_gguf_file *f);

#endif
