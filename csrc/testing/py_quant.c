/* Test hooks of the quantized CPU kernels (kernels/cpu/quant.c):
 *
 *   kernel_quantize(w, qtype) -> uint8 [rows][row_bytes]   the C quantizer
 *   kernel_qgemm(x, w_bytes, qtype, level="best", bias=None, accumulate=None, threads=0, compute=None)
 *       -> x[n][cols] . dequant(W)^T with activations quantized per block of 32
 *       (qtype any stored block format: the GGUF Q5/K ones are repacked into
 *       the type the kernels compute them in, as the model loader does;
 *       compute "q8_f32" / "q8_m32": into the form of a mixed stack instead)
 *   kernel_qgemm_time(x, w_bytes, qtype, level="best", threads=0, repeats=10) -> best seconds
 *       of one GEMM on the matrix prepared once (the benchmark's kernel-only figure)
 *   kernel_dequantize(w_bytes, qtype, repacked=False, compute=None) -> float32 [rows][cols]
 *       the C dequantizer; repacked: of the blocks repacked for the kernels
 *       (compute: into that form, as kernel_qgemm)
 *   kernel_qlevels() -> {"scalar": True, "avx2": ..., "avx512vnni": ..., "avxvnni": ...,
 *                        "best": the level the CPU backend uses}
 *
 * A level the CPU lacks raises conveyor.UnsupportedError naming it. One
 * backend per thread count, kept for the life of the process, each with a
 * lock taken with the GIL released. */
#include "../binding/arrays.h"

#include <string.h>

#include "../../kernels/backend.h"
#include "../../kernels/cpu/cpu_backend.h"
#include "../../base/quant_format.h"

#define QB_MAX_THREADS 64

static struct {
    cv_backend *b;
    PyThread_type_lock lock;
} g_qb[QB_MAX_THREADS + 1];

static int get_qbackend(int threads) {
    if (threads < 0 || threads > QB_MAX_THREADS) {
        PyErr_Format(PyExc_ValueError, "threads must be in 0..%d (0: all cores), got %d", QB_MAX_THREADS, threads);
        return -1;
    }
    if (g_qb[threads].b) return 0;
    cv_err err = {0};
    cv_backend *b = cv_cpu_backend_create(threads, 0, &err);
    if (!b) {
        cv_py_raise(&err);
        return -1;
    }
    PyThread_type_lock lock = PyThread_allocate_lock();
    if (!lock) {
        b->destroy(b);
        PyErr_NoMemory();
        return -1;
    }
    g_qb[threads].b = b;
    g_qb[threads].lock = lock;
    return 0;
}

/* Any stored block format by its lower-case name (q8_0 ... q6_k). */
static int parse_stored_qtype(const char *s, cv_dtype *out) {
    for (int t = CV_Q8_0; t <= CV_Q2_K; t++)
        if ((t <= CV_Q3_K || t == CV_Q2_K) && strcmp(s, cv_dtype_name((cv_dtype)t)) == 0) {
            *out = (cv_dtype)t;
            return 0;
        }
    PyErr_Format(PyExc_ValueError,
                 "qtype must be one of q8_0, q4_0, q4_1, q5_0, q5_1, q2_k, q3_k, q4_k, q5_k, q6_k; got '%s'", s);
    return -1;
}

/* The form a stored type is computed in: its own (NULL), or "q8_f32" / "q8_m32"
 * (the forms of mixed stacks; Q2_K fits only the latter). */
static int parse_compute(const char *s, cv_dtype stored, cv_dtype *out) {
    *out = cv_quant_compute_type(stored);
    if (!s) return 0;
    if (strcmp(s, "q8_m32") == 0 || (strcmp(s, "q8_f32") == 0 && stored != CV_Q2_K)) {
        *out = strcmp(s, "q8_m32") == 0 ? CV_Q8_M : CV_Q8_F;
        return 0;
    }
    PyErr_Format(PyExc_ValueError, "compute must be None, 'q8_f32' (not for q2_k) or 'q8_m32', got '%s'", s);
    return -1;
}

static int parse_level(const char *s, cv_qlevel *out) {
    if (strcmp(s, "best") == 0) {
        *out = cv_qlevel_best((int)cv_simd_best());
        return 0;
    }
    for (int l = CV_QL_SCALAR; l <= CV_QL_AVXVNNI; l++)
        if (strcmp(s, cv_qlevel_name((cv_qlevel)l)) == 0) {
            if (!cv_qlevel_supported((cv_qlevel)l)) {
                cv_err e;
                cv_set_err(&e, CV_ERR_UNSUPPORTED, "this CPU cannot run the %s kernels", s);
                cv_py_raise(&e);
                return -1;
            }
            *out = (cv_qlevel)l;
            return 0;
        }
    PyErr_Format(PyExc_ValueError, "level must be 'best', 'scalar', 'avx2', 'avx512vnni' or 'avxvnni', got '%s'", s);
    return -1;
}

static PyObject *py_kernel_quantize(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kwlist[] = {"w", "qtype", NULL};
    PyObject *w_obj;
    const char *qs;
    cv_dtype qt;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "Os", kwlist, &w_obj, &qs) || cv_py_parse_quantization(qs, &qt) < 0)
        return NULL;
    PyArrayObject *w = cv_py_want_array(w_obj, "w", NPY_FLOAT32, 2, 0);
    if (!w) return NULL;
    const npy_intp rows = PyArray_DIM(w, 0), cols = PyArray_DIM(w, 1);
    if (cols % CV_QK != 0) return PyErr_Format(PyExc_ValueError, "w must have a multiple of %d columns", CV_QK);
    const float *src = PyArray_DATA(w);
    for (npy_intp i = 0; i < rows * cols; i++)
        if (!(src[i] - src[i] == 0.0f)) return PyErr_Format(PyExc_ValueError, "w holds a non-finite value");
    npy_intp dims[2] = {rows, (npy_intp)cv_dtype_bytes(qt, (size_t)cols)};
    PyObject *out = PyArray_SimpleNew(2, dims, NPY_UINT8);
    if (!out) return NULL;
    unsigned char *dst = PyArray_DATA((PyArrayObject *)out);
    for (npy_intp r = 0; r < rows; r++) cv_quantize(dst + r * dims[1], src + r * cols, qt, (size_t)cols);
    return out;
}

static PyObject *py_kernel_qgemm(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kwlist[] = {"x", "w_bytes", "qtype", "level", "bias", "accumulate", "threads", "compute", NULL};
    PyObject *x_obj, *w_obj, *bias = Py_None, *acc = Py_None;
    const char *qs, *ls = "best", *cs = NULL;
    int threads = 0;
    cv_dtype qt, ct;
    cv_qlevel level;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOs|sOOiz", kwlist, &x_obj, &w_obj, &qs, &ls, &bias, &acc,
                                     &threads, &cs) ||
        parse_stored_qtype(qs, &qt) < 0 || parse_compute(cs, qt, &ct) < 0 || parse_level(ls, &level) < 0 ||
        get_qbackend(threads) < 0)
        return NULL;
    PyArrayObject *w = cv_py_want_array(w_obj, "w_bytes", NPY_UINT8, 2, 0);
    PyArrayObject *x = w ? cv_py_want_array(x_obj, "x", NPY_FLOAT32, 2, 0) : NULL;
    if (!x) return NULL;
    const int64_t rows = PyArray_DIM(w, 0), cols = PyArray_DIM(x, 1);
    const int64_t blk = (int64_t)cv_quant_block_elems(qt);
    if (cols <= 0 || cols % blk != 0 || (size_t)PyArray_DIM(w, 1) != cv_dtype_bytes(qt, (size_t)cols))
        return PyErr_Format(PyExc_ValueError, "w_bytes must be [rows][%zu] (%s rows of %lld columns)",
                            cv_dtype_bytes(qt, (size_t)(cols > 0 ? cols : 0)), qs, (long long)cols);
    cv_py_gemm_args a;
    if (cv_py_want_gemm_args(&a, x_obj, bias, acc, rows, cols) < 0) return NULL;
    cv_backend *b = g_qb[threads].b;
    cv_matrix m;
    cv_err err = {0};
    int rc = 0;
    float *o = PyArray_DATA((PyArrayObject *)a.out);
    const float *xp = PyArray_DATA(a.x);
    const void *src = PyArray_DATA(w);
    CV_PY_RUN_LOCKED(g_qb[threads].lock, {
        rc = b->matrix_prepare(b, &m, src, qt, rows, cols, ct, &err);
        if (rc == 0) {
            cv_cpu_qgemm_level(b, o, xp, a.n, &m, a.bias, a.accumulate, level);
            b->matrix_free(b, &m);
        }
    });
    if (rc < 0) {
        Py_DECREF(a.out);
        return cv_py_raise(&err);
    }
    return a.out;
}

static PyObject *py_kernel_qgemm_time(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kwlist[] = {"x", "w_bytes", "qtype", "level", "threads", "repeats", NULL};
    PyObject *x_obj, *w_obj;
    const char *qs, *ls = "best";
    int threads = 0, repeats = 10;
    cv_dtype qt;
    cv_qlevel level;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOs|sii", kwlist, &x_obj, &w_obj, &qs, &ls, &threads, &repeats) ||
        parse_stored_qtype(qs, &qt) < 0 || parse_level(ls, &level) < 0 || get_qbackend(threads) < 0)
        return NULL;
    if (repeats < 1) return PyErr_Format(PyExc_ValueError, "repeats must be >= 1, got %d", repeats);
    PyArrayObject *w = cv_py_want_array(w_obj, "w_bytes", NPY_UINT8, 2, 0);
    PyArrayObject *x = w ? cv_py_want_array(x_obj, "x", NPY_FLOAT32, 2, 0) : NULL;
    if (!x) return NULL;
    const int64_t rows = PyArray_DIM(w, 0), n = PyArray_DIM(x, 0), cols = PyArray_DIM(x, 1);
    const int64_t blk = (int64_t)cv_quant_block_elems(qt);
    if (n <= 0 || cols <= 0 || cols % blk != 0 || (size_t)PyArray_DIM(w, 1) != cv_dtype_bytes(qt, (size_t)cols))
        return PyErr_Format(PyExc_ValueError, "w_bytes must be [rows][%zu] (%s rows of %lld columns)",
                            cv_dtype_bytes(qt, (size_t)(cols > 0 ? cols : 0)), qs, (long long)cols);
    float *out = PyMem_Malloc((size_t)(n * rows) * sizeof(float));
    if (!out) return PyErr_NoMemory();
    cv_backend *b = g_qb[threads].b;
    cv_matrix m;
    cv_err err = {0};
    int rc = 0;
    double best = 1e300;
    const float *xp = PyArray_DATA(x);
    const void *src = PyArray_DATA(w);
    CV_PY_RUN_LOCKED(g_qb[threads].lock, {
        rc = b->matrix_prepare(b, &m, src, qt, rows, cols, cv_quant_compute_type(qt), &err);
        if (rc == 0) {
            for (int r = 0; r < repeats; r++) {
                const double t0 = cv_now();
                cv_cpu_qgemm_level(b, out, xp, n, &m, NULL, 0, level);
                const double t = cv_now() - t0;
                best = t < best ? t : best;
            }
            b->matrix_free(b, &m);
        }
    });
    PyMem_Free(out);
    if (rc < 0) return cv_py_raise(&err);
    return PyFloat_FromDouble(best);
}

static PyObject *py_kernel_dequantize(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kwlist[] = {"w_bytes", "qtype", "repacked", "compute", NULL};
    PyObject *w_obj;
    const char *qs, *cs = NULL;
    int repacked = 0;
    cv_dtype qt, ct;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "Os|pz", kwlist, &w_obj, &qs, &repacked, &cs) ||
        parse_stored_qtype(qs, &qt) < 0 || parse_compute(cs, qt, &ct) < 0)
        return NULL;
    if (cs) repacked = 1;
    PyArrayObject *w = cv_py_want_array(w_obj, "w_bytes", NPY_UINT8, 2, 0);
    if (!w) return NULL;
    const size_t bb = cv_quant_block_bytes(qt), be = cv_quant_block_elems(qt);
    const npy_intp rows = PyArray_DIM(w, 0), row_bytes = PyArray_DIM(w, 1);
    if (row_bytes <= 0 || (size_t)row_bytes % bb != 0)
        return PyErr_Format(PyExc_ValueError, "w_bytes rows must be whole %s blocks (%zu bytes), got %lld bytes", qs,
                            bb, (long long)row_bytes);
    const size_t cols = (size_t)row_bytes / bb * be;
    npy_intp dims[2] = {rows, (npy_intp)cols};
    PyObject *out = PyArray_SimpleNew(2, dims, NPY_FLOAT32);
    void *tmp = repacked ? malloc(cv_dtype_bytes(ct, cols)) : NULL;
    if (!out || (repacked && !tmp)) {
        Py_XDECREF(out);
        free(tmp);
        return PyErr_NoMemory();
    }
    const unsigned char *src = PyArray_DATA(w);
    float *dst = PyArray_DATA((PyArrayObject *)out);
    for (npy_intp r = 0; r < rows; r++) {
        const unsigned char *row = src + r * row_bytes;
        if (repacked) {
            cv_quant_repack(tmp, ct, row, qt, cols);
            cv_dequantize(dst + r * (npy_intp)cols, tmp, ct, cols);
        } else {
            cv_dequantize(dst + r * (npy_intp)cols, row, qt, cols);
        }
    }
    free(tmp);
    return out;
}

static PyObject *py_kernel_qlevels(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    PyObject *d = PyDict_New();
    for (int l = CV_QL_SCALAR; d && l <= CV_QL_AVXVNNI; l++)
        if (cv_py_put(d, cv_qlevel_name((cv_qlevel)l), PyBool_FromLong(cv_qlevel_supported((cv_qlevel)l))) < 0)
            Py_CLEAR(d);
    if (d && cv_py_put(d, "best", PyUnicode_FromString(cv_qlevel_name(cv_qlevel_best((int)cv_simd_best())))) < 0) Py_CLEAR(d);
    return d;
}

static PyMethodDef quant_methods[] = {
    {"kernel_quantize", (PyCFunction)(void (*)(void))py_kernel_quantize, METH_VARARGS | METH_KEYWORDS,
     "kernel_quantize(w, qtype) -> uint8 [rows][row_bytes]: the C quantizer (q8_0, q4_0, q4_1)"},
    {"kernel_qgemm", (PyCFunction)(void (*)(void))py_kernel_qgemm, METH_VARARGS | METH_KEYWORDS,
     "kernel_qgemm(x, w_bytes, qtype, level='best', bias=None, accumulate=None, threads=0, compute=None) -> out[n][rows]"},
    {"kernel_qgemm_time", (PyCFunction)(void (*)(void))py_kernel_qgemm_time, METH_VARARGS | METH_KEYWORDS,
     "kernel_qgemm_time(x, w_bytes, qtype, level='best', threads=0, repeats=10) -> best seconds of one GEMM"},
    {"kernel_dequantize", (PyCFunction)(void (*)(void))py_kernel_dequantize, METH_VARARGS | METH_KEYWORDS,
     "kernel_dequantize(w_bytes, qtype, repacked=False, compute=None) -> float32 [rows][cols]: the C dequantizer"},
    {"kernel_qlevels", (PyCFunction)py_kernel_qlevels, METH_NOARGS,
     "kernel_qlevels() -> {level: supported} of the quantized kernels, and 'best': the one used"},
    {NULL, NULL, 0, NULL},
};

int cv_py_add_quant(PyObject *m) { return PyModule_AddFunctions(m, quant_methods); }
