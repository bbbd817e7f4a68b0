/* conveyor._core: module init; each part registers its own types and functions. */
#define CV_BINDING_MAIN
#include "binding.h"

static struct PyModuleDef core_module = {
    PyModuleDef_HEAD_INIT, "_core", "Conveyor's C core.", -1, NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__core(void) {
    import_array();
    PyObject *m = PyModule_Create(&core_module);
    if (!m) return NULL;
    if (cv_py_add_errors(m) < 0) goto fail;
    if (cv_py_add_checkpoint(m) < 0 || cv_py_add_kernels(m) < 0 || cv_py_add_scheduler(m) < 0 ||
        cv_py_add_sampler(m) < 0 || cv_py_add_engine(m) < 0 || cv_py_add_request_params(m) < 0 ||
        cv_py_add_cuda(m) < 0 || cv_py_add_model(m) < 0 || cv_py_add_quant(m) < 0)
        goto fail;
#ifdef __AVX2__
    PyModule_AddStringConstant(m, "simd", "avx2");
#else
    PyModule_AddStringConstant(m, "simd", "none");
#endif
    return m;
fail:
    Py_DECREF(m);
    return NULL;
}
