/* conveyor._testing: the test and benchmark hooks of the C parts (kernels,
 * quantized formats, CUDA, sampler, scheduler, model forward, the merge list
 * of a GGUF vocabulary), apart from the product module conveyor._core as
 * CPython keeps _testcapi. It is built from the same C core objects and shares
 * the binding's helpers (csrc/binding/); its errors are conveyor._core's
 * exception types. */
#ifndef CV_TESTING_H
#define CV_TESTING_H

#include "../binding/binding.h"

/* Each part registers its types and functions on the module (0 ok, -1 error). */
int cv_py_add_kernels(PyObject *m);      /* py_kernels.c      */
int cv_py_add_quant(PyObject *m);        /* py_quant.c        */
int cv_py_add_cuda(PyObject *m);         /* py_cuda.c         */
int cv_py_add_sampler(PyObject *m);      /* py_sampler.c      */
int cv_py_add_scheduler(PyObject *m);    /* py_scheduler.c    */
int cv_py_add_model(PyObject *m);        /* py_model.c        */
int cv_py_add_score_merges(PyObject *m); /* py_score_merges.c */
int cv_py_add_weight_arena(PyObject *m); /* py_weight_arena.c */

#endif
