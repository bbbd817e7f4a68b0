/* kernel_info(): which kernels run here (CPU features, the SIMD level chosen,
 * the path of each kernel family, the build's flags), for the package's
 * reports (conveyor bench, the tests) and for users asking what runs. */
#include "binding.h"

#include "../../kernels/cpu/cpu_backend.h"
#include "../../kernels/cpu/cpu_features.h"

/* {feature: bool} of the CPU. */
static PyObject *features_dict(void) {
    const cv_cpu_features *f = cv_cpu_features_get();
    return Py_BuildValue("{s:N,s:N,s:N,s:N,s:N,s:N,s:N,s:N,s:N,s:N,s:N}", "avx2", PyBool_FromLong(f->avx2),
                         "fma", PyBool_FromLong(f->fma), "f16c", PyBool_FromLong(f->f16c), "avx512f",
                         PyBool_FromLong(f->avx512f), "avx512bw", PyBool_FromLong(f->avx512bw), "avx512vl",
                         PyBool_FromLong(f->avx512vl), "avx512dq", PyBool_FromLong(f->avx512dq),
                         "avx512bf16", PyBool_FromLong(f->avx512bf16), "avx512vnni",
                         PyBool_FromLong(f->avx512vnni), "avxvnni", PyBool_FromLong(f->avxvnni),
                         "os_avx512", PyBool_FromLong(f->os_avx512));
}

/* {family: path} of the kernels at level. */
static PyObject *paths_dict(cv_simd_level level) {
    PyObject *d = PyDict_New();
    if (!d) return NULL;
    for (int i = 0; i < cv_cpu_family_count(); i++) {
        PyObject *v = PyUnicode_FromString(cv_simd_name(cv_cpu_family_path(i, level)));
        if (!v || PyDict_SetItemString(d, cv_cpu_family_name(i), v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(d);
            return NULL;
        }
        Py_DECREF(v);
    }
    return d;
}

#ifndef CV_BUILD_MARCH
#define CV_BUILD_MARCH "unknown"
#endif
#ifdef CV_EMULATE_AVX512
#define CV_EMULATED 1 /* development build: SIMD intrinsics in portable C */
#else
#define CV_EMULATED 0
#endif
#ifdef __AVX2__
#define CV_BASELINE_AVX2 1 /* the whole module may use AVX2 (built with -march) */
#else
#define CV_BASELINE_AVX2 0
#endif

static PyObject *py_kernel_info(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    cv_simd_level level;
    const char *asked = NULL;
    const int rc = cv_simd_from_env(&level, &asked);
    const int supported[CV_SIMD_LEVELS] = {cv_simd_supported(CV_SIMD_SCALAR), cv_simd_supported(CV_SIMD_AVX2),
                                           cv_simd_supported(CV_SIMD_AVX512),
                                           cv_simd_supported(CV_SIMD_AVX512_BF16)};
    PyObject *levels = PyList_New(0);
    for (int l = 0; levels && l < CV_SIMD_LEVELS; l++) {
        if (!supported[l]) continue;
        PyObject *nm = PyUnicode_FromString(cv_simd_name((cv_simd_level)l));
        if (!nm || PyList_Append(levels, nm) < 0) Py_CLEAR(levels);
        Py_XDECREF(nm);
    }
    PyObject *feat = features_dict(), *paths = paths_dict(level);
    const cv_cpu_shapes shapes = cv_cpu_backend_shapes();
    PyObject *r = NULL;
    if (levels && feat && paths)
        r = Py_BuildValue("{s:s,s:s,s:O,s:O,s:O,s:z,s:s,s:O,s:O,s:i,s:i,s:i,s:i,s:O,s:s}", "simd", cv_simd_name(level),
                          "best", cv_simd_name(cv_simd_best()), "levels", levels, "cpu_features", feat,
                          "paths", paths, "simd_error",
                          rc == CV_SIMD_OK ? NULL : (rc == CV_SIMD_UNKNOWN ? "unknown level" : "unsupported level"),
                          "build_march", CV_BUILD_MARCH, "baseline_avx2", CV_BASELINE_AVX2 ? Py_True : Py_False,
                          "emulated", CV_EMULATED ? Py_True : Py_False,
                          "cores", cv_cpu_backend_cores(), "gemm_nr", shapes.gemm_nr, "gemm_mr", shapes.gemm_mr,
                          "attention_max_head_dim", shapes.attention_max_head_dim, "force_scalar",
                          level == CV_SIMD_SCALAR ? Py_True : Py_False, "quant_level",
                          cv_qlevel_name(cv_qlevel_best((int)level)));
    Py_XDECREF(levels);
    Py_XDECREF(feat);
    Py_XDECREF(paths);
    return r;
}

static PyMethodDef kernel_info_methods[] = {
    {"kernel_info", (PyCFunction)py_kernel_info, METH_NOARGS, "kernel_info() -> dict: CPU features, the SIMD level chosen (simd), the best, the\n"
     "levels this CPU runs, the path of each kernel family (paths), and the quantized GEMMs'\n"
     "level (quant_level: avx512vnni packs 16-row panels)"},
    {NULL, NULL, 0, NULL},
};

int cv_py_add_kernel_info(PyObject *m) { return PyModule_AddFunctions(m, kernel_info_methods); }
