/* Shared declarations of the CPython binding (the files in csrc/binding/).
 * The binding sees only the public C API of each part. */
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

#include "../../kernels/common.h"

/* Exception types (module attributes of conveyor._core). They stay process
 * globals rather than module state: the module is single-phase (m_size -1,
 * loaded once per process, no subinterpreter support), and cv_py_raise is
 * called from every helper without a module object at hand, so module state
 * would mean threading the module through every call for no gain. */
extern PyObject *cv_ConveyorError;      /* base class of all conveyor errors */
extern PyObject *cv_ModelFormatError;   /* malformed model file (also a ValueError) */
extern PyObject *cv_UnsupportedError;   /* valid but unsupported (also a ValueError) */
extern PyObject *cv_EngineClosedError;  /* use after close (also a RuntimeError) */
extern PyObject *cv_EngineOverloadedError; /* the request queue is full (also a RuntimeError) */
extern PyObject *cv_EngineBusyError;    /* the background loop runs (also a RuntimeError) */

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

/* The flags of every conveyor._core class: like the static types they
 * replaced, they are neither subclassable nor mutable. No Py_TPFLAGS_HAVE_GC:
 * no instance holds a reference that could be part of a cycle. */
#define CV_PY_TYPE_FLAGS (Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE)

/* Each part registers its types and functions on the module (0 ok, -1 error). */
int cv_py_add_errors(PyObject *m);     /* errors.c: the exception types */
int cv_py_add_checkpoint(PyObject *m); /* py_checkpoint.c */
int cv_py_add_kernels(PyObject *m);    /* py_kernels.c   */
int cv_py_add_scheduler(PyObject *m);  /* py_scheduler.c */
int cv_py_add_sampler(PyObject *m);    /* py_sampler.c   */
int cv_py_add_engine(PyObject *m);     /* py_engine.c    */
int cv_py_add_request_params(PyObject *m); /* request_params.c */
int cv_py_add_cuda(PyObject *m);       /* py_cuda.c      */
int cv_py_add_model(PyObject *m);      /* py_model.c     */
int cv_py_add_quant(PyObject *m);      /* py_quant.c     */
int cv_py_add_gguf(PyObject *m);       /* py_gguf.c      */

/* A GGUF file's key/values as a dict in file order (py_gguf.c). */
struct cv_gguf_file;
PyObject *cv_py_gguf_metadata(const struct cv_gguf_file *f);

#endif
