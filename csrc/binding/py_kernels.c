/* Binding of the kernels part: test and benchmark hooks on conveyor._core,
 * named kernel_*, that run one CPU-backend kernel on NumPy arrays.
 *
 * Every hook takes impl="simd" or "plain" and threads (0: all cores). The
 * backends are created on first use, one per (impl, threads), and kept for the
 * life of the process (never freed: prepared matrices may outlive any module
 * teardown, and the sleeping workers cost nothing). A backend runs one kernel
 * at a time: each has a lock taken with the GIL released. Inputs are checked
 * (dtype, shape, contiguity, index ranges) so no call can crash: wrong dtype
 * raises TypeError, wrong shape or values ValueError. */
#include "binding.h"

#include <math.h>
#include <string.h>

#include "../../kernels/backend.h"
#include "../../kernels/cpu/cpu_internal.h"

#define KB_MAX_THREADS 256

typedef struct kb_entry {
    cv_backend *b;
    PyThread_type_lock lock;
} kb_entry;

static kb_entry g_kb[2][KB_MAX_THREADS + 1]; /* [simd, plain][threads] */

static kb_entry *get_backend(const char *impl, int threads) {
    int plain;
    if (strcmp(impl, "simd") == 0)
        plain = 0;
    else if (strcmp(impl, "plain") == 0)
        plain = 1;
    else {
        PyErr_Format(PyExc_ValueError, "impl must be 'simd' or 'plain', got '%s'", impl);
        return NULL;
    }
    if (threads < 0 || threads > KB_MAX_THREADS) {
        PyErr_Format(PyExc_ValueError, "threads must be in 0..%d (0: all cores), got %d",
                     KB_MAX_THREADS, threads);
        return NULL;
    }
    kb_entry *e = &g_kb[plain][threads];
    if (!e->b) {
        cv_err err = {0};
        cv_backend *b = cv_cpu_backend_create(threads, plain, &err);
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

/* Runs STMT with the GIL released and the backend's lock held. */
#define KB_RUN(E, STMT)                                                                         \
    do {                                                                                        \
        Py_BEGIN_ALLOW_THREADS PyThread_acquire_lock((E)->lock, WAIT_LOCK);                     \
        STMT;                                                                                   \
        PyThread_release_lock((E)->lock);                                                       \
        Py_END_ALLOW_THREADS                                                                    \
    } while (0)

static int parse_dtype(const char *s, cv_dtype *out, const char *what) {
    if (strcmp(s, "float32") == 0) *out = CV_F32;
    else if (strcmp(s, "float16") == 0) *out = CV_F16;
    else if (strcmp(s, "bfloat16") == 0) *out = CV_BF16;
    else {
        PyErr_Format(PyExc_ValueError, "%s must be 'float32', 'float16' or 'bfloat16', got '%s'",
                     what, s);
        return -1;
    }
    return 0;
}

static const char *npy_name(int t) {
    switch (t) {
    case NPY_FLOAT32: return "float32";
    case NPY_FLOAT16: return "float16";
    case NPY_UINT16: return "uint16";
    case NPY_INT32: return "int32";
    case NPY_INT64: return "int64";
    case NPY_FLOAT64: return "float64";
    default: return "another dtype";
    }
}

/* A C-contiguous, aligned, native-order array of type `type` and `ndim`
 * dimensions (ndim < 0: any). Returns a borrowed pointer or NULL. */
static PyArrayObject *want_array(PyObject *o, const char *name, int type, int ndim, int writeable) {
    if (!PyArray_Check(o)) {
        PyErr_Format(PyExc_TypeError, "%s must be a numpy array", name);
        return NULL;
    }
    PyArrayObject *a = (PyArrayObject *)o;
    if (PyArray_TYPE(a) != type || !PyArray_ISNOTSWAPPED(a)) {
        PyErr_Format(PyExc_TypeError, "%s must have dtype %s (native byte order), got %s", name,
                     npy_name(type), npy_name(PyArray_TYPE(a)));
        return NULL;
    }
    if (ndim >= 0 && PyArray_NDIM(a) != ndim) {
        PyErr_Format(PyExc_ValueError, "%s must have %d dimensions, got %d", name, ndim,
                     PyArray_NDIM(a));
        return NULL;
    }
    if (!PyArray_IS_C_CONTIGUOUS(a) || !PyArray_ISALIGNED(a)) {
        PyErr_Format(PyExc_ValueError, "%s must be C-contiguous and aligned", name);
        return NULL;
    }
    if (writeable && !PyArray_ISWRITEABLE(a)) {
        PyErr_Format(PyExc_ValueError, "%s must be writeable", name);
        return NULL;
    }
    return a;
}

/* A float32 array [n][h][d] whose rows may be strided (a view into a wider
 * buffer) but whose [h][d] part is contiguous. */
typedef struct rows3 {
    float *data;
    int64_t n, h, d, stride; /* stride: floats between rows */
} rows3;

static int want_rows3(PyObject *o, const char *name, int writeable, rows3 *r) {
    if (!PyArray_Check(o)) {
        PyErr_Format(PyExc_TypeError, "%s must be a numpy array", name);
        return -1;
    }
    PyArrayObject *a = (PyArrayObject *)o;
    if (PyArray_TYPE(a) != NPY_FLOAT32 || !PyArray_ISNOTSWAPPED(a)) {
        PyErr_Format(PyExc_TypeError, "%s must have dtype float32, got %s", name,
                     npy_name(PyArray_TYPE(a)));
        return -1;
    }
    if (PyArray_NDIM(a) != 3) {
        PyErr_Format(PyExc_ValueError, "%s must have shape [tokens][heads][head_dim], got %d dimensions",
                     name, PyArray_NDIM(a));
        return -1;
    }
    const npy_intp *sh = PyArray_DIMS(a), *st = PyArray_STRIDES(a);
    r->n = sh[0];
    r->h = sh[1];
    r->d = sh[2];
    const int inner_ok = (r->d <= 1 || st[2] == 4) && (r->h <= 1 || st[1] == 4 * r->d);
    const int row_ok = r->n <= 1 || (st[0] % 4 == 0 && st[0] >= 4 * r->h * r->d);
    if (!inner_ok || !row_ok || !PyArray_ISALIGNED(a)) {
        PyErr_Format(PyExc_ValueError,
                     "%s: each row [heads][head_dim] must be contiguous, rows a positive multiple of 4 bytes apart",
                     name);
        return -1;
    }
    if (writeable && !PyArray_ISWRITEABLE(a)) {
        PyErr_Format(PyExc_ValueError, "%s must be writeable", name);
        return -1;
    }
    r->data = PyArray_DATA(a);
    r->stride = r->n <= 1 ? r->h * r->d : (int64_t)(st[0] / 4);
    return 0;
}

/* A 2-D source of weights: float32, float64, float16, or uint16 holding
 * bfloat16 bits. Returns the array (borrowed) and its dtype, or NULL. */
static PyArrayObject *want_source(PyObject *o, const char *name, cv_dtype *dt) {
    if (!PyArray_Check(o)) {
        PyErr_Format(PyExc_TypeError, "%s must be a numpy array", name);
        return NULL;
    }
    const int t = PyArray_TYPE((PyArrayObject *)o);
    int npt;
    switch (t) {
    case NPY_FLOAT32: *dt = CV_F32; npt = t; break;
    case NPY_FLOAT64: *dt = CV_F64; npt = t; break;
    case NPY_FLOAT16: *dt = CV_F16; npt = t; break;
    case NPY_UINT16: *dt = CV_BF16; npt = t; break;
    default:
        PyErr_Format(PyExc_TypeError,
                     "%s must be float32, float64, float16 or uint16 (bfloat16 bits), got %s", name,
                     npy_name(t));
        return NULL;
    }
    return want_array(o, name, npt, 2, 0);
}

static PyObject *new_f32(int nd, npy_intp *dims) {
    return PyArray_ZEROS(nd, dims, NPY_FLOAT32, 0);
}

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

/* Builds a prepared matrix from w[rows][cols] float32; NULL on error. */
static PyObject *make_matrix(PyObject *w_obj, const char *wdt, const char *impl, int threads) {
    kb_entry *e = get_backend(impl, threads);
    if (!e) return NULL;
    cv_dtype dt;
    if (parse_dtype(wdt, &dt, "weight_dtype") < 0) return NULL;
    cv_dtype st;
    PyArrayObject *w = want_source(w_obj, "w", &st);
    if (!w) return NULL;
    const int64_t rows = PyArray_DIM(w, 0), cols = PyArray_DIM(w, 1);
    if (rows < 1 || cols < 1) {
        PyErr_Format(PyExc_ValueError, "w must be non-empty, got [%lld][%lld]", (long long)rows,
                     (long long)cols);
        return NULL;
    }
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
    PyArrayObject *x = want_array(x_obj, "x", NPY_FLOAT32, 2, 0);
    if (!x) return NULL;
    const int64_t n = PyArray_DIM(x, 0), rows = km->m.rows, cols = km->m.cols;
    if (PyArray_DIM(x, 1) != cols) {
        PyErr_Format(PyExc_ValueError, "x has %lld columns, the matrix %lld",
                     (long long)PyArray_DIM(x, 1), (long long)cols);
        return NULL;
    }
    const float *bias = NULL;
    if (bias_obj && bias_obj != Py_None) {
        PyArrayObject *ba = want_array(bias_obj, "bias", NPY_FLOAT32, 1, 0);
        if (!ba) return NULL;
        if (PyArray_DIM(ba, 0) != rows) {
            PyErr_Format(PyExc_ValueError, "bias has %lld entries, the matrix %lld rows",
                         (long long)PyArray_DIM(ba, 0), (long long)rows);
            return NULL;
        }
        bias = PyArray_DATA(ba);
    }
    npy_intp dims[2] = {(npy_intp)n, (npy_intp)rows};
    PyObject *out;
    int accumulate = 0;
    if (acc_obj && acc_obj != Py_None) {
        PyArrayObject *aa = want_array(acc_obj, "accumulate", NPY_FLOAT32, 2, 0);
        if (!aa) return NULL;
        if (PyArray_DIM(aa, 0) != n || PyArray_DIM(aa, 1) != rows) {
            PyErr_Format(PyExc_ValueError, "accumulate must have shape [%lld][%lld]", (long long)n,
                         (long long)rows);
            return NULL;
        }
        out = PyArray_NewCopy(aa, NPY_CORDER);
        accumulate = 1;
    } else {
        out = new_f32(2, dims);
    }
    if (!out) return NULL;
    if (n > 0) {
        float *o = PyArray_DATA((PyArrayObject *)out);
        const float *xp = PyArray_DATA(x);
        kb_entry *e = km->e;
        KB_RUN(e, e->b->gemm(e->b, o, xp, n, &km->m, bias, accumulate));
    }
    return out;
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
    PyArrayObject *x = want_array(x_obj, "x", NPY_FLOAT32, 2, 0);
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
    PyArrayObject *x = want_array(x_obj, "x", NPY_FLOAT32, 2, 0);
    PyArrayObject *w = x ? want_array(w_obj, "weight", NPY_FLOAT32, 1, 0) : NULL;
    if (!w) return NULL;
    const int64_t n = PyArray_DIM(x, 0), dim = PyArray_DIM(x, 1);
    if (PyArray_DIM(w, 0) != dim) {
        PyErr_Format(PyExc_ValueError, "weight has %lld entries, x rows %lld",
                     (long long)PyArray_DIM(w, 0), (long long)dim);
        return NULL;
    }
    npy_intp dims[2] = {(npy_intp)n, (npy_intp)dim};
    PyObject *out = new_f32(2, dims);
    if (!out) return NULL;
    float *o = PyArray_DATA((PyArrayObject *)out);
    const float *xp = PyArray_DATA(x), *wp = PyArray_DATA(w);
    const float fe = (float)eps;
    KB_RUN(e, e->b->rmsnorm(e->b, o, xp, wp, n, dim, fe));
    return out;
}

static PyObject *py_kernel_add_rmsnorm(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kwlist[] = {"x", "r", "weight", "eps", "impl", "threads", NULL};
    PyObject *x_obj, *r_obj, *w_obj;
    double eps = 1e-5;
    const char *impl = "simd";
    int threads = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO|dsi", kwlist, &x_obj, &r_obj, &w_obj, &eps, &impl,
                                     &threads))
        return NULL;
    kb_entry *e = get_backend(impl, threads);
    if (!e) return NULL;
    PyArrayObject *x = want_array(x_obj, "x", NPY_FLOAT32, 2, 0);
    PyArrayObject *r = x ? want_array(r_obj, "r", NPY_FLOAT32, 2, 0) : NULL;
    PyArrayObject *w = r ? want_array(w_obj, "weight", NPY_FLOAT32, 1, 0) : NULL;
    if (!w) return NULL;
    const int64_t n = PyArray_DIM(x, 0), dim = PyArray_DIM(x, 1);
    if (PyArray_DIM(r, 0) != n || PyArray_DIM(r, 1) != dim || PyArray_DIM(w, 0) != dim) {
        PyErr_SetString(PyExc_ValueError, "r must have x's shape and weight x's row length");
        return NULL;
    }
    npy_intp dims[2] = {(npy_intp)n, (npy_intp)dim};
    PyObject *out = new_f32(2, dims);
    PyObject *xs = out ? PyArray_NewCopy(x, NPY_CORDER) : NULL;
    if (!xs) {
        Py_XDECREF(out);
        return NULL;
    }
    float *o = PyArray_DATA((PyArrayObject *)out), *xp = PyArray_DATA((PyArrayObject *)xs);
    const float *rp = PyArray_DATA(r), *wp = PyArray_DATA(w);
    const float fe = (float)eps;
    KB_RUN(e, e->b->add_rmsnorm(e->b, o, xp, rp, wp, n, dim, fe));
    PyObject *res = PyTuple_Pack(2, out, xs);
    Py_DECREF(out);
    Py_DECREF(xs);
    return res;
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
    cv_rope rope;
    if (strcmp(layout, "halves") == 0)
        rope.layout = CV_ROPE_HALVES;
    else if (strcmp(layout, "pairs") == 0)
        rope.layout = CV_ROPE_PAIRS;
    else {
        PyErr_Format(PyExc_ValueError, "layout must be 'halves' or 'pairs', got '%s'", layout);
        return NULL;
    }
    rows3 q, k = {NULL, 0, 0, 0, 0};
    if (want_rows3(q_obj, "q", 1, &q) < 0) return NULL;
    if (k_obj != Py_None && want_rows3(k_obj, "k", 1, &k) < 0) return NULL;
    if (k_obj != Py_None && (k.n != q.n || k.d != q.d)) {
        PyErr_SetString(PyExc_ValueError, "k must have q's tokens and head_dim");
        return NULL;
    }
    if (q.d < 2 || q.d % 2) {
        PyErr_Format(PyExc_ValueError, "head_dim must be even and >= 2, got %lld", (long long)q.d);
        return NULL;
    }
    PyArrayObject *pos = want_array(pos_obj, "pos", NPY_INT32, 1, 0);
    PyArrayObject *f = pos ? want_array(f_obj, "inv_freq", NPY_FLOAT32, 1, 0) : NULL;
    if (!f) return NULL;
    if (PyArray_DIM(pos, 0) != q.n || PyArray_DIM(f, 0) != q.d / 2) {
        PyErr_SetString(PyExc_ValueError, "pos must have one entry per token, inv_freq head_dim/2");
        return NULL;
    }
    rope.inv_freq = PyArray_DATA(f);
    rope.head_dim = q.d;
    const int32_t *pp = PyArray_DATA(pos);
    KB_RUN(e, e->b->rope(e->b, q.data, q.stride, q.h, k.data, k.stride, k.h, pp, q.n, &rope));
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
    PyArrayObject *gu = want_array(g_obj, "gu", NPY_FLOAT32, 2, 0);
    if (!gu) return NULL;
    const int64_t n = PyArray_DIM(gu, 0), two = PyArray_DIM(gu, 1);
    if (two % 2) {
        PyErr_Format(PyExc_ValueError, "gu rows must be [gate | up] of even length, got %lld",
                     (long long)two);
        return NULL;
    }
    npy_intp dims[2] = {(npy_intp)n, (npy_intp)(two / 2)};
    PyObject *out = new_f32(2, dims);
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
    cv_dtype dt;
    if (parse_dtype(tdt, &dt, "table_dtype") < 0) return NULL;
    cv_dtype st;
    PyArrayObject *t = want_source(t_obj, "table", &st);
    PyArrayObject *tok = t ? want_array(tok_obj, "tokens", NPY_INT32, 1, 0) : NULL;
    if (!tok) return NULL;
    const int64_t rows = PyArray_DIM(t, 0), cols = PyArray_DIM(t, 1), n = PyArray_DIM(tok, 0);
    if (rows < 1 || cols < 1) {
        PyErr_SetString(PyExc_ValueError, "table must be non-empty");
        return NULL;
    }
    const int32_t *tp = PyArray_DATA(tok);
    for (int64_t i = 0; i < n; i++)
        if (tp[i] < 0 || tp[i] >= rows) {
            PyErr_Format(PyExc_ValueError, "tokens[%lld] = %d is outside the table's %lld rows",
                         (long long)i, tp[i], (long long)rows);
            return NULL;
        }
    npy_intp dims[2] = {(npy_intp)n, (npy_intp)cols};
    PyObject *out = new_f32(2, dims);
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

/* Checks k_cache / v_cache [num_blocks][n_kv][block_size][head_dim] and
 * fills a cv_kv_layer. */
static int want_cache(PyObject *k_obj, PyObject *v_obj, const char *cache_dtype, int writeable,
                      cv_kv_layer *c) {
    if (!PyArray_Check(k_obj) || !PyArray_Check(v_obj)) {
        PyErr_SetString(PyExc_TypeError, "k_cache and v_cache must be numpy arrays");
        return -1;
    }
    const int kt = PyArray_TYPE((PyArrayObject *)k_obj);
    int npt;
    if (cache_dtype && cache_dtype[0]) {
        if (parse_dtype(cache_dtype, &c->dtype, "cache_dtype") < 0) return -1;
        npt = c->dtype == CV_F32 ? NPY_FLOAT32 : (c->dtype == CV_F16 ? NPY_FLOAT16 : NPY_UINT16);
    } else if (kt == NPY_FLOAT32 || kt == NPY_FLOAT16) {
        c->dtype = kt == NPY_FLOAT32 ? CV_F32 : CV_F16;
        npt = kt;
    } else {
        PyErr_Format(PyExc_TypeError,
                     "k_cache must be float32 or float16 (or uint16 with cache_dtype='bfloat16'), got %s",
                     npy_name(kt));
        return -1;
    }
    PyArrayObject *k = want_array(k_obj, "k_cache", npt, 4, writeable);
    PyArrayObject *v = k ? want_array(v_obj, "v_cache", npt, 4, writeable) : NULL;
    if (!v) return -1;
    for (int i = 0; i < 4; i++)
        if (PyArray_DIM(k, i) != PyArray_DIM(v, i)) {
            PyErr_SetString(PyExc_ValueError, "k_cache and v_cache must have the same shape");
            return -1;
        }
    c->k = PyArray_DATA(k);
    c->v = PyArray_DATA(v);
    c->num_blocks = PyArray_DIM(k, 0);
    c->n_kv_heads = PyArray_DIM(k, 1);
    c->block_size = PyArray_DIM(k, 2);
    c->head_dim = PyArray_DIM(k, 3);
    if (c->num_blocks < 1 || c->n_kv_heads < 1 || c->block_size < 1 || c->head_dim < 1) {
        PyErr_SetString(PyExc_ValueError, "the cache must be non-empty in every dimension");
        return -1;
    }
    return 0;
}

static PyObject *py_kernel_kv_write(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kwlist[] = {"k_cache", "v_cache", "k", "v", "slot_mapping", "cache_dtype", "impl",
                             "threads", NULL};
    PyObject *kc_obj, *vc_obj, *k_obj, *v_obj, *s_obj;
    const char *cdt = NULL, *impl = "simd";
    int threads = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOO|zsi", kwlist, &kc_obj, &vc_obj, &k_obj, &v_obj,
                                     &s_obj, &cdt, &impl, &threads))
        return NULL;
    kb_entry *e = get_backend(impl, threads);
    if (!e) return NULL;
    cv_kv_layer cache;
    if (want_cache(kc_obj, vc_obj, cdt, 1, &cache) < 0) return NULL;
    rows3 k, v;
    if (want_rows3(k_obj, "k", 0, &k) < 0 || want_rows3(v_obj, "v", 0, &v) < 0) return NULL;
    if (k.n != v.n || k.h != cache.n_kv_heads || v.h != cache.n_kv_heads || k.d != cache.head_dim ||
        v.d != cache.head_dim) {
        PyErr_SetString(PyExc_ValueError, "k and v must have shape [tokens][n_kv_heads][head_dim] of the cache");
        return NULL;
    }
    PyArrayObject *slots = want_array(s_obj, "slot_mapping", NPY_INT64, 1, 0);
    if (!slots) return NULL;
    if (PyArray_DIM(slots, 0) != k.n) {
        PyErr_SetString(PyExc_ValueError, "slot_mapping must have one entry per token");
        return NULL;
    }
    const int64_t *sp = PyArray_DATA(slots);
    const int64_t n_slots = cache.num_blocks * cache.block_size;
    for (int64_t i = 0; i < k.n; i++)
        if (sp[i] >= n_slots) {
            PyErr_Format(PyExc_ValueError, "slot_mapping[%lld] = %lld is past the cache's %lld slots",
                         (long long)i, (long long)sp[i], (long long)n_slots);
            return NULL;
        }
    KB_RUN(e, e->b->kv_write(e->b, &cache, k.data, k.stride, v.data, v.stride, sp, k.n));
    Py_RETURN_NONE;
}

static PyObject *py_kernel_paged_attention(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kwlist[] = {"q", "k_cache", "v_cache", "block_tables", "context_lens", "query_start",
                             "scale", "cache_dtype", "impl", "threads", NULL};
    PyObject *q_obj, *kc_obj, *vc_obj, *bt_obj, *cl_obj, *qs_obj, *scale_obj = Py_None;
    const char *cdt = NULL, *impl = "simd";
    int threads = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOO|Ozsi", kwlist, &q_obj, &kc_obj, &vc_obj, &bt_obj,
                                     &cl_obj, &qs_obj, &scale_obj, &cdt, &impl, &threads))
        return NULL;
    kb_entry *e = get_backend(impl, threads);
    if (!e) return NULL;
    cv_kv_layer cache;
    if (want_cache(kc_obj, vc_obj, cdt, 0, &cache) < 0) return NULL;
    rows3 q;
    if (want_rows3(q_obj, "q", 0, &q) < 0) return NULL;
    if (q.d != cache.head_dim || q.h < 1 || q.h % cache.n_kv_heads) {
        PyErr_SetString(PyExc_ValueError,
                        "q must be [rows][n_heads][head_dim] with the cache's head_dim and n_heads a multiple of n_kv_heads");
        return NULL;
    }
    if (q.d > (int64_t)CV_ATT_TILE * CV_ATT_MAX_HD) {
        PyErr_Format(PyExc_ValueError, "head_dim %lld is larger than %d", (long long)q.d,
                     CV_ATT_TILE * CV_ATT_MAX_HD);
        return NULL;
    }
    PyArrayObject *bt = want_array(bt_obj, "block_tables", NPY_INT32, 2, 0);
    PyArrayObject *cl = bt ? want_array(cl_obj, "context_lens", NPY_INT32, 1, 0) : NULL;
    PyArrayObject *qs = cl ? want_array(qs_obj, "query_start", NPY_INT32, 1, 0) : NULL;
    if (!qs) return NULL;
    const int64_t n_seqs = PyArray_DIM(cl, 0), mb = PyArray_DIM(bt, 1);
    if (PyArray_DIM(bt, 0) != n_seqs || PyArray_DIM(qs, 0) != n_seqs + 1) {
        PyErr_SetString(PyExc_ValueError,
                        "block_tables must be [n_seqs][max_blocks], query_start [n_seqs + 1]");
        return NULL;
    }
    const int32_t *tab = PyArray_DATA(bt), *ctx = PyArray_DATA(cl), *qsp = PyArray_DATA(qs);
    int64_t max_ctx = 0;
    if (n_seqs > 0 && qsp[0] != 0) {
        PyErr_SetString(PyExc_ValueError, "query_start[0] must be 0");
        return NULL;
    }
    for (int64_t s = 0; s < n_seqs; s++) {
        const int64_t nq = (int64_t)qsp[s + 1] - qsp[s];
        if (nq < 0 || qsp[s + 1] > q.n) {
            PyErr_Format(PyExc_ValueError, "query_start must be non-decreasing and <= %lld rows",
                         (long long)q.n);
            return NULL;
        }
        if (ctx[s] < nq || (int64_t)ctx[s] > mb * cache.block_size) {
            PyErr_Format(PyExc_ValueError,
                         "context_lens[%lld] = %d must be >= its %lld new tokens and fit %lld blocks",
                         (long long)s, ctx[s], (long long)nq, (long long)mb);
            return NULL;
        }
        const int64_t used = (ctx[s] + cache.block_size - 1) / cache.block_size;
        for (int64_t i = 0; i < used; i++) {
            const int32_t blk = tab[s * mb + i];
            if (blk < 0 || blk >= cache.num_blocks) {
                PyErr_Format(PyExc_ValueError, "block_tables[%lld][%lld] = %d is not a block of the cache",
                             (long long)s, (long long)i, blk);
                return NULL;
            }
        }
        if (ctx[s] > max_ctx) max_ctx = ctx[s];
    }
    double scale = 1.0 / sqrt((double)q.d);
    if (scale_obj != Py_None) {
        scale = PyFloat_AsDouble(scale_obj);
        if (scale == -1.0 && PyErr_Occurred()) return NULL;
    }
    npy_intp dims[2] = {(npy_intp)q.n, (npy_intp)(q.h * q.d)};
    PyObject *out = new_f32(2, dims);
    if (!out) return NULL;
    cv_attn_batch ab = {.n_seqs = n_seqs, .query_start = qsp, .context_lens = ctx,
                        .block_tables = tab, .max_blocks_per_seq = mb, .max_context_len = max_ctx,
                        .n_heads = q.h, .n_kv_heads = cache.n_kv_heads, .head_dim = q.d,
                        .scale = (float)scale};
    float *o = PyArray_DATA((PyArrayObject *)out);
    KB_RUN(e, e->b->paged_attention(e->b, o, q.data, q.stride, &cache, &ab));
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

static PyObject *py_kernel_info(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    const char *fs = getenv("CONVEYOR_FORCE_SCALAR");
    return Py_BuildValue("{s:s,s:i,s:i,s:i,s:i,s:O}", "simd", CV_HAVE_AVX2 ? "avx2+fma+f16c" : "none",
                         "cores", cv_cpu_count(), "gemm_nr", CV_NR, "gemm_mr", CV_MR,
                         "attention_max_head_dim", CV_ATT_TILE * CV_ATT_MAX_HD, "force_scalar",
                         (fs && fs[0] && strcmp(fs, "0") != 0) ? Py_True : Py_False);
}

static PyMethodDef kernel_methods[] = {
    {"kernel_gemm", (PyCFunction)(void (*)(void))py_kernel_gemm, METH_VARARGS | METH_KEYWORDS,
     "kernel_gemm(x, w, weight_dtype='float32', bias=None, accumulate=None, impl='simd', threads=0)\n"
     "x[n][cols] . w[rows][cols]^T (+ bias) (+ accumulate), w stored as weight_dtype.\n"
     "w may be float32, float64, float16, or uint16 holding bfloat16 bits."},
    {"kernel_matrix", (PyCFunction)(void (*)(void))py_kernel_matrix, METH_VARARGS | METH_KEYWORDS,
     "kernel_matrix(w, weight_dtype='float32', impl='simd', threads=0) -> a packed matrix."},
    {"kernel_matmul", (PyCFunction)(void (*)(void))py_kernel_matmul, METH_VARARGS | METH_KEYWORDS,
     "kernel_matmul(mat, x, bias=None, accumulate=None) with a matrix from kernel_matrix."},
    {"kernel_matmul_time", (PyCFunction)(void (*)(void))py_kernel_matmul_time,
     METH_VARARGS | METH_KEYWORDS,
     "kernel_matmul_time(mat, x, repeats=10, warmup=True) -> best seconds of one GEMM call."},
    {"kernel_rmsnorm", (PyCFunction)(void (*)(void))py_kernel_rmsnorm, METH_VARARGS | METH_KEYWORDS,
     "kernel_rmsnorm(x, weight, eps=1e-5, impl='simd', threads=0) -> out"},
    {"kernel_add_rmsnorm", (PyCFunction)(void (*)(void))py_kernel_add_rmsnorm,
     METH_VARARGS | METH_KEYWORDS,
     "kernel_add_rmsnorm(x, r, weight, eps=1e-5, impl='simd', threads=0) -> (out, x + r)"},
    {"kernel_rope", (PyCFunction)(void (*)(void))py_kernel_rope, METH_VARARGS | METH_KEYWORDS,
     "kernel_rope(q, k, pos, inv_freq, layout='halves', impl='simd', threads=0)\n"
     "Rotates q[n][heads][hd] and k[n][kv_heads][hd] (or None) in place; rows may be strided views."},
    {"kernel_swiglu", (PyCFunction)(void (*)(void))py_kernel_swiglu, METH_VARARGS | METH_KEYWORDS,
     "kernel_swiglu(gu, impl='simd', threads=0) -> silu(gate) * up"},
    {"kernel_embedding", (PyCFunction)(void (*)(void))py_kernel_embedding, METH_VARARGS | METH_KEYWORDS,
     "kernel_embedding(table, tokens, table_dtype='float32', impl='simd', threads=0) -> rows"},
    {"kernel_kv_write", (PyCFunction)(void (*)(void))py_kernel_kv_write, METH_VARARGS | METH_KEYWORDS,
     "kernel_kv_write(k_cache, v_cache, k, v, slot_mapping, cache_dtype=None, impl='simd', threads=0)\n"
     "Writes k/v[n][kv_heads][hd] into the caches in place (slot < 0: skipped)."},
    {"kernel_paged_attention", (PyCFunction)(void (*)(void))py_kernel_paged_attention,
     METH_VARARGS | METH_KEYWORDS,
     "kernel_paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start,\n"
     "                       scale=None, cache_dtype=None, impl='simd', threads=0) -> out[rows][heads*hd]"},
    {"kernel_triad", (PyCFunction)(void (*)(void))py_kernel_triad, METH_VARARGS | METH_KEYWORDS,
     "kernel_triad(n_bytes, repeats=5, threads=0) -> GB/s of a = b + s*c over arrays of n_bytes each"},
    {"kernel_read_bw", (PyCFunction)(void (*)(void))py_kernel_read_bw, METH_VARARGS | METH_KEYWORDS,
     "kernel_read_bw(n_bytes, repeats=5, threads=0) -> GB/s of reading one array of n_bytes"},
    {"kernel_info", (PyCFunction)py_kernel_info, METH_NOARGS, "kernel_info() -> dict about the CPU kernels"},
    {NULL, NULL, 0, NULL},
};

int cv_py_add_kernels(PyObject *m) {
    return PyModule_AddFunctions(m, kernel_methods);
}
