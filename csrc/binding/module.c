/* conveyor._core, the product module: module init (multi-phase, PEP 489); each
 * part registers its own types and functions. The exception types are module
 * state. Test and benchmark hooks are in conveyor._testing (csrc/testing/). */
#define CV_BINDING_MAIN
#include "binding.h"
#include "../../kernels/cpu/cpu_features.h"

static int core_exec(PyObject *m) {
    /* Not the import_array() macro: it prints the error and replaces it with an ImportError,
     * which turns a Ctrl-C during NumPy's import into a traceback instead of KeyboardInterrupt. */
    if (_import_array() < 0) return -1;
    cv_py_core_state *st = PyModule_GetState(m);
    if (!st || cv_py_add_errors(m, st) < 0) return -1;
    if (cv_py_add_checkpoint(m) < 0 || cv_py_add_engine(m) < 0 || cv_py_add_request_params(m) < 0 ||
        cv_py_add_gguf(m) < 0 || cv_py_add_kernel_info(m) < 0 ||
        cv_py_add_tokenizer(m) < 0 || cv_py_add_json_scan(m) < 0 ||
        cv_py_add_llama2c_tokenizer(m) < 0)
        return -1;
    /* the kernel path chosen at run time (CONVEYOR_SIMD, else the CPU's best) */
    cv_simd_level level;
    if (cv_simd_from_env(&level, NULL) != CV_SIMD_OK) level = cv_simd_best();
    return PyModule_AddStringConstant(m, "simd", cv_simd_name(level));
}

static int core_traverse(PyObject *m, visitproc visit, void *arg) {
    cv_py_core_state *st = PyModule_GetState(m);
    for (int k = 0; st && k < CV_PY_EXC_KINDS; k++) Py_VISIT(st->errors[k]);
    return 0;
}

static int core_clear(PyObject *m) {
    cv_py_core_state *st = PyModule_GetState(m);
    for (int k = 0; st && k < CV_PY_EXC_KINDS; k++) Py_CLEAR(st->errors[k]);
    return 0;
}

static void core_free(void *m) { core_clear((PyObject *)m); }

static PyModuleDef_Slot core_slots[] = {
    {Py_mod_exec, core_exec},
#ifdef Py_mod_multiple_interpreters
    /* the C parts keep process-wide state (NumPy's API table, the kernels' thread pools) */
    {Py_mod_multiple_interpreters, Py_MOD_MULTIPLE_INTERPRETERS_NOT_SUPPORTED},
#endif
    {0, NULL},
};

static struct PyModuleDef core_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "conveyor._core", /* errors.c finds the module state by this name */
    .m_doc = "Conveyor's C core.",
    .m_size = sizeof(cv_py_core_state),
    .m_slots = core_slots,
    .m_traverse = core_traverse,
    .m_clear = core_clear,
    .m_free = core_free,
};

PyMODINIT_FUNC PyInit__core(void) { return PyModuleDef_Init(&core_module); }
