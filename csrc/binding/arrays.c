/* Helpers shared by the binding files: see arrays.h. */
#include "arrays.h"

#include <math.h>
#include <string.h>

/* ------------------------------------------------------------------------ */
/* NumPy arrays                                                              */

const char *cv_py_npy_name(int type) {
    switch (type) {
    case NPY_FLOAT32: return "float32";
    case NPY_FLOAT16: return "float16";
    case NPY_UINT16: return "uint16";
    case NPY_INT32: return "int32";
    case NPY_INT64: return "int64";
    case NPY_FLOAT64: return "float64";
    default: return "another dtype";
    }
}

int cv_py_parse_dtype(const char *s, const char *what, int allow_auto, cv_dtype *out) {
    if (allow_auto && strcmp(s, "auto") == 0) *out = CV_DTYPE_INVALID;
    else if (strcmp(s, "float32") == 0) *out = CV_F32;
    else if (strcmp(s, "bfloat16") == 0) *out = CV_BF16;
    else if (strcmp(s, "float16") == 0) *out = CV_F16;
    else {
        PyErr_Format(PyExc_ValueError, "%s must be %s'float32', 'bfloat16' or 'float16', got '%s'",
                     what, allow_auto ? "'auto', " : "", s);
        return -1;
    }
    return 0;
}

int cv_py_parse_kv_dtype(const char *s, const char *what, int allow_auto, cv_dtype *out) {
    if (strcmp(s, "int8") == 0) {
        *out = CV_I8;
        return 0;
    }
    if (strcmp(s, "float32") == 0 || strcmp(s, "bfloat16") == 0 || strcmp(s, "float16") == 0 ||
        (allow_auto && strcmp(s, "auto") == 0))
        return cv_py_parse_dtype(s, what, allow_auto, out);
    PyErr_Format(PyExc_ValueError, "%s must be %s'float32', 'bfloat16', 'float16' or 'int8', got '%s'", what,
                 allow_auto ? "'auto', " : "", s);
    return -1;
}

int cv_py_parse_quantization(const char *s, cv_dtype *out) {
    if (!s) *out = CV_DTYPE_INVALID;
    else if (strcmp(s, "q8_0") == 0) *out = CV_Q8_0;
    else if (strcmp(s, "q4_0") == 0) *out = CV_Q4_0;
    else if (strcmp(s, "q4_1") == 0) *out = CV_Q4_1;
    else {
        PyErr_Format(PyExc_ValueError, "quantization must be None, 'q8_0', 'q4_0' or 'q4_1', got '%s'", s);
        return -1;
    }
    return 0;
}

int cv_py_parse_activation_dtype(const char *s, int *exact) {
    if (strcmp(s, "auto") == 0) *exact = 0;
    else if (strcmp(s, "float32") == 0) *exact = 1;
    else {
        PyErr_Format(PyExc_ValueError, "activation_dtype must be 'auto' or 'float32', got '%s'", s);
        return -1;
    }
    return 0;
}

/* o as an ndarray, or NULL with TypeError. */
static PyArrayObject *as_ndarray(PyObject *o, const char *name) {
    if (PyArray_Check(o)) return (PyArrayObject *)o;
    PyErr_Format(PyExc_TypeError, "%s must be a numpy array", name);
    return NULL;
}

/* TypeError unless a has NumPy type `type` in native byte order. The dtype
 * got is named by NumPy (">f4", "int8"), so any dtype reads clearly. */
static int check_dtype(PyArrayObject *a, const char *name, int type) {
    if (PyArray_TYPE(a) == type && PyArray_ISNOTSWAPPED(a)) return 0;
    PyErr_Format(PyExc_TypeError, "%s must have dtype %s (native byte order), got %S", name,
                 cv_py_npy_name(type), (PyObject *)PyArray_DESCR(a));
    return -1;
}

static int check_writeable(PyArrayObject *a, const char *name, int writeable) {
    if (!writeable || PyArray_ISWRITEABLE(a)) return 0;
    PyErr_Format(PyExc_ValueError, "%s must be writeable", name);
    return -1;
}

PyArrayObject *cv_py_want_array(PyObject *o, const char *name, int type, int ndim, int writeable) {
    PyArrayObject *a = as_ndarray(o, name);
    if (!a || check_dtype(a, name, type) < 0) return NULL;
    if (ndim >= 0 && PyArray_NDIM(a) != ndim) {
        PyErr_Format(PyExc_ValueError, "%s must have %d dimensions, got %d", name, ndim,
                     PyArray_NDIM(a));
        return NULL;
    }
    if (!PyArray_IS_C_CONTIGUOUS(a) || !PyArray_ISALIGNED(a)) {
        PyErr_Format(PyExc_ValueError, "%s must be C-contiguous and aligned", name);
        return NULL;
    }
    if (check_writeable(a, name, writeable) < 0) return NULL;
    return a;
}

int cv_py_want_rows3(PyObject *o, const char *name, int writeable, cv_py_rows3 *r) {
    PyArrayObject *a = as_ndarray(o, name);
    if (!a || check_dtype(a, name, NPY_FLOAT32) < 0) return -1;
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
    if (check_writeable(a, name, writeable) < 0) return -1;
    r->data = PyArray_DATA(a);
    r->stride = r->n <= 1 ? r->h * r->d : (int64_t)(st[0] / 4);
    return 0;
}

PyArrayObject *cv_py_want_source(PyObject *o, const char *name, cv_dtype *dt) {
    PyArrayObject *a = as_ndarray(o, name);
    if (!a) return NULL;
    const int t = PyArray_TYPE(a);
    switch (t) {
    case NPY_FLOAT32: *dt = CV_F32; break;
    case NPY_FLOAT64: *dt = CV_F64; break;
    case NPY_FLOAT16: *dt = CV_F16; break;
    case NPY_UINT16: *dt = CV_BF16; break;
    default:
        PyErr_Format(PyExc_TypeError,
                     "%s must be float32, float64, float16 or uint16 (bfloat16 bits), got %S", name,
                     (PyObject *)PyArray_DESCR(a));
        return NULL;
    }
    return cv_py_want_array(o, name, t, 2, 0);
}

PyArrayObject *cv_py_want_matrix(PyObject *o, const char *name, int any_source, cv_dtype *dt) {
    PyArrayObject *a = any_source ? cv_py_want_source(o, name, dt) : cv_py_want_array(o, name, NPY_FLOAT32, 2, 0);
    if (!a) return NULL;
    if (!any_source) *dt = CV_F32;
    const int64_t rows = PyArray_DIM(a, 0), cols = PyArray_DIM(a, 1);
    if (rows < 1 || cols < 1) {
        PyErr_Format(PyExc_ValueError, "%s must be non-empty, got [%lld][%lld]", name, (long long)rows,
                     (long long)cols);
        return NULL;
    }
    return a;
}

PyObject *cv_py_new_f32(int nd, npy_intp *dims) {
    return PyArray_ZEROS(nd, dims, NPY_FLOAT32, 0);
}

int cv_py_want_cache(PyObject *k_obj, PyObject *v_obj, const char *cache_dtype, int writeable,
                     cv_kv_layer *c, PyArrayObject **ka, PyArrayObject **va) {
    if (!PyArray_Check(k_obj) || !PyArray_Check(v_obj)) {
        PyErr_SetString(PyExc_TypeError, "k_cache and v_cache must be numpy arrays");
        return -1;
    }
    PyArrayObject *kobj = (PyArrayObject *)k_obj;
    const int kt = PyArray_TYPE(kobj);
    int npt;
    if (cache_dtype && cache_dtype[0]) {
        if (cv_py_parse_kv_dtype(cache_dtype, "cache_dtype", 0, &c->dtype) < 0) return -1;
        npt = c->dtype == CV_F32 ? NPY_FLOAT32
              : c->dtype == CV_F16 ? NPY_FLOAT16
              : c->dtype == CV_I8  ? NPY_INT8
                                   : NPY_UINT16;
    } else if (kt == NPY_FLOAT32 || kt == NPY_FLOAT16 || kt == NPY_INT8) {
        c->dtype = kt == NPY_FLOAT32 ? CV_F32 : kt == NPY_FLOAT16 ? CV_F16 : CV_I8;
        npt = kt;
    } else {
        PyErr_Format(PyExc_TypeError,
                     "k_cache must be float32, float16 or int8 (or uint16 with cache_dtype='bfloat16'), got %S",
                     (PyObject *)PyArray_DESCR(kobj));
        return -1;
    }
    PyArrayObject *k = cv_py_want_array(k_obj, "k_cache", npt, 4, writeable);
    PyArrayObject *v = k ? cv_py_want_array(v_obj, "v_cache", npt, 4, writeable) : NULL;
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
    if (ka) *ka = k;
    if (va) *va = v;
    c->k_scale = c->v_scale = NULL;
    return 0;
}

int cv_py_want_kv_scales(cv_kv_layer *c, PyObject *ks_obj, PyObject *vs_obj, int writeable) {
    const int given = (ks_obj && ks_obj != Py_None) || (vs_obj && vs_obj != Py_None);
    if (c->dtype != CV_I8) {
        if (given) {
            PyErr_SetString(PyExc_ValueError, "k_scale and v_scale go with an int8 cache only");
            return -1;
        }
        return 0;
    }
    if (!ks_obj || ks_obj == Py_None || !vs_obj || vs_obj == Py_None) {
        PyErr_SetString(PyExc_ValueError,
                        "an int8 cache needs k_scale and v_scale (float32 [num_blocks][n_kv_heads][block_size])");
        return -1;
    }
    PyArrayObject *ks = cv_py_want_array(ks_obj, "k_scale", NPY_FLOAT32, 3, writeable);
    PyArrayObject *vs = ks ? cv_py_want_array(vs_obj, "v_scale", NPY_FLOAT32, 3, writeable) : NULL;
    if (!vs) return -1;
    const int64_t want[3] = {c->num_blocks, c->n_kv_heads, c->block_size};
    for (int i = 0; i < 3; i++)
        if (PyArray_DIM(ks, i) != want[i] || PyArray_DIM(vs, i) != want[i]) {
            PyErr_SetString(PyExc_ValueError, "k_scale and v_scale must have shape [num_blocks][n_kv_heads][block_size] "
                                              "of the cache");
            return -1;
        }
    c->k_scale = PyArray_DATA(ks);
    c->v_scale = PyArray_DATA(vs);
    return 0;
}

/* ------------------------------------------------------------------------ */
/* Dicts, lists, paths                                                       */

int cv_py_put(PyObject *d, const char *key, PyObject *v) {
    if (!v) return -1;
    int rc = PyDict_SetItemString(d, key, v);
    Py_DECREF(v);
    return rc;
}

/* A new list of ints from v32[n] or, when v32 is NULL, v64[n]. */
static PyObject *int_list(const int32_t *v32, const int64_t *v64, int64_t n) {
    PyObject *l = PyList_New((Py_ssize_t)n);
    if (!l) return NULL;
    for (int64_t i = 0; i < n; i++) {
        PyObject *x = PyLong_FromLongLong(v32 ? (long long)v32[i] : (long long)v64[i]);
        if (!x) {
            Py_DECREF(l);
            return NULL;
        }
        PyList_SET_ITEM(l, (Py_ssize_t)i, x);
    }
    return l;
}

PyObject *cv_py_int32_list(const int32_t *v, int64_t n) { return int_list(v, NULL, n); }

PyObject *cv_py_int64_list(const int64_t *v, int64_t n) { return int_list(NULL, v, n); }

const char *cv_py_arch_name(int arch) {
    static const char *const names[] = {"llama", "mistral", "qwen2", "qwen3", "gemma3"};
    return arch >= 0 && arch < (int)(sizeof names / sizeof names[0]) ? names[arch] : "unknown";
}

int cv_py_put_model_dims(PyObject *d, const cv_model_config *c) {
    if (cv_py_put(d, "arch", PyUnicode_FromString(cv_py_arch_name(c->arch))) < 0 ||
        cv_py_put(d, "dim", PyLong_FromLongLong(c->dim)) < 0 ||
        cv_py_put(d, "hidden_dim", PyLong_FromLongLong(c->hidden_dim)) < 0 ||
        cv_py_put(d, "n_layers", PyLong_FromLongLong(c->n_layers)) < 0 ||
        cv_py_put(d, "n_heads", PyLong_FromLongLong(c->n_heads)) < 0 ||
        cv_py_put(d, "n_kv_heads", PyLong_FromLongLong(c->n_kv_heads)) < 0 ||
        cv_py_put(d, "head_dim", PyLong_FromLongLong(c->head_dim)) < 0 ||
        cv_py_put(d, "vocab_size", PyLong_FromLongLong(c->vocab_size)) < 0 ||
        cv_py_put(d, "max_pos", PyLong_FromLongLong(c->max_pos)) < 0)
        return -1;
    return 0;
}

int cv_py_put_model_config(PyObject *d, const cv_model_config *c) {
    if (cv_py_put_model_dims(d, c) < 0 ||
        cv_py_put(d, "rms_eps", PyFloat_FromDouble(c->rms_eps)) < 0 ||
        cv_py_put(d, "rope_theta", PyFloat_FromDouble(c->rope_theta)) < 0 ||
        cv_py_put(d, "rope_layout",
                  PyUnicode_FromString(c->rope_layout == CV_ROPE_PAIRS ? "pairs" : "halves")) < 0)
        return -1;
    return 0;
}

PyObject *cv_py_fs_path(PyObject *arg, const char *what, PyObject **str) {
    PyObject *fs = PyOS_FSPath(arg); /* TypeError for anything but str, bytes, os.PathLike */
    PyObject *bytes = NULL, *ret = NULL;
    if (!fs) return NULL;
    if (PyUnicode_Check(fs)) {
        bytes = PyUnicode_EncodeFSDefault(fs);
        if (!bytes) goto done;
    } else {
        bytes = Py_NewRef(fs);
    }
    const char *cpath = PyBytes_AS_STRING(bytes);
    if ((size_t)PyBytes_GET_SIZE(bytes) != strlen(cpath)) {
        PyErr_Format(PyExc_ValueError, "%s path contains a NUL byte", what);
        goto done;
    }
    if (str) {
        /* an exact str (a subclass is copied): holders need no GC support */
        *str = PyUnicode_Check(fs) ? PyUnicode_FromObject(fs) : PyUnicode_DecodeFSDefault(cpath);
        if (!*str) goto done;
    }
    ret = bytes;
    bytes = NULL;
done:
    Py_DECREF(fs);
    Py_XDECREF(bytes);
    return ret;
}

/* ------------------------------------------------------------------------ */
/* Arguments of the kernel hooks                                             */

int cv_py_want_gemm_args(cv_py_gemm_args *a, PyObject *x_obj, PyObject *bias_obj, PyObject *acc_obj,
                         int64_t rows, int64_t cols) {
    memset(a, 0, sizeof *a);
    a->x = cv_py_want_array(x_obj, "x", NPY_FLOAT32, 2, 0);
    if (!a->x) return -1;
    a->n = PyArray_DIM(a->x, 0);
    if (PyArray_DIM(a->x, 1) != cols) {
        PyErr_Format(PyExc_ValueError, "x has %lld columns, the matrix %lld",
                     (long long)PyArray_DIM(a->x, 1), (long long)cols);
        return -1;
    }
    if (bias_obj && bias_obj != Py_None) {
        PyArrayObject *ba = cv_py_want_array(bias_obj, "bias", NPY_FLOAT32, 1, 0);
        if (!ba) return -1;
        if (PyArray_DIM(ba, 0) != rows) {
            PyErr_Format(PyExc_ValueError, "bias has %lld entries, the matrix %lld rows",
                         (long long)PyArray_DIM(ba, 0), (long long)rows);
            return -1;
        }
        a->bias = PyArray_DATA(ba);
    }
    if (acc_obj && acc_obj != Py_None) {
        PyArrayObject *aa = cv_py_want_array(acc_obj, "accumulate", NPY_FLOAT32, 2, 0);
        if (!aa) return -1;
        if (PyArray_DIM(aa, 0) != a->n || PyArray_DIM(aa, 1) != rows) {
            PyErr_Format(PyExc_ValueError, "accumulate must have shape [%lld][%lld]", (long long)a->n,
                         (long long)rows);
            return -1;
        }
        a->out = PyArray_NewCopy(aa, NPY_CORDER);
        a->accumulate = 1;
    } else {
        npy_intp dims[2] = {(npy_intp)a->n, (npy_intp)rows};
        a->out = cv_py_new_f32(2, dims);
    }
    return a->out ? 0 : -1;
}

int cv_py_want_norm_args(cv_py_norm_args *a, PyObject *x_obj, PyObject *w_obj) {
    memset(a, 0, sizeof *a);
    a->x = cv_py_want_array(x_obj, "x", NPY_FLOAT32, 2, 0);
    if (!a->x) return -1;
    const int64_t n = a->n = PyArray_DIM(a->x, 0), dim = a->dim = PyArray_DIM(a->x, 1);
    a->w = cv_py_want_array(w_obj, "weight", NPY_FLOAT32, 1, 0);
    if (!a->w) return -1;
    if (PyArray_DIM(a->w, 0) != dim) {
        PyErr_Format(PyExc_ValueError, "weight has %lld entries, x rows %lld",
                     (long long)PyArray_DIM(a->w, 0), (long long)dim);
        return -1;
    }
    npy_intp dims[2] = {(npy_intp)n, (npy_intp)dim};
    a->out = cv_py_new_f32(2, dims);
    return a->out ? 0 : -1;
}

PyArrayObject *cv_py_want_gate_up(PyObject *o) {
    PyArrayObject *gu = cv_py_want_array(o, "gu", NPY_FLOAT32, 2, 0);
    if (!gu) return NULL;
    if (PyArray_DIM(gu, 1) % 2) {
        PyErr_Format(PyExc_ValueError, "gu rows must be [gate | up] of even length, got %lld",
                     (long long)PyArray_DIM(gu, 1));
        return NULL;
    }
    return gu;
}

int cv_py_want_rope_args(cv_py_rope_args *a, PyObject *q_obj, PyObject *k_obj, PyObject *pos_obj,
                         PyObject *f_obj, const char *layout) {
    memset(a, 0, sizeof *a);
    if (strcmp(layout, "halves") == 0)
        a->rope.layout = CV_ROPE_HALVES;
    else if (strcmp(layout, "pairs") == 0)
        a->rope.layout = CV_ROPE_PAIRS;
    else {
        PyErr_Format(PyExc_ValueError, "layout must be 'halves' or 'pairs', got '%s'", layout);
        return -1;
    }
    cv_py_rows3 *q = &a->q, *k = &a->k;
    if (cv_py_want_rows3(q_obj, "q", 1, q) < 0) return -1;
    if (k_obj != Py_None && cv_py_want_rows3(k_obj, "k", 1, k) < 0) return -1;
    if (k_obj != Py_None && (k->n != q->n || k->d != q->d)) {
        PyErr_SetString(PyExc_ValueError, "k must have q's tokens and head_dim");
        return -1;
    }
    if (q->d < 2 || q->d % 2) {
        PyErr_Format(PyExc_ValueError, "head_dim must be even and >= 2, got %lld", (long long)q->d);
        return -1;
    }
    PyArrayObject *pos = cv_py_want_array(pos_obj, "pos", NPY_INT32, 1, 0);
    PyArrayObject *f = pos ? cv_py_want_array(f_obj, "inv_freq", NPY_FLOAT32, 1, 0) : NULL;
    if (!f) return -1;
    if (PyArray_DIM(pos, 0) != q->n || PyArray_DIM(f, 0) != q->d / 2) {
        PyErr_SetString(PyExc_ValueError, "pos must have one entry per token, inv_freq head_dim/2");
        return -1;
    }
    a->pos = PyArray_DATA(pos);
    a->rope.inv_freq = PyArray_DATA(f);
    a->rope.head_dim = q->d;
    return 0;
}

PyArrayObject *cv_py_want_tokens(PyObject *tok_obj, PyArrayObject *table, int validate) {
    PyArrayObject *tok = cv_py_want_array(tok_obj, "tokens", NPY_INT32, 1, 0);
    if (!tok) return NULL;
    const int64_t rows = PyArray_DIM(table, 0), n = PyArray_DIM(tok, 0);
    const int32_t *tp = PyArray_DATA(tok);
    for (int64_t i = 0; validate && i < n; i++)
        if (tp[i] < 0 || tp[i] >= rows) {
            PyErr_Format(PyExc_ValueError, "tokens[%lld] = %d is outside the table's %lld rows",
                         (long long)i, tp[i], (long long)rows);
            return NULL;
        }
    return tok;
}

int cv_py_want_kv_write_args(cv_py_kv_write_args *a, PyObject *kc_obj, PyObject *vc_obj,
                             PyObject *k_obj, PyObject *v_obj, PyObject *s_obj,
                             const char *cache_dtype, int validate) {
    memset(a, 0, sizeof *a);
    const cv_kv_layer *c = &a->cache;
    if (cv_py_want_cache(kc_obj, vc_obj, cache_dtype, 1, &a->cache, &a->k_cache, &a->v_cache) < 0)
        return -1;
    const cv_py_rows3 *k = &a->k, *v = &a->v;
    if (cv_py_want_rows3(k_obj, "k", 0, &a->k) < 0 || cv_py_want_rows3(v_obj, "v", 0, &a->v) < 0)
        return -1;
    if (k->n != v->n || k->h != c->n_kv_heads || v->h != c->n_kv_heads || k->d != c->head_dim ||
        v->d != c->head_dim) {
        PyErr_SetString(PyExc_ValueError, "k and v must have shape [tokens][n_kv_heads][head_dim] of the cache");
        return -1;
    }
    PyArrayObject *slots = cv_py_want_array(s_obj, "slot_mapping", NPY_INT64, 1, 0);
    if (!slots) return -1;
    if (PyArray_DIM(slots, 0) != k->n) {
        PyErr_SetString(PyExc_ValueError, "slot_mapping must have one entry per token");
        return -1;
    }
    const int64_t *sp = PyArray_DATA(slots);
    const int64_t n_slots = c->num_blocks * c->block_size;
    for (int64_t i = 0; validate && i < k->n; i++)
        if (sp[i] >= n_slots) {
            PyErr_Format(PyExc_ValueError, "slot_mapping[%lld] = %lld is past the cache's %lld slots",
                         (long long)i, (long long)sp[i], (long long)n_slots);
            return -1;
        }
    a->slots = sp;
    return 0;
}

/* Checks query_start, context_lens and (validate) the block tables of the
 * batch in ab against q_rows query rows and the cache; sets max_context_len. */
static int check_attention_batch(cv_attn_batch *ab, int64_t q_rows, const cv_kv_layer *c, int validate) {
    const int64_t n_seqs = ab->n_seqs, mb = ab->max_blocks_per_seq;
    const int32_t *tab = ab->block_tables, *ctx = ab->context_lens, *qsp = ab->query_start;
    if (n_seqs > 0 && qsp[0] != 0) {
        PyErr_SetString(PyExc_ValueError, "query_start[0] must be 0");
        return -1;
    }
    int64_t max_ctx = 0;
    for (int64_t s = 0; s < n_seqs; s++) {
        const int64_t nq = (int64_t)qsp[s + 1] - qsp[s];
        if (nq < 0 || qsp[s + 1] > q_rows) {
            PyErr_Format(PyExc_ValueError, "query_start must be non-decreasing and <= %lld rows",
                         (long long)q_rows);
            return -1;
        }
        if (ctx[s] < nq) {
            PyErr_Format(PyExc_ValueError, "context_lens[%lld] = %d is less than its %lld new tokens",
                         (long long)s, ctx[s], (long long)nq);
            return -1;
        }
        if (ctx[s] > max_ctx) max_ctx = ctx[s];
        if (!validate) continue;
        if ((int64_t)ctx[s] > mb * c->block_size) {
            PyErr_Format(PyExc_ValueError, "context_lens[%lld] = %d does not fit %lld blocks",
                         (long long)s, ctx[s], (long long)mb);
            return -1;
        }
        const int64_t used = (ctx[s] + c->block_size - 1) / c->block_size;
        for (int64_t i = 0; i < used; i++) {
            const int32_t blk = tab[s * mb + i];
            if (blk < 0 || blk >= c->num_blocks) {
                PyErr_Format(PyExc_ValueError, "block_tables[%lld][%lld] = %d is not a block of the cache",
                             (long long)s, (long long)i, blk);
                return -1;
            }
        }
    }
    ab->max_context_len = max_ctx;
    return 0;
}

int cv_py_want_attention_args(cv_py_attention_args *a, PyObject *q_obj, PyObject *kc_obj,
                              PyObject *vc_obj, PyObject *bt_obj, PyObject *cl_obj, PyObject *qs_obj,
                              PyObject *scale_obj, PyObject *mcl_obj, const char *cache_dtype,
                              int validate, int64_t min_blocks, int64_t max_head_dim) {
    memset(a, 0, sizeof *a);
    const cv_kv_layer *c = &a->cache;
    const cv_py_rows3 *q = &a->q;
    if (cv_py_want_cache(kc_obj, vc_obj, cache_dtype, 0, &a->cache, &a->k_cache, &a->v_cache) < 0)
        return -1;
    if (cv_py_want_rows3(q_obj, "q", 0, &a->q) < 0) return -1;
    if (q->d != c->head_dim || q->h < 1 || q->h % c->n_kv_heads) {
        PyErr_SetString(PyExc_ValueError,
                        "q must be [rows][n_heads][head_dim] with the cache's head_dim and n_heads a multiple of "
                        "n_kv_heads");
        return -1;
    }
    if (max_head_dim > 0 && q->d > max_head_dim) {
        PyErr_Format(PyExc_ValueError, "head_dim %lld is larger than %lld", (long long)q->d,
                     (long long)max_head_dim);
        return -1;
    }
    PyArrayObject *bt = cv_py_want_array(bt_obj, "block_tables", NPY_INT32, 2, 0);
    PyArrayObject *cl = bt ? cv_py_want_array(cl_obj, "context_lens", NPY_INT32, 1, 0) : NULL;
    PyArrayObject *qs = cl ? cv_py_want_array(qs_obj, "query_start", NPY_INT32, 1, 0) : NULL;
    if (!qs) return -1;
    const int64_t n_seqs = PyArray_DIM(cl, 0), mb = PyArray_DIM(bt, 1);
    if (PyArray_DIM(bt, 0) != n_seqs || PyArray_DIM(qs, 0) != n_seqs + 1 || mb < min_blocks) {
        if (min_blocks > 0)
            PyErr_Format(PyExc_ValueError,
                         "block_tables must be [n_seqs][max_blocks >= %lld], query_start [n_seqs + 1]",
                         (long long)min_blocks);
        else
            PyErr_SetString(PyExc_ValueError,
                            "block_tables must be [n_seqs][max_blocks], query_start [n_seqs + 1]");
        return -1;
    }
    cv_attn_batch *ab = &a->ab;
    ab->n_seqs = n_seqs;
    ab->query_start = PyArray_DATA(qs);
    ab->context_lens = PyArray_DATA(cl);
    ab->block_tables = PyArray_DATA(bt);
    ab->max_blocks_per_seq = mb;
    ab->n_heads = q->h;
    ab->n_kv_heads = c->n_kv_heads;
    ab->head_dim = q->d;
    if (check_attention_batch(ab, q->n, c, validate) < 0) return -1;
    if (mcl_obj && mcl_obj != Py_None) {
        const long long mcl = PyLong_AsLongLong(mcl_obj);
        if (mcl == -1 && PyErr_Occurred()) return -1;
        ab->max_context_len = mcl;
    }
    double scale = 1.0 / sqrt((double)q->d);
    if (scale_obj && scale_obj != Py_None) {
        scale = PyFloat_AsDouble(scale_obj);
        if (scale == -1.0 && PyErr_Occurred()) return -1;
    }
    ab->scale = (float)scale;
    return 0;
}
