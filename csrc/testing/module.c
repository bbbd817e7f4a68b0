/* conveyor._testing: module init (multi-phase, PEP 489). It loads
 * conveyor._core first and offers its exception types, the same objects. */
#define CV_BINDING_MAIN
#include "testing.h"

static int testing_exec(PyObject *m) {
    /* _import_array(), not import_array(): see csrc/binding/module.c */
    if (_import_array() < 0) return -1;
    if (cv_py_add_core_errors(m) < 0) return -1;
    if (cv_py_add_kernels(m) < 0 || cv_py_add_quant(m) < 0 || cv_py_add_cuda(m) < 0 ||
        cv_py_add_sampler(m) < 0 || cv_py_add_scheduler(m) < 0 || cv_py_add_model(m) < 0 ||
        cv_py_add_score_merges(m) < 0 || cv_py_add_weight_arena(m) < 0)
        return -1;
    return 0;
}

static PyModuleDef_Slot testing_slots[] = {
    {Py_mod_exec, testing_exec},
#ifdef Py_mod_multiple_interpreters
    {Py_mod_multiple_interpreters, Py_MOD_MULTIPLE_INTERPRETERS_NOT_SUPPORTED},
#endif
    {0, NULL},
};

static struct PyModuleDef testing_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "conveyor._testing",
    .m_doc = "Test and benchmark hooks of Conveyor's C parts (not a public API).",
    .m_size = 0,
    .m_slots = testing_slots,
};

PyMODINIT_FUNC PyInit__testing(void) { return PyModuleDef_Init(&testing_module); }
