/* Binding of the kernels part: test and benchmark hooks on conveyor._testing,
 * named kernel_*, that run one CPU-backend kernel on NumPy arrays.
 *
 * Every hook takes impl="simd" or "plain" and threads (0: all cores). The
 * backends are created on first use, one per (impl, threads), and kept for the
 * life of the process (never freed: prepared matrices may outlive any module
 * teardown, and the sleeping workers cost nothing). A backend runs one kernel
 * at a time: each has a lock taken with the GIL released. Inputs are checked
 * (dtype, shape, contiguity, index ranges) so no call can crash: wrong dtype
 * raises TypeError, wrong shape or values ValueError. */
#include "../binding/arrays.h"

#include <string.h>

#include "../../kernels/backend.h"
#include "../../kernels/cpu/cpu_backend.h"

#define KB_MAX_THREADS 256

typedef struct kb_entry {
    cv_backend *b;
    PyThread_type_lock lock;
} kb_entry;

/* impl names: "simd" is the level the environment chooses (CONVEYOR_SIMD, else
 * the best), "plain" the plain-C kernels; the others name one SIMD level. */
static const char *const g_impls[] = {"simd", "plain", "scalar", "avx2", "avx512", "avx512_bf16"};
#define KB_IMPLS ((int)(sizeof g_impls / sizeof g_impls[0]))
static kb_entry g_kb[KB_IMPLS][KB_MAX_THREADS + 1]; /* [impl][threads] */

static kb_entry *get_backend(const char *impl, int threads) {
    int ii = -1;
    for (int i = 0; i < KB_IMPLS; i++)
        if (strcmp(impl, g_impls[i]) == 0) ii = i;
    if (ii < 0) {
        PyErr_Format(PyExc_ValueError,
                     "impl must be 'simd', 'plain', 'scalar', 'avx2', 'avx512' or 'avx512_bf16', got '%s'",
                     impl);
        return NULL;
    }
    if (threads < 0 || threads > KB_MAX_THREADS) {
        PyErr_Format(PyExc_ValueError, "threads must be in 0..%d (0: all cores), got %d",
                     KB_MAX_THREADS, threads);
        return NULL;
    }
    kb_entry *e = &g_kb[ii][threads];
    if (!e->b) {
        cv_err err = {0};
        cv_backend *b = cv_cpu_backend_create_simd(threads, ii == 0 ? NULL : (ii == 1 ? "scalar" : impl), &err);
        if (!b) return (kb_entry *)cv_py_raise(&err);
        PyThread_type_lock lock = PyThread_allocate_lock();
        if (!lock) {
            b->destroy(b);
            PyErr_NoMemory();
            return NULL;
        }
        e->b = b;
        e->lock = lock;
    }
    return e;
}

/* Runs the statement(s) with the GIL released and the backend's lock held. */
#define KB_RUN(E, ...) CV_PY_RUN_LOCKED((E)->lock, __VA_ARGS__)

/* ------------------------------------------------------------------------ */
/* GEMM and prepared matrices                                                */

#define MATRIX_CAPSULE "conveyor.kernel_matrix"

typedef struct kb_matrix {
    kb_entry *e;
    cv_matrix m;
} kb_matrix;

static void matrix_capsule_free(PyObject *cap) {
    kb_matrix *km = PyCapsule_GetPointer(cap, MATRIX_CAPSULE);
    if (!km) {
        PyErr_Clear();
        return;
    }
    km->e->b->matrix_free(km->e->b, &km->m);
    PyMem_Free(km);
}

/* Builds a prepared matrix from w[rows][cols] (any dtype of cv_py_want_source); NULL on error. */
static PyObject *make_matrix(PyObject *w_obj, const char *wdt, const char *impl, int threads) {
    kb_entry *e = get_backend(impl, threads);
    if (!e) return NULL;
    cv_dtype dt, st;
    /* q8_0, q4_0, q4_1: the matrix is quantized from float rows */
    if ((wdt[0] == 'q' ? cv_py_parse_quantization(wdt, &dt) : cv_py_parse_dtype(wdt, "weight_dtype", 0, &dt)) < 0)
        return NULL;
    PyArrayObject *w = cv_py_want_matrix(w_obj, "w", 1, &st);
    if (!w) return NULL;
    const int64_t rows = PyArray_DIM(w, 0), cols = PyArray_DIM(w, 1);
    kb_matrix *km = PyMem_Calloc(1, sizeof *km);
    if (!km) return PyErr_NoMemory();
    km->e = e;
    cv_err err = {0};
    int rc;
    const void *src = PyArray_DATA(w);
    KB_RUN(e, rc = e->b->matrix_prepare(e->b, &km->m, src, st, rows, cols, dt, &err));
    if (rc < 0) {
        PyMem_Free(km);
        return cv_py_raise(&err);
    }
    PyObject *cap = PyCapsule_New(km, MATRIX_CAPSULE, matrix_capsule_free);
    if (!cap) {
        e->b->matrix_free(e->b, &km->m);
        PyMem_Free(km);
    }
    return cap;
}

/* out = x . W^T (+ bias) (+ accumulate) with a prepared matrix. */
static PyObject *run_matmul(kb_matrix *km, PyObject *x_obj, PyObject *bias_obj, PyObject *acc_obj) {
    cv_py_gemm_args a;
    if (cv_py_want_gemm_args(&a, x_obj, bias_obj, acc_obj, km->m.rows, km->m.cols) < 0) return NULL;
    if (a.n > 0) {
        float *o = PyArray_DATA((PyArrayObject *)a.out); /* [n][rows] */
        const float *xp = PyArray_DATA(a.x);             /* [n][cols] */
        kb_entry *e = km->e;
        KB_RUN(e, e->b->gemm(e->b, o, xp, a.n, &km->m, a.bias, a.accumulate));
    }
    return a.out;
}

static kb_matrix *get_matrix(PyObject *cap) {
    if (!PyCapsule_IsValid(cap, MATRIX_CAPSULE)) {
        PyErr_SetString(PyExc_TypeError, "mat must come from kernel_matrix()");
        return NULL;
    }
    return PyCapsule_GetPointer(cap, MATRIX_CAPSULE);
}

static PyObject *py_kernel_gemm(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kwlist[] = {"x", "w", "weight_dtype", "bias", "accumulate", "impl", "threads", NULL};
    PyObject *x, *w, *bias = Py_None, *acc = Py_None;
    const char *wdt = "float32", *impl = "simd";
    int threads = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|sOOsi", kwlist, &x, &w, &wdt, &bias, &acc, &impl,
                                     &threads))
        return NULL;
    PyObject *cap = make_matrix(w, wdt, impl, threads);
    if (!cap) return NULL;
    PyObject *out = run_matmul(PyCapsule_GetPointer(cap, MATRIX_CAPSULE), x, bias, acc);
    Py_DECREF(cap);
    return out;
}

static PyObject *py_kernel_matrix(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kwlist[] = {"w", "weight_dtype", "impl", "threads", NULL};
    PyObject *w;
    const char *wdt = "float32", *impl = "simd";
    int threads = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|ssi", kwlist, &w, &wdt, &impl, &threads))
        return NULL;
    return make_matrix(w, wdt, impl, threads);
}

static PyObject *py_kernel_matmul(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kwlist[] = {"mat", "x", "bias", "accumulate", NULL};
    PyObject *cap, *x, *bias = Py_None, *acc = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|OO", kwlist, &cap, &x, &bias, &acc)) return NULL;
    kb_matrix *km = get_matrix(cap);
    if (!km) return NULL;
    return run_matmul(km, x, bias, acc);
}

static PyObject *py_kernel_matmul_time(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kwlist[] = {"mat", "x", "repeats", "warmup", NULL};
    PyObject *cap, *x_obj;
    int repeats = 10, warmup = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|ip", kwlist, &cap, &x_obj, &repeats, &warmup))
        return NULL;
    kb_matrix *km = get_matrix(cap);
    if (!km) return NULL;
    if (repeats < 1) {
        PyErr_SetString(PyExc_ValueError, "repeats must be >= 1");
        return NULL;
    }
    PyArrayObject *x = cv_py_want_array(x_obj, "x", NPY_FLOAT32, 2, 0);
    if (!x) return NULL;
    const int64_t n = PyArray_DIM(x, 0);
    if (PyArray_DIM(x, 1) != km->m.cols || n < 1) {
        PyErr_Format(PyExc_ValueError, "x must have shape [n >= 1][%lld]", (long long)km->m.cols);
        return NULL;
    }
    float *o = PyMem_Malloc((size_t)n * (size_t)km->m.rows * sizeof(float));
    if (!o) return PyErr_NoMemory();
    const float *xp = PyArray_DATA(x);
    kb_entry *e = km->e;
    double best = 0.0;
    KB_RUN(e, {
        if (warmup) e->b->gemm(e->b, o, xp, n, &km->m, NULL, 0);
        for (int r = 0; r < repeats; r++) {
            const double t0 = cv_now();
            e->b->gemm(e->b, o, xp, n, &km->m, NULL, 0);
            const double dt = cv_now() - t0;
            if (r == 0 || dt < best) best = dt;
        }
    });
    PyMem_Free(o);
    return PyFloat_FromDouble(best);
}

/* The fused GEMMs: out = f(src) . W^T (+ bias) (+ accumulate), where src has
 * src_cols = w.cols * (swiglu ? 2 : 1) columns and f is rmsnorm with gain
 * (gain non-NULL) or SwiGLU. */
static PyObject *run_fused_matmul(kb_matrix *km, PyObject *src_obj, PyObject *gain_obj, double eps, int swiglu,
                                  PyObject *bias_obj, PyObject *acc_obj) {
    const int64_t cols = km->m.cols;
    cv_py_gemm_args a;
    if (cv_py_want_gemm_args(&a, src_obj, bias_obj, acc_obj, km->m.rows, swiglu ? 2 * cols : cols) < 0)
        return NULL;
    const float *gain = NULL;
    if (!swiglu) {
        PyArrayObject *g = cv_py_want_array(gain_obj, "weight", NPY_FLOAT32, 1, 0);
        if (!g || PyArray_DIM(g, 0) != cols) {
            if (g) PyErr_Format(PyExc_ValueError, "weight must have %lld entries (the matrix's columns)",
                                (long long)cols);
            Py_DECREF(a.out);
            return NULL;
        }
        gain = PyArray_DATA(g);
    }
    if (a.n == 0) return a.out;
    float *scratch = PyMem_Malloc((size_t)a.n * (size_t)cols * sizeof(float));
    if (!scratch) {
        Py_DECREF(a.out);
        return PyErr_NoMemory();
    }
    float *o = PyArray_DATA((PyArrayObject *)a.out); /* [n][rows] */
    const float *xp = PyArray_DATA(a.x);
    const float fe = (float)eps;
    kb_entry *e = km->e;
    KB_RUN(e, {
        if (swiglu)
            e->b->swiglu_gemm(e->b, o, xp, a.n, &km->m, a.bias, a.accumulate, scratch);
        else
            e->b->rmsnorm_gemm(e->b, o, xp, gain, fe, a.n, &km->m, a.bias, a.accumulate, scratch);
    });
    PyMem_Free(scratch);
    return a.out;
}

static PyObject *py_kernel_rmsnorm_matmul(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kwlist[] = {"mat", "x", "weight", "eps", "bias", "accumulate", NULL};
    PyObject *cap, *x, *g, *bias = Py_None, *acc = Py_None;
    double eps = 1e-5;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO|dOO", kwlist, &cap, &x, &g, &eps, &bias, &acc)) return NULL;
    kb_matrix *km = get_matrix(cap);
    return km ? run_fused_matmul(km, x, g, eps, 0, bias, acc) : NULL;
}

static PyObject *py_kernel_swiglu_matmul(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kwlist[] = {"mat", "gu", "bias", "accumulate", NULL};
    PyObject *cap, *gu, *bias = Py_None, *acc = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|OO", kwlist, &cap, &gu, &bias, &acc)) return NULL;
    kb_matrix *km = get_matrix(cap);
    return km ? run_fused_matmul(km, gu, NULL, 0.0, 1, bias, acc) : NULL;
}

/* ------------------------------------------------------------------------ */
/* Row kernels                                                               */

static PyObject *py_kernel_rmsnorm(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kwlist[] = {"x", "weight", "eps", "impl", "threads", NULL};
    PyObject *x_obj, *w_obj;
    double eps = 1e-5;
    const char *impl = "simd";
    int threads = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|dsi", kwlist, &x_obj, &w_obj, &eps, &impl, &threads))
        return NULL;
    kb_entry *e = get_backend(impl, threads);
    if (!e) return NULL;
    cv_py_norm_args a;
    if (cv_py_want_norm_args(&a, x_obj, w_obj) < 0) return NULL;
    float *o = PyArray_DATA((PyArrayObject *)a.out);         /* [n][dim] */
    const float *xp = PyArray_DATA(a.x), *wp = PyArray_DATA(a.w); /* [n][dim], [dim] */
    const float fe = (float)eps;
    KB_RUN(e, e->b->rmsnorm(e->b, o, xp, wp, a.n, a.dim, fe));
    return a.out;
}

static PyObject *py_kernel_rope(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kwlist[] = {"q", "k", "pos", "inv_freq", "layout", "impl", "threads", NULL};
    PyObject *q_obj, *k_obj, *pos_obj, *f_obj;
    const char *layout = "halves", *impl = "simd";
    int threads = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOO|ssi", kwlist, &q_obj, &k_obj, &pos_obj, &f_obj,
                                     &layout, &impl, &threads))
        return NULL;
    kb_entry *e = get_backend(impl, threads);
    if (!e) return NULL;
    cv_py_rope_args a;
    if (cv_py_want_rope_args(&a, q_obj, k_obj, pos_obj, f_obj, layout) < 0) return NULL;
    const cv_py_rows3 q = a.q, k = a.k;
    KB_RUN(e, e->b->rope(e->b, q.data, q.stride, q.h, k.data, k.stride, k.h, a.pos, q.n, &a.rope));
    Py_RETURN_NONE;
}

static PyObject *py_kernel_swiglu(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kwlist[] = {"gu", "impl", "threads", NULL};
    PyObject *g_obj;
    const char *impl = "simd";
    int threads = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|si", kwlist, &g_obj, &impl, &threads)) return NULL;
    kb_entry *e = get_backend(impl, threads);
    if (!e) return NULL;
    PyArrayObject *gu = cv_py_want_gate_up(g_obj);
    if (!gu) return NULL;
    const int64_t n = PyArray_DIM(gu, 0), two = PyArray_DIM(gu, 1);
    npy_intp dims[2] = {(npy_intp)n, (npy_intp)(two / 2)};
    PyObject *out = cv_py_new_f32(2, dims);
    if (!out) return NULL;
    float *o = PyArray_DATA((PyArrayObject *)out);
    const float *gp = PyArray_DATA(gu);
    KB_RUN(e, e->b->swiglu(e->b, o, gp, n, two / 2));
    return out;
}

static PyObject *py_kernel_embedding(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kwlist[] = {"table", "tokens", "table_dtype", "impl", "threads", NULL};
    PyObject *t_obj, *tok_obj;
    const char *tdt = "float32", *impl = "simd";
    int threads = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|ssi", kwlist, &t_obj, &tok_obj, &tdt, &impl, &threads))
        return NULL;
    kb_entry *e = get_backend(impl, threads);
    if (!e) return NULL;
    cv_dtype dt, st;
    if (cv_py_parse_dtype(tdt, "table_dtype", 0, &dt) < 0) return NULL;
    PyArrayObject *t = cv_py_want_matrix(t_obj, "table", 1, &st);
    PyArrayObject *tok = t ? cv_py_want_tokens(tok_obj, t, 1) : NULL;
    if (!tok) return NULL;
    const int64_t rows = PyArray_DIM(t, 0), cols = PyArray_DIM(t, 1), n = PyArray_DIM(tok, 0);
    const int32_t *tp = PyArray_DATA(tok); /* [n] */
    npy_intp dims[2] = {(npy_intp)n, (npy_intp)cols};
    PyObject *out = cv_py_new_f32(2, dims);
    if (!out) return NULL;
    cv_table table;
    cv_err err = {0};
    int rc;
    const void *src = PyArray_DATA(t);
    float *o = PyArray_DATA((PyArrayObject *)out);
    KB_RUN(e, {
        rc = e->b->table_prepare(e->b, &table, src, st, rows, cols, dt, &err);
        if (rc == CV_OK) {
            e->b->embedding(e->b, o, tp, n, &table);
            e->b->table_free(e->b, &table);
        }
    });
    if (rc < 0) {
        Py_DECREF(out);
        return cv_py_raise(&err);
    }
    return out;
}

/* ------------------------------------------------------------------------ */
/* KV cache and attention                                                    */

static PyObject *py_kernel_kv_write(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kwlist[] = {"k_cache", "v_cache", "k", "v", "slot_mapping", "cache_dtype", "impl",
                             "threads", "k_scale", "v_scale", NULL};
    PyObject *kc_obj, *vc_obj, *k_obj, *v_obj, *s_obj, *ks_obj = Py_None, *vs_obj = Py_None;
    const char *cdt = NULL, *impl = "simd";
    int threads = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOO|zsiOO", kwlist, &kc_obj, &vc_obj, &k_obj, &v_obj,
                                     &s_obj, &cdt, &impl, &threads, &ks_obj, &vs_obj))
        return NULL;
    kb_entry *e = get_backend(impl, threads);
    if (!e) return NULL;
    cv_py_kv_write_args a;
    if (cv_py_want_kv_write_args(&a, kc_obj, vc_obj, k_obj, v_obj, s_obj, cdt, 1) < 0 ||
        cv_py_want_kv_scales(&a.cache, ks_obj, vs_obj, 1) < 0)
        return NULL;
    KB_RUN(e, e->b->kv_write(e->b, &a.cache, a.k.data, a.k.stride, a.v.data, a.v.stride, a.slots, a.k.n));
    Py_RETURN_NONE;
}

static PyObject *py_kernel_rope_kv_write(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kwlist[] = {"q", "k", "v", "pos", "inv_freq", "k_cache", "v_cache", "slot_mapping", "layout",
                             "cache_dtype", "impl", "threads", "k_scale", "v_scale", NULL};
    PyObject *q_obj, *k_obj, *v_obj, *pos_obj, *f_obj, *kc_obj, *vc_obj, *s_obj, *ks_obj = Py_None,
             *vs_obj = Py_None;
    const char *layout = "halves", *cdt = NULL, *impl = "simd";
    int threads = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOOOO|szsiOO", kwlist, &q_obj, &k_obj, &v_obj, &pos_obj, &f_obj,
                                     &kc_obj, &vc_obj, &s_obj, &layout, &cdt, &impl, &threads, &ks_obj, &vs_obj))
        return NULL;
    kb_entry *e = get_backend(impl, threads);
    if (!e) return NULL;
    if (k_obj == Py_None) {
        PyErr_SetString(PyExc_ValueError, "k must be an array (the keys written to the cache)");
        return NULL;
    }
    cv_py_rope_args r;
    cv_py_kv_write_args a;
    if (cv_py_want_rope_args(&r, q_obj, k_obj, pos_obj, f_obj, layout) < 0 ||
        cv_py_want_kv_write_args(&a, kc_obj, vc_obj, k_obj, v_obj, s_obj, cdt, 1) < 0 ||
        cv_py_want_kv_scales(&a.cache, ks_obj, vs_obj, 1) < 0)
        return NULL;
    if (r.q.n != a.k.n) {
        PyErr_Format(PyExc_ValueError, "q has %lld rows, k %lld", (long long)r.q.n, (long long)a.k.n);
        return NULL;
    }
    KB_RUN(e, e->b->rope_kv_write(e->b, r.q.data, r.q.stride, r.q.h, r.k.data, r.k.stride, r.k.h, a.v.data,
                                  a.v.stride, r.pos, r.q.n, &r.rope, &a.cache, a.slots));
    Py_RETURN_NONE;
}

static PyObject *py_kernel_paged_attention(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kwlist[] = {"q", "k_cache", "v_cache", "block_tables", "context_lens", "query_start",
                             "scale", "cache_dtype", "impl", "threads", "window", "k_scale", "v_scale", NULL};
    PyObject *q_obj, *kc_obj, *vc_obj, *bt_obj, *cl_obj, *qs_obj, *scale_obj = Py_None, *ks_obj = Py_None,
             *vs_obj = Py_None;
    const char *cdt = NULL, *impl = "simd";
    int threads = 0;
    long long window = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOO|OzsiLOO", kwlist, &q_obj, &kc_obj, &vc_obj, &bt_obj,
                                     &cl_obj, &qs_obj, &scale_obj, &cdt, &impl, &threads, &window, &ks_obj, &vs_obj))
        return NULL;
    if (window < 0) return PyErr_Format(PyExc_ValueError, "window must be >= 0 (0: none), got %lld", window);
    kb_entry *e = get_backend(impl, threads);
    if (!e) return NULL;
    cv_py_attention_args a;
    if (cv_py_want_attention_args(&a, q_obj, kc_obj, vc_obj, bt_obj, cl_obj, qs_obj, scale_obj, Py_None, cdt,
                                  1, 0, cv_cpu_backend_shapes().attention_max_head_dim) < 0 ||
        cv_py_want_kv_scales(&a.cache, ks_obj, vs_obj, 0) < 0)
        return NULL;
    a.ab.window = window;
    npy_intp dims[2] = {(npy_intp)a.q.n, (npy_intp)(a.q.h * a.q.d)};
    PyObject *out = cv_py_new_f32(2, dims);
    if (!out) return NULL;
    float *o = PyArray_DATA((PyArrayObject *)out); /* [rows][n_heads * head_dim] */
    KB_RUN(e, e->b->paged_attention(e->b, o, a.q.data, a.q.stride, &a.cache, &a.ab));
    return out;
}

/* ------------------------------------------------------------------------ */
/* Bandwidth and info                                                        */

static PyObject *bandwidth_hook(PyObject *args, PyObject *kw, int read_only) {
    static char *kwlist[] = {"n_bytes", "repeats", "threads", NULL};
    long long n_bytes;
    int repeats = 5, threads = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "L|ii", kwlist, &n_bytes, &repeats, &threads)) return NULL;
    if (n_bytes < 4096 || n_bytes > (1LL << 34) || repeats < 1) {
        PyErr_SetString(PyExc_ValueError, "n_bytes (per array) must be in 4 KiB .. 16 GiB, repeats >= 1");
        return NULL;
    }
    kb_entry *e = get_backend("simd", threads);
    if (!e) return NULL;
    double gbs;
    KB_RUN(e, gbs = read_only ? cv_cpu_read_bw(e->b, (size_t)n_bytes, repeats)
                              : cv_cpu_triad(e->b, (size_t)n_bytes, repeats));
    if (gbs < 0) return PyErr_NoMemory();
    return PyFloat_FromDouble(gbs);
}

static PyObject *py_kernel_triad(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    return bandwidth_hook(args, kw, 0);
}

static PyObject *py_kernel_read_bw(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    return bandwidth_hook(args, kw, 1);
}

static PyObject *py_measure_peak(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kwlist[] = {"kind", "threads", "seconds", "impl", NULL};
    static const char *const kinds[] = {"fp32_fma", "bf16_dot", "int8_dot"};
    const char *kind, *impl = "simd";
    int threads = 0;
    double seconds = 0.2;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "s|ids", kwlist, &kind, &threads, &seconds, &impl)) return NULL;
    int k = -1;
    for (int i = 0; i < 3; i++)
        if (strcmp(kind, kinds[i]) == 0) k = i;
    if (k < 0) {
        PyErr_Format(PyExc_ValueError, "kind must be 'fp32_fma', 'bf16_dot' or 'int8_dot', got '%s'", kind);
        return NULL;
    }
    if (!(seconds > 0 && seconds <= 60)) {
        PyErr_SetString(PyExc_ValueError, "seconds must be in (0, 60]");
        return NULL;
    }
    kb_entry *e = get_backend(impl, threads);
    if (!e) return NULL;
    const char *instr = "";
    double gops;
    KB_RUN(e, gops = cv_cpu_measure_peak(e->b, (cv_peak_kind)k, threads, seconds, &instr));
    if (gops < 0) {
        PyErr_SetString(PyExc_RuntimeError, "measure_peak: no time measured");
        return NULL;
    }
    const int nthreads = cv_cpu_backend_threads(e->b);
    return Py_BuildValue("{s:s,s:s,s:s,s:i,s:d}", "kind", kind, "instruction", instr, "simd",
                         cv_cpu_backend_simd(e->b), "threads", threads > 0 && threads < nthreads ? threads : nthreads,
                         "gops", gops);
}

static PyMethodDef kernel_methods[] = {
    {"kernel_gemm", (PyCFunction)(void (*)(void))py_kernel_gemm, METH_VARARGS | METH_KEYWORDS,
     "kernel_gemm(x, w, weight_dtype='float32', bias=None, accumulate=None, impl='simd', threads=0)\n"
     "x[n][cols] . w[rows][cols]^T (+ bias) (+ accumulate), w stored as weight_dtype\n"
     "(float32, bfloat16, float16, or q8_0, q4_0, q4_1: quantized from w).\n"
     "w may be float32, float64, float16, or uint16 holding bfloat16 bits."},
    {"kernel_matrix", (PyCFunction)(void (*)(void))py_kernel_matrix, METH_VARARGS | METH_KEYWORDS,
     "kernel_matrix(w, weight_dtype='float32', impl='simd', threads=0) -> a packed matrix."},
    {"kernel_matmul", (PyCFunction)(void (*)(void))py_kernel_matmul, METH_VARARGS | METH_KEYWORDS,
     "kernel_matmul(mat, x, bias=None, accumulate=None) with a matrix from kernel_matrix."},
    {"kernel_matmul_time", (PyCFunction)(void (*)(void))py_kernel_matmul_time,
     METH_VARARGS | METH_KEYWORDS,
     "kernel_matmul_time(mat, x, repeats=10, warmup=True) -> best seconds of one GEMM call."},
    {"kernel_rmsnorm_matmul", (PyCFunction)(void (*)(void))py_kernel_rmsnorm_matmul, METH_VARARGS | METH_KEYWORDS,
     "kernel_rmsnorm_matmul(mat, x, weight, eps=1e-5, bias=None, accumulate=None)\n"
     "rmsnorm(x, weight, eps) . mat^T in one fused pass (the backend's rmsnorm_gemm)."},
    {"kernel_swiglu_matmul", (PyCFunction)(void (*)(void))py_kernel_swiglu_matmul, METH_VARARGS | METH_KEYWORDS,
     "kernel_swiglu_matmul(mat, gu, bias=None, accumulate=None)\n"
     "swiglu(gu) . mat^T in one fused pass (the backend's swiglu_gemm); gu [n][2 * cols]."},
    {"kernel_rope_kv_write", (PyCFunction)(void (*)(void))py_kernel_rope_kv_write, METH_VARARGS | METH_KEYWORDS,
     "kernel_rope_kv_write(q, k, v, pos, inv_freq, k_cache, v_cache, slot_mapping, layout='halves',\n"
     "                     cache_dtype=None, impl='simd', threads=0, k_scale=None, v_scale=None)\n"
     "kernel_rope then kernel_kv_write in one fused pass (the backend's rope_kv_write)."},
    {"kernel_rmsnorm", (PyCFunction)(void (*)(void))py_kernel_rmsnorm, METH_VARARGS | METH_KEYWORDS,
     "kernel_rmsnorm(x, weight, eps=1e-5, impl='simd', threads=0) -> out"},
    {"kernel_rope", (PyCFunction)(void (*)(void))py_kernel_rope, METH_VARARGS | METH_KEYWORDS,
     "kernel_rope(q, k, pos, inv_freq, layout='halves', impl='simd', threads=0)\n"
     "Rotates q[n][heads][hd] and k[n][kv_heads][hd] (or None) in place; rows may be strided views."},
    {"kernel_swiglu", (PyCFunction)(void (*)(void))py_kernel_swiglu, METH_VARARGS | METH_KEYWORDS,
     "kernel_swiglu(gu, impl='simd', threads=0) -> silu(gate) * up"},
    {"kernel_embedding", (PyCFunction)(void (*)(void))py_kernel_embedding, METH_VARARGS | METH_KEYWORDS,
     "kernel_embedding(table, tokens, table_dtype='float32', impl='simd', threads=0) -> rows"},
    {"kernel_kv_write", (PyCFunction)(void (*)(void))py_kernel_kv_write, METH_VARARGS | METH_KEYWORDS,
     "kernel_kv_write(k_cache, v_cache, k, v, slot_mapping, cache_dtype=None, impl='simd', threads=0,\n"
     "                k_scale=None, v_scale=None)\n"
     "Writes k/v[n][kv_heads][hd] into the caches in place (slot < 0: skipped)."},
    {"kernel_paged_attention", (PyCFunction)(void (*)(void))py_kernel_paged_attention,
     METH_VARARGS | METH_KEYWORDS,
     "kernel_paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start,\n"
     "                       scale=None, cache_dtype=None, impl='simd', threads=0, window=0,\n"
     "                       k_scale=None, v_scale=None)\n"
     "    -> out[rows][heads*hd]; window > 0: each query sees its last `window` positions only;\n"
     "    an int8 cache (int8 arrays) takes its float32 scales [num_blocks][n_kv_heads][block_size]"},
    {"kernel_triad", (PyCFunction)(void (*)(void))py_kernel_triad, METH_VARARGS | METH_KEYWORDS,
     "kernel_triad(n_bytes, repeats=5, threads=0) -> GB/s of a = b + s*c over arrays of n_bytes each"},
    {"kernel_read_bw", (PyCFunction)(void (*)(void))py_kernel_read_bw, METH_VARARGS | METH_KEYWORDS,
     "kernel_read_bw(n_bytes, repeats=5, threads=0) -> GB/s of reading one array of n_bytes"},
    {"measure_peak", (PyCFunction)(void (*)(void))py_measure_peak, METH_VARARGS | METH_KEYWORDS,
     "measure_peak(kind, threads=0, seconds=0.2, impl='simd') -> {kind, instruction, simd, threads, gops}\n"
     "Peak GFLOP/s (int8: GOP/s; 2 per multiply-add) of the instruction the kernels use for kind\n"
     "('fp32_fma', 'bf16_dot', 'int8_dot'), by register-only loops on threads threads (0: all)."},
    {NULL, NULL, 0, NULL},
};

int cv_py_add_kernels(PyObject *m) {
    return PyModule_AddFunctions(m, kernel_methods);
}
