/* conveyor._core: module init; each part registers its own types and functions. */
#define CV_BINDING_MAIN
#include "binding.h"
#include "../../kernels/cpu/cpu_features.h"

static struct PyModuleDef core_module = {
    PyModuleDef_HEAD_INIT, "_core", "Conveyor's C core.", -1, NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__core(void) {
    /* Not the import_array() macro: it prints the error and replaces it with an ImportError,
     * which turns a Ctrl-C during NumPy's import into a traceback instead of KeyboardInterrupt. */
    if (_import_array() < 0) return NULL;
    PyObject *m = PyModule_Create(&core_module);
    if (!m) return NULL;
    if (cv_py_add_errors(m) < 0) goto fail;
    if (cv_py_add_checkpoint(m) < 0 || cv_py_add_kernels(m) < 0 || cv_py_add_scheduler(m) < 0 ||
        cv_py_add_sampler(m) < 0 || cv_py_add_engine(m) < 0 || cv_py_add_request_params(m) < 0 ||
        cv_py_add_cuda(m) < 0 || cv_py_add_model(m) < 0 || cv_py_add_quant(m) < 0 ||
        cv_py_add_gguf(m) < 0)
        goto fail;
    if (cv_py_add_tokenizer(m) < 0) goto fail;
    /* the kernel path chosen at run time (CONVEYOR_SIMD, else the CPU's best) */
    cv_simd_level level;
    if (cv_simd_from_env(&level, NULL) != CV_SIMD_OK) level = cv_simd_best();
    PyModule_AddStringConstant(m, "simd", cv_simd_name(level));
    return m;
fail:
    Py_DECREF(m);
    return NULL;
}
