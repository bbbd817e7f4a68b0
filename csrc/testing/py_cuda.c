/* Binding of the CUDA backend: availability, device info, and test hooks
 * named cuda_kernel_* that mirror the CPU hooks of py_kernels.c (same
 * arguments, minus impl/threads): they copy NumPy arrays to the device, run
 * one kernel, copy the result back and raise if the backend recorded an error.
 *
 *   cuda_available() -> bool          creates the backend once (device 0, or
 *                                      $CONVEYOR_CUDA_DEVICE) and caches it
 *   cuda_check()                       raises UnsupportedError saying why not
 *   cuda_info() -> dict                device description
 *   cuda_memcpy_bandwidth(n_bytes, repeats=5) -> GB/s (read + write)
 *   cuda_kernel_gemm(x, w, weight_dtype='float32', bias=None, accumulate=None)
 *   cuda_kernel_matrix(w, weight_dtype='float32') -> matrix on the device
 *   cuda_kernel_matmul(mat, x, bias=None, accumulate=None)
 *   cuda_kernel_matmul_time(mat, x, repeats=10, calls=1) -> best seconds per GEMM of `calls`
 *                               back-to-back GEMMs and one device sync
 *   cuda_kernel_rmsnorm(x, weight, eps=1e-5)
 *   cuda_kernel_rope(q, k, pos, inv_freq, layout='halves', host_freq=False)
 *   cuda_kernel_swiglu(gu)
 *   cuda_kernel_embedding(table, tokens, table_dtype='float32', validate=True)
 *   cuda_kernel_kv_write(k_cache, v_cache, k, v, slot_mapping, cache_dtype=None, validate=True)
 *   cuda_kernel_paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start,
 *                               scale=None, cache_dtype=None, validate=True, max_context_len=None)
 * validate=False skips the host-side index checks that the kernels also make
 * safely (block ids, slots, token ids, context lengths), to test that the
 * device reports them as an error instead of crashing. On the device, q, k
 * and v rows are laid out with strides wider than a row, like the engine's
 * fused qkv buffer. */
#include "../binding/arrays.h"

#include <stdlib.h>
#include <string.h>

#include "../../kernels/cuda/cv_cuda.h"

/* ------------------------------------------------------------ the backend */

static struct {
    int tried;
    cv_backend *b; /* never destroyed: matrices handed to Python may outlive module teardown */
    PyThread_type_lock lock;
    cv_err err; /* why creation failed */
} g_cu;

/* The backend, or NULL with UnsupportedError (or another) set. */
static cv_backend *get_cuda(void) {
    if (!g_cu.tried) {
        g_cu.tried = 1;
        int device = 0;
        const char *env = getenv("CONVEYOR_CUDA_DEVICE");
        if (env && env[0]) device = atoi(env);
        cv_err err = {0};
        /* With the GIL held (about a second, once): no other thread can see
         * `tried` set before the outcome is stored. */
        cv_backend *b = cv_cuda_backend_create(device, &err);
        if (b) {
            g_cu.lock = PyThread_allocate_lock();
            if (!g_cu.lock) {
                b->destroy(b);
                cv_set_err(&g_cu.err, CV_ERR_NOMEM, "out of memory");
            } else {
                g_cu.b = b;
            }
        } else {
            g_cu.err = err;
            if (!g_cu.err.code) g_cu.err.code = CV_ERR_UNSUPPORTED;
        }
    }
    if (!g_cu.b) {
        cv_py_raise(&g_cu.err);
        return NULL;
    }
    return g_cu.b;
}

/* Device buffers of one hook call, freed together. */
#define DEV_MAX 16
typedef struct dev {
    cv_backend *b;
    void *p[DEV_MAX];
    int n;
    int oom;
} dev;

static void *dev_zero(dev *d, size_t bytes) {
    if (d->oom || d->n == DEV_MAX) {
        d->oom = 1;
        return NULL;
    }
    void *p = d->b->alloc(d->b, bytes ? bytes : 4);
    if (!p) {
        d->oom = 1;
        return NULL;
    }
    d->p[d->n++] = p;
    return p;
}

static void *dev_put(dev *d, const void *host, size_t bytes) {
    void *p = dev_zero(d, bytes);
    if (p && bytes) d->b->to_device(d->b, p, host, bytes);
    return p;
}

/* Waits for the device, frees the buffers; returns the recorded error (and
 * clears it so the next hook starts clean). */
static int dev_finish(dev *d, cv_err *err) {
    cv_backend *b = d->b;
    b->sync(b);
    for (int i = 0; i < d->n; i++) b->free(b, d->p[i]);
    d->n = 0;
    int rc = cv_cuda_last_error(b, err);
    if (rc) cv_cuda_clear_error(b);
    if (!rc && d->oom) rc = cv_set_err(err, CV_ERR_NOMEM, "CUDA: out of device memory in a test hook");
    return rc;
}

/* Runs the statement(s) with the GIL released and the backend's lock held. */
#define CU_RUN(...) CV_PY_RUN_LOCKED(g_cu.lock, __VA_ARGS__)

/* out once the device work succeeded (rc == 0); else drops out and raises err. */
static PyObject *out_or_raise(PyObject *out, int rc, const cv_err *err) {
    if (!rc) return out;
    Py_DECREF(out);
    return cv_py_raise(err);
}

/* ------------------------------------------------------------- host rows */

/* Copies the rows of r into dst rows of dst_stride floats at column col. */
static void pack_rows(float *dst, int64_t dst_stride, int64_t col, const cv_py_rows3 *r) {
    for (int64_t i = 0; i < r->n; i++)
        memcpy(dst + i * dst_stride + col, r->data + i * r->stride, (size_t)(r->h * r->d) * sizeof(float));
}

static void unpack_rows(cv_py_rows3 *r, const float *src, int64_t src_stride, int64_t col) {
    for (int64_t i = 0; i < r->n; i++)
        memcpy(r->data + i * r->stride, src + i * src_stride + col, (size_t)(r->h * r->d) * sizeof(float));
}

/* ------------------------------------------------------------ availability */

static PyObject *py_cuda_available(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    if (get_cuda()) Py_RETURN_TRUE;
    PyErr_Clear();
    Py_RETURN_FALSE;
}

static PyObject *py_cuda_check(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    if (!get_cuda()) return NULL;
    Py_RETURN_NONE;
}

static PyObject *py_cuda_info(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    cv_backend *b = get_cuda();
    if (!b) return NULL;
    char name[256];
    size_t fb = 0, tb = 0;
    cv_cuda_device_name(b, name, sizeof name);
    int rc;
    CU_RUN(rc = b->mem_info(b, &fb, &tb));
    if (rc) {
        cv_err err;
        if (!cv_cuda_last_error(b, &err)) cv_set_err(&err, CV_ERR_IO, "cudaMemGetInfo failed");
        cv_cuda_clear_error(b);
        return cv_py_raise(&err);
    }
    return Py_BuildValue("{s:s,s:K,s:K,s:i}", "device", name, "free_bytes", (unsigned long long)fb,
                         "total_bytes", (unsigned long long)tb, "abi", CV_CUDA_ABI_VERSION);
}

static PyObject *py_cuda_memcpy_bandwidth(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kwlist[] = {"n_bytes", "repeats", NULL};
    long long n_bytes;
    int repeats = 5;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "L|i", kwlist, &n_bytes, &repeats)) return NULL;
    if (n_bytes < 4096 || n_bytes > (1LL << 36) || repeats < 1) {
        PyErr_SetString(PyExc_ValueError, "n_bytes must be in 4 KiB .. 64 GiB, repeats >= 1");
        return NULL;
    }
    cv_backend *b = get_cuda();
    if (!b) return NULL;
    cv_err err = {0};
    double gbs;
    CU_RUN(gbs = cv_cuda_memcpy_bandwidth(b, (size_t)n_bytes, repeats, &err));
    if (gbs < 0) return cv_py_raise(&err);
    return PyFloat_FromDouble(gbs);
}

/* ------------------------------------------------------------------- GEMM */

#define MATRIX_CAPSULE "conveyor.cuda_kernel_matrix"

static void matrix_capsule_free(PyObject *cap) {
    cv_matrix *m = PyCapsule_GetPointer(cap, MATRIX_CAPSULE);
    if (!m) {
        PyErr_Clear();
        return;
    }
    if (g_cu.b) CU_RUN(g_cu.b->matrix_free(g_cu.b, m));
    PyMem_Free(m);
}

static PyObject *make_matrix(PyObject *w_obj, const char *wdt) {
    cv_backend *b = get_cuda();
    if (!b) return NULL;
    cv_dtype dt, st;
    if (cv_py_parse_dtype(wdt, "weight_dtype", 0, &dt) < 0) return NULL;
    PyArrayObject *w = cv_py_want_matrix(w_obj, "w", 0, &st);
    if (!w) return NULL;
    const int64_t rows = PyArray_DIM(w, 0), cols = PyArray_DIM(w, 1);
    cv_matrix *m = PyMem_Calloc(1, sizeof *m);
    if (!m) return PyErr_NoMemory();
    cv_err err = {0};
    int rc;
    const void *src = PyArray_DATA(w);
    CU_RUN(rc = b->matrix_prepare(b, m, src, st, rows, cols, dt, &err));
    if (rc < 0) {
        PyMem_Free(m);
        return cv_py_raise(&err);
    }
    PyObject *cap = PyCapsule_New(m, MATRIX_CAPSULE, matrix_capsule_free);
    if (!cap) {
        CU_RUN(b->matrix_free(b, m));
        PyMem_Free(m);
    }
    return cap;
}

static cv_matrix *get_matrix(PyObject *cap) {
    if (!PyCapsule_IsValid(cap, MATRIX_CAPSULE)) {
        PyErr_SetString(PyExc_TypeError, "mat must come from cuda_kernel_matrix()");
        return NULL;
    }
    return PyCapsule_GetPointer(cap, MATRIX_CAPSULE);
}

static PyObject *run_matmul(cv_matrix *m, PyObject *x_obj, PyObject *bias_obj, PyObject *acc_obj) {
    cv_backend *b = get_cuda();
    if (!b) return NULL;
    cv_py_gemm_args a;
    if (cv_py_want_gemm_args(&a, x_obj, bias_obj, acc_obj, m->rows, m->cols) < 0) return NULL;
    const int64_t n = a.n, rows = m->rows, cols = m->cols;
    if (n == 0) return a.out;
    float *o = PyArray_DATA((PyArrayObject *)a.out); /* [n][rows] */
    const float *xp = PyArray_DATA(a.x), *bias = a.bias; /* [n][cols], [rows] */
    const size_t xb = (size_t)(n * cols) * 4, ob = (size_t)(n * rows) * 4;
    cv_err err = {0};
    int rc;
    CU_RUN({
        dev d = {.b = b};
        float *dx = dev_put(&d, xp, xb);
        float *dout = dev_put(&d, o, ob); /* holds the accumulate input */
        float *dbias = bias ? dev_put(&d, bias, (size_t)rows * 4) : NULL;
        if (!d.oom) {
            b->gemm(b, dout, dx, n, m, dbias, a.accumulate);
            b->to_host(b, o, dout, ob);
        }
        rc = dev_finish(&d, &err);
    });
    return out_or_raise(a.out, rc, &err);
}

static PyObject *py_cuda_kernel_gemm(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kwlist[] = {"x", "w", "weight_dtype", "bias", "accumulate", NULL};
    PyObject *x, *w, *bias = Py_None, *acc = Py_None;
    const char *wdt = "float32";
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|sOO", kwlist, &x, &w, &wdt, &bias, &acc)) return NULL;
    PyObject *cap = make_matrix(w, wdt);
    if (!cap) return NULL;
    PyObject *out = run_matmul(PyCapsule_GetPointer(cap, MATRIX_CAPSULE), x, bias, acc);
    Py_DECREF(cap);
    return out;
}

static PyObject *py_cuda_kernel_matrix(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kwlist[] = {"w", "weight_dtype", NULL};
    PyObject *w;
    const char *wdt = "float32";
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|s", kwlist, &w, &wdt)) return NULL;
    return make_matrix(w, wdt);
}

static PyObject *py_cuda_kernel_matmul(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kwlist[] = {"mat", "x", "bias", "accumulate", NULL};
    PyObject *cap, *x, *bias = Py_None, *acc = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|OO", kwlist, &cap, &x, &bias, &acc)) return NULL;
    cv_matrix *m = get_matrix(cap);
    if (!m) return NULL;
    return run_matmul(m, x, bias, acc);
}

static PyObject *py_cuda_kernel_matmul_time(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kwlist[] = {"mat", "x", "repeats", "calls", NULL};
    PyObject *cap, *x_obj;
    int repeats = 10, calls = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|ii", kwlist, &cap, &x_obj, &repeats, &calls)) return NULL;
    cv_matrix *m = get_matrix(cap);
    if (!m) return NULL;
    cv_backend *b = get_cuda();
    if (!b) return NULL;
    if (repeats < 1 || calls < 1) {
        PyErr_SetString(PyExc_ValueError, "repeats and calls must be >= 1");
        return NULL;
    }
    PyArrayObject *x = cv_py_want_array(x_obj, "x", NPY_FLOAT32, 2, 0);
    if (!x) return NULL;
    const int64_t n = PyArray_DIM(x, 0);
    if (PyArray_DIM(x, 1) != m->cols || n < 1) {
        PyErr_Format(PyExc_ValueError, "x must have shape [n >= 1][%lld]", (long long)m->cols);
        return NULL;
    }
    const float *xp = PyArray_DATA(x);
    double best = 0.0;
    cv_err err = {0};
    int rc;
    CU_RUN({
        dev d = {.b = b};
        float *dx = dev_put(&d, xp, (size_t)(n * m->cols) * 4);
        float *dout = dev_zero(&d, (size_t)(n * m->rows) * 4);
        if (!d.oom) {
            b->gemm(b, dout, dx, n, m, NULL, 0); /* warm-up */
            b->sync(b);
            for (int r = 0; r < repeats; r++) {
                const double t0 = cv_now();
                for (int i = 0; i < calls; i++) b->gemm(b, dout, dx, n, m, NULL, 0);
                b->sync(b);
                const double dt = (cv_now() - t0) / calls;
                if (r == 0 || dt < best) best = dt;
            }
        }
        rc = dev_finish(&d, &err);
    });
    if (rc) return cv_py_raise(&err);
    return PyFloat_FromDouble(best);
}

/* ------------------------------------------------------------ row kernels */

static PyObject *py_cuda_kernel_rmsnorm(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kwlist[] = {"x", "weight", "eps", NULL};
    PyObject *x_obj, *w_obj;
    double eps = 1e-5;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|d", kwlist, &x_obj, &w_obj, &eps)) return NULL;
    cv_backend *b = get_cuda();
    if (!b) return NULL;
    cv_py_norm_args a;
    if (cv_py_want_norm_args(&a, x_obj, w_obj) < 0) return NULL;
    const int64_t n = a.n, dim = a.dim;
    cv_err err = {0};
    int rc = 0;
    if (n > 0 && dim > 0) {
        float *o = PyArray_DATA((PyArrayObject *)a.out);              /* [n][dim] */
        const float *xp = PyArray_DATA(a.x), *wp = PyArray_DATA(a.w); /* [n][dim], [dim] */
        const size_t xb = (size_t)(n * dim) * 4;
        const float fe = (float)eps;
        CU_RUN({
            dev d = {.b = b};
            float *dx = dev_put(&d, xp, xb), *dw = dev_put(&d, wp, (size_t)dim * 4), *dout = dev_zero(&d, xb);
            if (!d.oom) {
                b->rmsnorm(b, dout, dx, dw, n, dim, fe);
                b->to_host(b, o, dout, xb);
            }
            rc = dev_finish(&d, &err);
        });
    }
    if (rc) {
        Py_DECREF(a.out);
        return cv_py_raise(&err);
    }
    return a.out;
}

static PyObject *py_cuda_kernel_rope(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kwlist[] = {"q", "k", "pos", "inv_freq", "layout", "host_freq", NULL};
    PyObject *q_obj, *k_obj, *pos_obj, *f_obj;
    const char *layout = "halves";
    int host_freq = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOO|sp", kwlist, &q_obj, &k_obj, &pos_obj, &f_obj, &layout,
                                     &host_freq))
        return NULL;
    cv_backend *b = get_cuda();
    if (!b) return NULL;
    cv_py_rope_args a;
    if (cv_py_want_rope_args(&a, q_obj, k_obj, pos_obj, f_obj, layout) < 0) return NULL;
    cv_py_rows3 q = a.q, k = a.k;
    if (q.n == 0) Py_RETURN_NONE;
    /* One fused [n][(h + hk) * d] buffer, q then k, like the engine's qkv rows. */
    const int64_t stride = (q.h + k.h) * q.d;
    const size_t bytes = (size_t)(q.n * stride) * 4;
    float *host = PyMem_Malloc(bytes);
    if (!host) return PyErr_NoMemory();
    pack_rows(host, stride, 0, &q);
    if (k.data) pack_rows(host, stride, q.h * q.d, &k);
    const int32_t *pp = a.pos;
    const float *fp = a.rope.inv_freq;
    cv_rope rope = a.rope;
    cv_err err = {0};
    int rc;
    CU_RUN({
        dev d = {.b = b};
        float *dqk = dev_put(&d, host, bytes);
        int32_t *dpos = dev_put(&d, pp, (size_t)q.n * 4);
        const float *dfreq = host_freq ? fp : (const float *)dev_put(&d, fp, (size_t)(q.d / 2) * 4);
        if (!d.oom) {
            rope.inv_freq = dfreq;
            b->rope(b, dqk, stride, q.h, k.data ? dqk + q.h * q.d : NULL, stride, k.h, dpos, q.n, &rope);
            b->to_host(b, host, dqk, bytes);
        }
        rc = dev_finish(&d, &err);
    });
    if (!rc) {
        unpack_rows(&q, host, stride, 0);
        if (k.data) unpack_rows(&k, host, stride, q.h * q.d);
    }
    PyMem_Free(host);
    if (rc) return cv_py_raise(&err);
    Py_RETURN_NONE;
}

static PyObject *py_cuda_kernel_swiglu(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kwlist[] = {"gu", NULL};
    PyObject *g_obj;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O", kwlist, &g_obj)) return NULL;
    cv_backend *b = get_cuda();
    if (!b) return NULL;
    PyArrayObject *gu = cv_py_want_gate_up(g_obj);
    if (!gu) return NULL;
    const int64_t n = PyArray_DIM(gu, 0), two = PyArray_DIM(gu, 1);
    npy_intp dims[2] = {(npy_intp)n, (npy_intp)(two / 2)};
    PyObject *out = cv_py_new_f32(2, dims);
    if (!out || n == 0 || two == 0) return out;
    float *o = PyArray_DATA((PyArrayObject *)out);
    const float *gp = PyArray_DATA(gu);
    cv_err err = {0};
    int rc;
    CU_RUN({
        dev d = {.b = b};
        float *dg = dev_put(&d, gp, (size_t)(n * two) * 4), *dout = dev_zero(&d, (size_t)(n * two / 2) * 4);
        if (!d.oom) {
            b->swiglu(b, dout, dg, n, two / 2);
            b->to_host(b, o, dout, (size_t)(n * two / 2) * 4);
        }
        rc = dev_finish(&d, &err);
    });
    return out_or_raise(out, rc, &err);
}

static PyObject *py_cuda_kernel_embedding(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kwlist[] = {"table", "tokens", "table_dtype", "validate", NULL};
    PyObject *t_obj, *tok_obj;
    const char *tdt = "float32";
    int validate = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|sp", kwlist, &t_obj, &tok_obj, &tdt, &validate)) return NULL;
    cv_backend *b = get_cuda();
    if (!b) return NULL;
    cv_dtype dt, st;
    if (cv_py_parse_dtype(tdt, "table_dtype", 0, &dt) < 0) return NULL;
    PyArrayObject *t = cv_py_want_matrix(t_obj, "table", 0, &st);
    PyArrayObject *tok = t ? cv_py_want_tokens(tok_obj, t, validate) : NULL;
    if (!tok) return NULL;
    const int64_t rows = PyArray_DIM(t, 0), cols = PyArray_DIM(t, 1), n = PyArray_DIM(tok, 0);
    const int32_t *tp = PyArray_DATA(tok); /* [n] */
    npy_intp dims[2] = {(npy_intp)n, (npy_intp)cols};
    PyObject *out = cv_py_new_f32(2, dims);
    if (!out || n == 0) return out;
    float *o = PyArray_DATA((PyArrayObject *)out);
    const void *src = PyArray_DATA(t);
    cv_err err = {0};
    int rc;
    CU_RUN({
        cv_table table;
        rc = b->table_prepare(b, &table, src, st, rows, cols, dt, &err);
        if (rc == CV_OK) {
            dev d = {.b = b};
            int32_t *dtok = dev_put(&d, tp, (size_t)n * 4);
            float *dout = dev_zero(&d, (size_t)(n * cols) * 4);
            if (!d.oom) {
                b->embedding(b, dout, dtok, n, &table);
                b->to_host(b, o, dout, (size_t)(n * cols) * 4);
            }
            rc = dev_finish(&d, &err);
            b->table_free(b, &table);
        }
    });
    return out_or_raise(out, rc, &err);
}

/* ------------------------------------------------------ cache, attention */

static PyObject *py_cuda_kernel_kv_write(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kwlist[] = {"k_cache", "v_cache", "k", "v", "slot_mapping", "cache_dtype", "validate", NULL};
    PyObject *kc_obj, *vc_obj, *k_obj, *v_obj, *s_obj;
    const char *cdt = NULL;
    int validate = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOO|zp", kwlist, &kc_obj, &vc_obj, &k_obj, &v_obj, &s_obj, &cdt,
                                     &validate))
        return NULL;
    cv_backend *b = get_cuda();
    if (!b) return NULL;
    cv_py_kv_write_args a;
    if (cv_py_want_kv_write_args(&a, kc_obj, vc_obj, k_obj, v_obj, s_obj, cdt, validate) < 0) return NULL;
    if (a.cache.dtype == CV_I8)
        return PyErr_Format(cv_UnsupportedError, "an int8 KV cache (kv_cache_dtype='int8') is CPU only");
    const cv_kv_layer cache = a.cache;
    const cv_py_rows3 k = a.k, v = a.v;
    const int64_t *sp = a.slots;
    PyArrayObject *ka = a.k_cache, *va = a.v_cache;
    if (k.n == 0) Py_RETURN_NONE;
    const int64_t row = cache.n_kv_heads * cache.head_dim, stride = 2 * row;
    const size_t kvb = (size_t)(k.n * stride) * 4, cb = (size_t)PyArray_NBYTES(ka);
    float *host = PyMem_Malloc(kvb);
    if (!host) return PyErr_NoMemory();
    pack_rows(host, stride, 0, &k);
    pack_rows(host, stride, row, &v);
    void *hk = PyArray_DATA(ka), *hv = PyArray_DATA(va);
    cv_err err = {0};
    int rc;
    CU_RUN({
        dev d = {.b = b};
        float *dkv = dev_put(&d, host, kvb);
        int64_t *dslots = dev_put(&d, sp, (size_t)k.n * 8);
        cv_kv_layer dc = cache;
        dc.k = dev_put(&d, hk, cb);
        dc.v = dev_put(&d, hv, cb);
        if (!d.oom) {
            b->kv_write(b, &dc, dkv, stride, dkv + row, stride, dslots, k.n);
            b->to_host(b, hk, dc.k, cb);
            b->to_host(b, hv, dc.v, cb);
        }
        rc = dev_finish(&d, &err);
    });
    PyMem_Free(host);
    if (rc) return cv_py_raise(&err);
    Py_RETURN_NONE;
}

static PyObject *py_cuda_kernel_paged_attention(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kwlist[] = {"q", "k_cache", "v_cache", "block_tables", "context_lens", "query_start", "scale",
                             "cache_dtype", "validate", "max_context_len", NULL};
    PyObject *q_obj, *kc_obj, *vc_obj, *bt_obj, *cl_obj, *qs_obj, *scale_obj = Py_None, *mcl_obj = Py_None;
    const char *cdt = NULL;
    int validate = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOO|OzpO", kwlist, &q_obj, &kc_obj, &vc_obj, &bt_obj, &cl_obj,
                                     &qs_obj, &scale_obj, &cdt, &validate, &mcl_obj))
        return NULL;
    cv_backend *b = get_cuda();
    if (!b) return NULL;
    cv_py_attention_args a;
    if (cv_py_want_attention_args(&a, q_obj, kc_obj, vc_obj, bt_obj, cl_obj, qs_obj, scale_obj, mcl_obj, cdt,
                                  validate, 1, 0) < 0)
        return NULL;
    if (a.cache.dtype == CV_I8)
        return PyErr_Format(cv_UnsupportedError, "an int8 KV cache (kv_cache_dtype='int8') is CPU only");
    const cv_kv_layer cache = a.cache;
    const cv_py_rows3 q = a.q;
    const int64_t n_seqs = a.ab.n_seqs, mb = a.ab.max_blocks_per_seq;
    PyArrayObject *ka = a.k_cache, *va = a.v_cache;
    npy_intp dims[2] = {(npy_intp)q.n, (npy_intp)(q.h * q.d)};
    PyObject *out = cv_py_new_f32(2, dims);
    if (!out || q.n == 0 || n_seqs == 0) return out;
    /* q rows on the device with a stride wider than a row, like the qkv buffer. */
    const int64_t qstride = q.h * q.d + 8;
    const size_t qb = (size_t)(q.n * qstride) * 4, ob = (size_t)(q.n * q.h * q.d) * 4;
    const size_t cb = (size_t)PyArray_NBYTES(ka);
    float *host = PyMem_Calloc(1, qb);
    if (!host) {
        Py_DECREF(out);
        return PyErr_NoMemory();
    }
    pack_rows(host, qstride, 0, &q);
    float *o = PyArray_DATA((PyArrayObject *)out);
    const void *hk = PyArray_DATA(ka), *hv = PyArray_DATA(va);
    cv_err err = {0};
    int rc;
    CU_RUN({
        dev d = {.b = b};
        float *dq = dev_put(&d, host, qb);
        float *dout = dev_zero(&d, ob);
        cv_kv_layer dc = cache;
        dc.k = dev_put(&d, hk, cb);
        dc.v = dev_put(&d, hv, cb);
        cv_attn_batch ab = a.ab; /* with device copies of the int32 arrays */
        ab.block_tables = dev_put(&d, a.ab.block_tables, (size_t)(n_seqs * mb) * 4);
        ab.context_lens = dev_put(&d, a.ab.context_lens, (size_t)n_seqs * 4);
        ab.query_start = dev_put(&d, a.ab.query_start, (size_t)(n_seqs + 1) * 4);
        if (!d.oom) {
            b->paged_attention(b, dout, dq, qstride, &dc, &ab);
            b->to_host(b, o, dout, ob);
        }
        rc = dev_finish(&d, &err);
    });
    PyMem_Free(host);
    return out_or_raise(out, rc, &err);
}

/* ------------------------------------------------------------------ table */

#define KW (PyCFunction)(void (*)(void))
static PyMethodDef cuda_methods[] = {
    {"cuda_available", (PyCFunction)py_cuda_available, METH_NOARGS,
     "cuda_available() -> bool: whether the CUDA backend loads and finds a device (tried once)."},
    {"cuda_check", (PyCFunction)py_cuda_check, METH_NOARGS,
     "cuda_check(): raises conveyor.UnsupportedError saying why the CUDA backend is unavailable."},
    {"cuda_info", (PyCFunction)py_cuda_info, METH_NOARGS, "cuda_info() -> dict about the CUDA device."},
    {"cuda_memcpy_bandwidth", KW py_cuda_memcpy_bandwidth, METH_VARARGS | METH_KEYWORDS,
     "cuda_memcpy_bandwidth(n_bytes, repeats=5) -> GB/s of a device-to-device copy (read + write)."},
    {"cuda_kernel_gemm", KW py_cuda_kernel_gemm, METH_VARARGS | METH_KEYWORDS,
     "cuda_kernel_gemm(x, w, weight_dtype='float32', bias=None, accumulate=None)"},
    {"cuda_kernel_matrix", KW py_cuda_kernel_matrix, METH_VARARGS | METH_KEYWORDS,
     "cuda_kernel_matrix(w, weight_dtype='float32') -> a matrix on the device."},
    {"cuda_kernel_matmul", KW py_cuda_kernel_matmul, METH_VARARGS | METH_KEYWORDS,
     "cuda_kernel_matmul(mat, x, bias=None, accumulate=None)"},
    {"cuda_kernel_matmul_time", KW py_cuda_kernel_matmul_time, METH_VARARGS | METH_KEYWORDS,
     "cuda_kernel_matmul_time(mat, x, repeats=10, calls=1) -> best seconds per GEMM over `calls` GEMMs\n"
     "and one device sync."},
    {"cuda_kernel_rmsnorm", KW py_cuda_kernel_rmsnorm, METH_VARARGS | METH_KEYWORDS,
     "cuda_kernel_rmsnorm(x, weight, eps=1e-5) -> out"},
    {"cuda_kernel_rope", KW py_cuda_kernel_rope, METH_VARARGS | METH_KEYWORDS,
     "cuda_kernel_rope(q, k, pos, inv_freq, layout='halves', host_freq=False): rotates q and k in place."},
    {"cuda_kernel_swiglu", KW py_cuda_kernel_swiglu, METH_VARARGS | METH_KEYWORDS,
     "cuda_kernel_swiglu(gu) -> silu(gate) * up"},
    {"cuda_kernel_embedding", KW py_cuda_kernel_embedding, METH_VARARGS | METH_KEYWORDS,
     "cuda_kernel_embedding(table, tokens, table_dtype='float32', validate=True) -> rows"},
    {"cuda_kernel_kv_write", KW py_cuda_kernel_kv_write, METH_VARARGS | METH_KEYWORDS,
     "cuda_kernel_kv_write(k_cache, v_cache, k, v, slot_mapping, cache_dtype=None, validate=True)"},
    {"cuda_kernel_paged_attention", KW py_cuda_kernel_paged_attention, METH_VARARGS | METH_KEYWORDS,
     "cuda_kernel_paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start,\n"
     "                            scale=None, cache_dtype=None, validate=True, max_context_len=None)"},
    {NULL, NULL, 0, NULL},
};
#undef KW

int cv_py_add_cuda(PyObject *m) {
    return PyModule_AddFunctions(m, cuda_methods);
}
