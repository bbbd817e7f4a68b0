/* conveyor._testing.ModelRunner: one model on a CPU backend with its own paged KV
 * cache, driven batch by batch from Python (a test hook for the forward pass).
 *
 *   r = ModelRunner(path, dtype="auto", kv_cache_dtype="float32", block_size=16,
 *                   num_blocks=64, max_tokens=512, max_seqs=16, num_threads=0,
 *                   force_scalar=False, quantization=None)
 *   logits = r.forward(tokens, positions, slot_mapping, query_start, context_lens,
 *                      block_tables, logits_rows)   # float32 [n_logits][vocab]
 *   r.config, r.reset(), r.close(); also a context manager.
 *
 * Every index a kernel would follow is checked before the forward runs, so no
 * input can make it read or write outside its buffers: bad values raise
 * ValueError, non-integer arrays TypeError. The forward runs without the GIL;
 * a runner runs one call at a time: forward, reset, close and __init__ from
 * another thread meanwhile raise RuntimeError. */
#include "../binding/arrays.h"

#include <stdlib.h>
#include <string.h>

#include "../model/model.h"

typedef struct {
    PyObject_HEAD
    cv_backend *b;          /* owned; NULL when closed */
    cv_model *m;            /* owned */
    cv_forward_ws ws;
    int ws_ok;              /* ws holds buffers */
    cv_kv_layer *caches;    /* [n_layers] k/v buffers from b->alloc */
    cv_dtype kv_dtype;
    int64_t block_size, num_blocks, max_tokens, max_seqs;
    size_t kv_layer_bytes;  /* bytes of one layer's k (== v) */
    /* host batch handed to cv_model_forward (sized for the limits above) */
    int32_t *tokens;        /* [max_tokens] */
    int32_t *positions;     /* [max_tokens] */
    int64_t *slots;         /* [max_tokens] */
    int64_t *slots_sorted;  /* [max_tokens] scratch for the duplicate check */
    int32_t *query_start;   /* [max_seqs + 1] */
    int32_t *context_lens;  /* [max_seqs] */
    int32_t *block_tables;  /* [max_seqs][num_blocks] */
    int32_t *logits_rows;   /* [max_seqs] */
    int busy;               /* a forward runs without the GIL */
} ModelRunnerObject;

/* Everything a runner holds, so init can build into a local and swap. */
typedef struct runner_state {
    cv_backend *b;
    cv_model *m;
    cv_forward_ws ws;
    int ws_ok;
    cv_kv_layer *caches;
    int32_t *tokens, *positions, *query_start, *context_lens, *block_tables, *logits_rows;
    int64_t *slots, *slots_sorted;
} runner_state;

static void state_free(runner_state *s) {
    if (s->m) {
        cv_backend *b = s->b;
        if (s->ws_ok) cv_forward_ws_free(&s->ws, s->m);
        if (s->caches) {
            for (int64_t l = 0; l < s->m->cfg.n_layers; l++) {
                b->free(b, s->caches[l].k);
                b->free(b, s->caches[l].v);
                b->free(b, s->caches[l].k_scale);
                b->free(b, s->caches[l].v_scale);
            }
        }
        cv_model_free(s->m);
    }
    free(s->caches);
    if (s->b) s->b->destroy(s->b);
    free(s->tokens);
    free(s->positions);
    free(s->slots);
    free(s->slots_sorted);
    free(s->query_start);
    free(s->context_lens);
    free(s->block_tables);
    free(s->logits_rows);
    memset(s, 0, sizeof *s);
}

/* Moves the object's state out into s (the object is left closed). */
static void take_state(ModelRunnerObject *self, runner_state *s) {
    s->b = self->b;
    s->m = self->m;
    s->ws = self->ws;
    s->ws_ok = self->ws_ok;
    s->caches = self->caches;
    s->tokens = self->tokens;
    s->positions = self->positions;
    s->slots = self->slots;
    s->slots_sorted = self->slots_sorted;
    s->query_start = self->query_start;
    s->context_lens = self->context_lens;
    s->block_tables = self->block_tables;
    s->logits_rows = self->logits_rows;
    self->b = NULL;
    self->m = NULL;
    memset(&self->ws, 0, sizeof self->ws);
    self->ws_ok = 0;
    self->caches = NULL;
    self->tokens = self->positions = self->query_start = self->context_lens = NULL;
    self->block_tables = self->logits_rows = NULL;
    self->slots = self->slots_sorted = NULL;
}

static void put_state(ModelRunnerObject *self, runner_state *s) {
    self->b = s->b;
    self->m = s->m;
    self->ws = s->ws;
    self->ws_ok = s->ws_ok;
    self->caches = s->caches;
    self->tokens = s->tokens;
    self->positions = s->positions;
    self->slots = s->slots;
    self->slots_sorted = s->slots_sorted;
    self->query_start = s->query_start;
    self->context_lens = s->context_lens;
    self->block_tables = s->block_tables;
    self->logits_rows = s->logits_rows;
    memset(s, 0, sizeof *s);
}

/* Frees the object's state (GIL released: freeing a model is pure C). */
static void close_now(ModelRunnerObject *self) {
    runner_state s;
    take_state(self, &s);
    if (!s.b) return;
    Py_BEGIN_ALLOW_THREADS
    state_free(&s);
    Py_END_ALLOW_THREADS
}

static int check_usable(ModelRunnerObject *self) {
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "ModelRunner is in use by another thread");
        return -1;
    }
    if (!self->m) {
        cv_err e;
        cv_set_err(&e, CV_ERR_STATE, "ModelRunner is closed");
        cv_py_raise(&e);
        return -1;
    }
    return 0;
}

/* Bytes of one layer's K (or V) scales of an int8 cache: a float32 per row. */
static size_t kv_scale_bytes(const cv_kv_layer *kv) {
    return (size_t)kv->num_blocks * (size_t)kv->n_kv_heads * (size_t)kv->block_size * sizeof(float);
}

/* Builds the whole runner into st. Pure C: runs without the GIL. */
static int build_state(runner_state *st, const char *path, cv_dtype dtype, cv_dtype quant, cv_dtype kv_dtype,
                       int64_t bs, int64_t nblocks, int64_t max_tokens, int64_t max_seqs,
                       int num_threads, int force_scalar, int exact, size_t *kv_layer_bytes, cv_err *err) {
    int rc = CV_OK;
    st->b = cv_cpu_backend_create(num_threads, force_scalar, err);
    if (!st->b) return err->code ? err->code : CV_ERR_NOMEM;
    cv_backend_set_exact_activations(st->b, exact);
    cv_backend *b = st->b;
    rc = cv_model_load_quantized(&st->m, path, b, dtype, quant, NULL, err);
    if (rc) return rc;
    const cv_model_config *c = &st->m->cfg;

    /* k (and v) of one layer: [num_blocks][n_kv_heads][block_size][head_dim] */
    size_t elems, bytes;
    if (!cv_mul_size((size_t)nblocks, (size_t)c->n_kv_heads, &elems) ||
        !cv_mul_size(elems, (size_t)bs, &elems) || !cv_mul_size(elems, (size_t)c->head_dim, &elems) ||
        !cv_mul_size(elems, cv_dtype_size(kv_dtype), &bytes))
        return cv_set_err(err, CV_ERR_INVALID, "KV cache of %lld blocks of %lld tokens is too large",
                          (long long)nblocks, (long long)bs);
    *kv_layer_bytes = bytes;
    st->caches = calloc((size_t)c->n_layers, sizeof *st->caches);
    if (!st->caches) return cv_set_err(err, CV_ERR_NOMEM, "out of memory");
    for (int64_t l = 0; l < c->n_layers; l++) {
        cv_kv_layer *kv = &st->caches[l];
        kv->dtype = kv_dtype;
        kv->num_blocks = nblocks;
        kv->n_kv_heads = c->n_kv_heads;
        kv->block_size = bs;
        kv->head_dim = c->head_dim;
        kv->k = b->alloc(b, bytes);
        kv->v = b->alloc(b, bytes);
        if (kv_dtype == CV_I8) {
            kv->k_scale = b->alloc(b, kv_scale_bytes(kv));
            kv->v_scale = b->alloc(b, kv_scale_bytes(kv));
        }
        if (!kv->k || !kv->v || (kv_dtype == CV_I8 && (!kv->k_scale || !kv->v_scale)))
            return cv_set_err(err, CV_ERR_NOMEM, "out of memory for the KV cache (%zu bytes per layer)",
                              2 * bytes);
    }
    rc = cv_forward_ws_init(&st->ws, st->m, max_tokens, max_seqs, nblocks, err);
    if (rc) return rc;
    st->ws_ok = 1;

    size_t tab;
    if (!cv_mul_size((size_t)max_seqs, (size_t)nblocks, &tab) || tab > SIZE_MAX / sizeof(int32_t))
        return cv_set_err(err, CV_ERR_INVALID, "max_seqs * num_blocks is too large");
    st->tokens = malloc((size_t)max_tokens * sizeof(int32_t));
    st->positions = malloc((size_t)max_tokens * sizeof(int32_t));
    st->slots = malloc((size_t)max_tokens * sizeof(int64_t));
    st->slots_sorted = malloc((size_t)max_tokens * sizeof(int64_t));
    st->query_start = malloc((size_t)(max_seqs + 1) * sizeof(int32_t));
    st->context_lens = malloc((size_t)max_seqs * sizeof(int32_t));
    st->block_tables = malloc(tab * sizeof(int32_t));
    st->logits_rows = malloc((size_t)max_seqs * sizeof(int32_t));
    if (!st->tokens || !st->positions || !st->slots || !st->slots_sorted || !st->query_start || !st->context_lens ||
        !st->block_tables || !st->logits_rows)
        return cv_set_err(err, CV_ERR_NOMEM, "out of memory for the batch arrays");
    return CV_OK;
}

static int ModelRunner_init(ModelRunnerObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"path", "dtype", "kv_cache_dtype", "block_size", "num_blocks",
                             "max_tokens", "max_seqs", "num_threads", "force_scalar", "quantization",
                             "activation_dtype", NULL};
    PyObject *arg = NULL, *bytes = NULL;
    const char *dtype_s = "auto", *kv_s = "float32", *quant_s = NULL, *act_s = "auto";
    cv_dtype quant;
    long long bs = 16, nblocks = 64, max_tokens = 512, max_seqs = 16;
    int num_threads = 0, force_scalar = 0, exact = 0;
    cv_dtype dtype, kv_dtype;
    runner_state st;
    memset(&st, 0, sizeof st);
    int ret = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|$ssLLLLipzs:ModelRunner", kwlist, &arg, &dtype_s,
                                     &kv_s, &bs, &nblocks, &max_tokens, &max_seqs, &num_threads,
                                     &force_scalar, &quant_s, &act_s))
        return -1;
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "ModelRunner is in use by another thread");
        return -1;
    }
    if (cv_py_parse_dtype(dtype_s, "dtype", 1, &dtype) < 0 ||
        cv_py_parse_kv_dtype(kv_s, "kv_cache_dtype", 0, &kv_dtype) < 0 ||
        cv_py_parse_quantization(quant_s, &quant) < 0 || cv_py_parse_activation_dtype(act_s, &exact) < 0)
        return -1;
    /* int32 fields of the batch (positions, context lengths, query rows) bound these */
    if (bs < 1 || bs > 65536) {
        PyErr_Format(PyExc_ValueError, "block_size must be in 1..65536, got %lld", bs);
        return -1;
    }
    if (nblocks < 1 || nblocks > INT32_MAX / bs) {
        PyErr_Format(PyExc_ValueError, "num_blocks must be in 1..%lld for block_size %lld, got %lld",
                     (long long)(INT32_MAX / bs), bs, nblocks);
        return -1;
    }
    if (max_tokens < 1 || max_tokens > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "max_tokens must be in 1..%d, got %lld", INT32_MAX, max_tokens);
        return -1;
    }
    if (max_seqs < 1 || max_seqs > (1 << 20)) {
        PyErr_Format(PyExc_ValueError, "max_seqs must be in 1..%d, got %lld", 1 << 20, max_seqs);
        return -1;
    }
    if (num_threads < 0 || num_threads > 1024) {
        PyErr_Format(PyExc_ValueError, "num_threads must be in 0..1024 (0: all cores), got %d", num_threads);
        return -1;
    }
    bytes = cv_py_fs_path(arg, "model", NULL);
    if (!bytes) goto done;
    const char *cpath = PyBytes_AS_STRING(bytes);
    cv_err err;
    memset(&err, 0, sizeof err);
    size_t kv_layer_bytes = 0;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = build_state(&st, cpath, dtype, quant, kv_dtype, bs, nblocks, max_tokens, max_seqs, num_threads,
                     force_scalar, exact, &kv_layer_bytes, &err);
    if (rc) state_free(&st);
    Py_END_ALLOW_THREADS
    if (rc) {
        cv_py_raise(&err);
        goto done;
    }
    close_now(self); /* a second __init__ replaces the old runner */
    put_state(self, &st);
    self->kv_dtype = kv_dtype;
    self->block_size = bs;
    self->num_blocks = nblocks;
    self->max_tokens = max_tokens;
    self->max_seqs = max_seqs;
    self->kv_layer_bytes = kv_layer_bytes;
    ret = 0;
done:
    Py_XDECREF(bytes);
    return ret;
}

static void ModelRunner_dealloc(ModelRunnerObject *self) {
    PyTypeObject *type = Py_TYPE(self);
    close_now(self);
    type->tp_free((PyObject *)self);
    Py_DECREF(type);
}

/* ------------------------------------------------------------------------ */
/* forward                                                                   */

/* A new C-contiguous int64 array of ndim dims from an integer array (or
 * sequence); TypeError for non-integer data, ValueError for a wrong ndim. */
static PyArrayObject *as_i64(PyObject *o, const char *name, int ndim) {
    PyArrayObject *a = (PyArrayObject *)PyArray_FROM_O(o), *r = NULL;
    if (!a) return NULL;
    const npy_intp size = PyArray_SIZE(a);
    if (size > 0 && !PyArray_ISINTEGER(a)) {
        PyErr_Format(PyExc_TypeError, "%s must be an integer array, got dtype %R", name,
                     (PyObject *)PyArray_DESCR(a));
        goto done;
    }
    if (PyArray_NDIM(a) != ndim) {
        PyErr_Format(PyExc_ValueError, "%s must have %d dimension%s, got %d", name, ndim,
                     ndim == 1 ? "" : "s", PyArray_NDIM(a));
        goto done;
    }
    /* safe casting only (uint64 -> int64 raises); an empty array of any dtype is fine */
    r = (PyArrayObject *)PyArray_FromAny((PyObject *)a, PyArray_DescrFromType(NPY_INT64), 0, 0,
                                         NPY_ARRAY_CARRAY_RO | (size == 0 ? NPY_ARRAY_FORCECAST : 0),
                                         NULL);
done:
    Py_DECREF(a);
    return r;
}

#define N_FWD_ARGS 7

static int cmp_i64(const void *a, const void *b) {
    const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* Checks the batch against the model and the cache, and fills the runner's
 * host batch. Returns 0, or -1 with a Python exception set. */
static int fill_batch(ModelRunnerObject *self, PyArrayObject *const *arr, cv_batch *bt) {
    const cv_model_config *c = &self->m->cfg;
    const int64_t *tok = PyArray_DATA(arr[0]), *pos = PyArray_DATA(arr[1]),
                  *slot = PyArray_DATA(arr[2]), *qs = PyArray_DATA(arr[3]),
                  *ctx = PyArray_DATA(arr[4]), *tab = PyArray_DATA(arr[5]),
                  *rows = PyArray_DATA(arr[6]);
    const int64_t n = PyArray_DIM(arr[0], 0);
    const int64_t n_qs = PyArray_DIM(arr[3], 0);
    const int64_t n_seqs = n_qs - 1;
    const int64_t mb = PyArray_DIM(arr[5], 1);
    const int64_t n_logits = PyArray_DIM(arr[6], 0);
    const int64_t bs = self->block_size, n_slots = self->num_blocks * self->block_size;

    if (PyArray_DIM(arr[1], 0) != n || PyArray_DIM(arr[2], 0) != n) {
        PyErr_Format(PyExc_ValueError,
                     "tokens, positions and slot_mapping must have the same length, got %lld, %lld, %lld",
                     (long long)n, (long long)PyArray_DIM(arr[1], 0), (long long)PyArray_DIM(arr[2], 0));
        return -1;
    }
    if (n_qs < 1) {
        PyErr_SetString(PyExc_ValueError, "query_start must have n_seqs + 1 >= 1 entries");
        return -1;
    }
    if (PyArray_DIM(arr[4], 0) != n_seqs || PyArray_DIM(arr[5], 0) != n_seqs) {
        PyErr_Format(PyExc_ValueError,
                     "context_lens and block_tables must have n_seqs = len(query_start) - 1 = %lld "
                     "rows, got %lld and %lld",
                     (long long)n_seqs, (long long)PyArray_DIM(arr[4], 0), (long long)PyArray_DIM(arr[5], 0));
        return -1;
    }
    if (n > self->max_tokens) {
        PyErr_Format(PyExc_ValueError, "%lld tokens exceed max_tokens %lld", (long long)n,
                     (long long)self->max_tokens);
        return -1;
    }
    if (n_seqs > self->max_seqs || n_logits > self->max_seqs) {
        PyErr_Format(PyExc_ValueError, "%lld sequences / %lld logits rows exceed max_seqs %lld",
                     (long long)n_seqs, (long long)n_logits, (long long)self->max_seqs);
        return -1;
    }
    if (mb > self->num_blocks) {
        PyErr_Format(PyExc_ValueError, "block_tables has %lld columns, more than num_blocks %lld",
                     (long long)mb, (long long)self->num_blocks);
        return -1;
    }
    for (int64_t t = 0; t < n; t++) {
        if (tok[t] < 0 || tok[t] >= c->vocab_size) {
            PyErr_Format(PyExc_ValueError, "tokens[%lld] = %lld is outside the vocabulary [0, %lld)",
                         (long long)t, (long long)tok[t], (long long)c->vocab_size);
            return -1;
        }
        if (pos[t] < 0 || pos[t] >= c->max_pos) {
            PyErr_Format(PyExc_ValueError, "positions[%lld] = %lld is outside [0, max_pos = %lld)",
                         (long long)t, (long long)pos[t], (long long)c->max_pos);
            return -1;
        }
        if (slot[t] < 0 || slot[t] >= n_slots) {
            PyErr_Format(PyExc_ValueError,
                         "slot_mapping[%lld] = %lld is outside the cache's slots [0, %lld)",
                         (long long)t, (long long)slot[t], (long long)n_slots);
            return -1;
        }
        self->tokens[t] = (int32_t)tok[t];
        self->positions[t] = (int32_t)pos[t];
        self->slots[t] = slot[t];
    }
    /* two tokens writing one slot would race in the KV write (and one of them
     * would lose its keys): no valid schedule does it */
    if (n > 1) {
        memcpy(self->slots_sorted, self->slots, (size_t)n * sizeof(int64_t));
        qsort(self->slots_sorted, (size_t)n, sizeof(int64_t), cmp_i64);
        for (int64_t t = 1; t < n; t++) {
            if (self->slots_sorted[t] == self->slots_sorted[t - 1]) {
                PyErr_Format(PyExc_ValueError, "slot_mapping holds slot %lld more than once",
                             (long long)self->slots_sorted[t]);
                return -1;
            }
        }
    }
    if (qs[0] != 0 || qs[n_seqs] != n) {
        PyErr_Format(PyExc_ValueError,
                     "query_start must start at 0 and end at the token count %lld, got %lld .. %lld",
                     (long long)n, (long long)qs[0], (long long)qs[n_seqs]);
        return -1;
    }
    int64_t max_ctx = 0;
    for (int64_t s = 0; s < n_seqs; s++) {
        const int64_t nq = qs[s + 1] - qs[s];
        if (nq < 0) {
            PyErr_Format(PyExc_ValueError, "query_start must not decrease (entry %lld)", (long long)s + 1);
            return -1;
        }
        if (ctx[s] < nq || ctx[s] > mb * bs || ctx[s] > c->max_pos) {
            PyErr_Format(PyExc_ValueError,
                         "context_lens[%lld] = %lld must be at least its %lld new tokens and at most "
                         "min(block_tables columns * block_size = %lld, max_pos = %lld)",
                         (long long)s, (long long)ctx[s], (long long)nq, (long long)(mb * bs),
                         (long long)c->max_pos);
            return -1;
        }
        /* the blocks that hold the context are read: they must exist; the
         * rest of the row is padding and never read */
        const int64_t used = (ctx[s] + bs - 1) / bs;
        for (int64_t i = 0; i < mb; i++) {
            const int64_t blk = tab[s * mb + i];
            if (i < used && (blk < 0 || blk >= self->num_blocks)) {
                PyErr_Format(PyExc_ValueError,
                             "block_tables[%lld][%lld] = %lld is outside the cache's blocks [0, %lld)",
                             (long long)s, (long long)i, (long long)blk, (long long)self->num_blocks);
                return -1;
            }
            self->block_tables[s * mb + i] = i < used ? (int32_t)blk : 0;
        }
        self->query_start[s] = (int32_t)qs[s];
        self->context_lens[s] = (int32_t)ctx[s];
        if (ctx[s] > max_ctx) max_ctx = ctx[s];
    }
    self->query_start[n_seqs] = (int32_t)n;
    for (int64_t i = 0; i < n_logits; i++) {
        if (rows[i] < 0 || rows[i] >= n) {
            PyErr_Format(PyExc_ValueError, "logits_rows[%lld] = %lld is outside the token rows [0, %lld)",
                         (long long)i, (long long)rows[i], (long long)n);
            return -1;
        }
        self->logits_rows[i] = (int32_t)rows[i];
    }
    memset(bt, 0, sizeof *bt);
    bt->n_tokens = n;
    bt->n_seqs = n_seqs;
    bt->tokens = self->tokens;
    bt->positions = self->positions;
    bt->slot_mapping = self->slots;
    bt->query_start = self->query_start;
    bt->context_lens = self->context_lens;
    bt->block_tables = self->block_tables;
    bt->max_blocks_per_seq = mb;
    bt->max_context_len = max_ctx;
    bt->logits_rows = self->logits_rows;
    bt->n_logits = n_logits;
    return 0;
}

static PyObject *ModelRunner_forward(ModelRunnerObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"tokens", "positions", "slot_mapping", "query_start", "context_lens",
                             "block_tables", "logits_rows", NULL};
    static const char *const names[N_FWD_ARGS] = {"tokens", "positions", "slot_mapping", "query_start",
                                                  "context_lens", "block_tables", "logits_rows"};
    PyObject *in[N_FWD_ARGS];
    PyArrayObject *arr[N_FWD_ARGS] = {NULL};
    PyObject *out = NULL, *ret = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOOOO:forward", kwlist, &in[0], &in[1], &in[2],
                                     &in[3], &in[4], &in[5], &in[6]))
        return NULL;
    int owns_busy = 0;
    for (int i = 0; i < N_FWD_ARGS; i++) {
        arr[i] = as_i64(in[i], names[i], i == 5 ? 2 : 1);
        if (!arr[i]) goto done;
    }
    /* checked after the conversions, which may run Python code (and so other
     * threads); from here on the runner's batch buffers are ours */
    if (check_usable(self) < 0) goto done;
    self->busy = 1;
    owns_busy = 1;
    cv_batch bt;
    if (fill_batch(self, arr, &bt) < 0) goto done;
    const int64_t vocab = self->m->cfg.vocab_size;
    npy_intp dims[2] = {(npy_intp)bt.n_logits, (npy_intp)vocab};
    out = PyArray_SimpleNew(2, dims, NPY_FLOAT32);
    if (!out) goto done;
    float *dst = PyArray_DATA((PyArrayObject *)out); /* [n_logits][vocab] */
    cv_err err;
    memset(&err, 0, sizeof err);
    int rc = CV_OK;
    Py_BEGIN_ALLOW_THREADS
    if (bt.n_tokens > 0) {
        rc = cv_model_forward(self->m, &self->ws, self->caches, &bt, &err);
        if (rc == CV_OK && bt.n_logits > 0)
            memcpy(dst, self->ws.logits_host, (size_t)(bt.n_logits * vocab) * sizeof(float));
    }
    Py_END_ALLOW_THREADS
    if (rc) {
        cv_py_raise(&err);
        goto done;
    }
    ret = out;
    out = NULL;
done:
    if (owns_busy) self->busy = 0;
    Py_XDECREF(out);
    for (int i = 0; i < N_FWD_ARGS; i++) Py_XDECREF(arr[i]);
    return ret;
}

/* ------------------------------------------------------------------------ */
/* the rest                                                                  */

static PyObject *ModelRunner_reset(ModelRunnerObject *self, PyObject *Py_UNUSED(ignored)) {
    if (check_usable(self) < 0) return NULL;
    /* CPU backend: the cache is host memory */
    for (int64_t l = 0; l < self->m->cfg.n_layers; l++) {
        memset(self->caches[l].k, 0, self->kv_layer_bytes);
        memset(self->caches[l].v, 0, self->kv_layer_bytes);
        if (self->caches[l].k_scale) { /* int8: a scale per row */
            memset(self->caches[l].k_scale, 0, kv_scale_bytes(&self->caches[l]));
            memset(self->caches[l].v_scale, 0, kv_scale_bytes(&self->caches[l]));
        }
    }
    Py_RETURN_NONE;
}

static PyObject *ModelRunner_close(ModelRunnerObject *self, PyObject *Py_UNUSED(ignored)) {
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "ModelRunner is in use by another thread");
        return NULL;
    }
    close_now(self);
    Py_RETURN_NONE;
}

static PyObject *ModelRunner_enter(ModelRunnerObject *self, PyObject *Py_UNUSED(ignored)) {
    if (check_usable(self) < 0) return NULL;
    Py_INCREF(self);
    return (PyObject *)self;
}

static PyObject *ModelRunner_exit(ModelRunnerObject *self, PyObject *args) {
    (void)args;
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "ModelRunner is in use by another thread");
        return NULL;
    }
    close_now(self);
    Py_RETURN_FALSE;
}

static PyObject *ModelRunner_get_config(ModelRunnerObject *self, void *closure) {
    (void)closure;
    if (!self->m) { /* read-only: fine while a forward runs */
        cv_err e;
        cv_set_err(&e, CV_ERR_STATE, "ModelRunner is closed");
        return cv_py_raise(&e);
    }
    const cv_model_config *c = &self->m->cfg;
    PyObject *d = PyDict_New();
    if (!d) return NULL;
    if (cv_py_put_model_config(d, c) < 0 ||
        cv_py_put(d, "rope_llama3", PyBool_FromLong(c->rope_llama3)) < 0 ||
        cv_py_put(d, "tie_embeddings", PyBool_FromLong(c->tie_embeddings)) < 0 ||
        cv_py_put(d, "qkv_bias", PyBool_FromLong(c->qkv_bias)) < 0 ||
        cv_py_put(d, "dtype", PyUnicode_FromString(cv_dtype_name(self->m->dtype))) < 0 ||
        cv_py_put(d, "kv_cache_dtype", PyUnicode_FromString(cv_dtype_name(self->kv_dtype))) < 0 ||
        cv_py_put(d, "block_size", PyLong_FromLongLong(self->block_size)) < 0 ||
        cv_py_put(d, "num_blocks", PyLong_FromLongLong(self->num_blocks)) < 0 ||
        cv_py_put(d, "max_tokens", PyLong_FromLongLong(self->max_tokens)) < 0 ||
        cv_py_put(d, "max_seqs", PyLong_FromLongLong(self->max_seqs)) < 0 ||
        cv_py_put(d, "weight_bytes", PyLong_FromSize_t(self->m->weight_bytes)) < 0 ||
        cv_py_put(d, "kv_cache_bytes",
            PyLong_FromUnsignedLongLong(2ull * (unsigned long long)self->kv_layer_bytes *
                                        (unsigned long long)c->n_layers)) < 0 ||
        cv_py_put(d, "n_params", PyLong_FromLongLong(self->m->n_params)) < 0) {
        Py_DECREF(d);
        return NULL;
    }
    return d;
}

static PyObject *ModelRunner_get_closed(ModelRunnerObject *self, void *closure) {
    (void)closure;
    return PyBool_FromLong(self->m == NULL);
}

static PyObject *ModelRunner_repr(ModelRunnerObject *self) {
    if (!self->m) return PyUnicode_FromString("<ModelRunner (closed)>");
    const cv_model_config *c = &self->m->cfg;
    return PyUnicode_FromFormat("<ModelRunner dim=%lld layers=%lld vocab=%lld dtype=%s kv=%s "
                                "blocks=%lldx%lld>",
                                (long long)c->dim, (long long)c->n_layers, (long long)c->vocab_size,
                                cv_dtype_name(self->m->dtype), cv_dtype_name(self->kv_dtype),
                                (long long)self->num_blocks, (long long)self->block_size);
}

static PyMethodDef ModelRunner_methods[] = {
    {"forward", (PyCFunction)(void (*)(void))ModelRunner_forward, METH_VARARGS | METH_KEYWORDS,
     "forward(tokens, positions, slot_mapping, query_start, context_lens, block_tables, logits_rows)\n"
     "-> numpy.ndarray float32 [len(logits_rows)][vocab]\n\n"
     "Runs the model over one ragged batch (integer arrays): tokens/positions/slot_mapping [n];\n"
     "query_start [n_seqs + 1] (sequence s owns rows query_start[s]..query_start[s+1]-1);\n"
     "context_lens [n_seqs] (tokens in the cache after this step, new ones included);\n"
     "block_tables [n_seqs][max_blocks] (entries past ceil(context_len / block_size) are not read);\n"
     "logits_rows [n_logits] token rows whose logits are returned. Writes the new keys/values\n"
     "at slot_mapping. ValueError on any index out of range; the GIL is released while it runs."},
    {"reset", (PyCFunction)ModelRunner_reset, METH_NOARGS, "reset(): zeroes the KV cache."},
    {"close", (PyCFunction)ModelRunner_close, METH_NOARGS, "close(): frees the model and cache; idempotent."},
    {"__enter__", (PyCFunction)ModelRunner_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)ModelRunner_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef ModelRunner_getset[] = {
    {"config", (getter)ModelRunner_get_config, NULL,
     "The model hyper-parameters and the runner's settings as a dict.", NULL},
    {"closed", (getter)ModelRunner_get_closed, NULL, "True after close().", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot ModelRunner_slots[] = {
    {Py_tp_doc, "ModelRunner(path, *, dtype='auto', kv_cache_dtype='float32', block_size=16,\n"
              "            num_blocks=64, max_tokens=512, max_seqs=16, num_threads=0,\n"
              "            force_scalar=False)\n\n"
              "A model on the CPU backend with its own paged KV cache\n"
              "([num_blocks][n_kv_heads][block_size][head_dim] per layer; kv_cache_dtype float32,\n"
              "bfloat16, float16 or int8 with a float32 scale per row), run batch by batch\n"
              "with forward(). A test hook for the model and kernels."},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_init, ModelRunner_init},
    {Py_tp_dealloc, ModelRunner_dealloc},
    {Py_tp_repr, ModelRunner_repr},
    {Py_tp_methods, ModelRunner_methods},
    {Py_tp_getset, ModelRunner_getset},
    {0, NULL},
};

static PyType_Spec ModelRunner_spec = {
    .name = "conveyor._testing.ModelRunner",
    .basicsize = sizeof(ModelRunnerObject),
    .flags = CV_PY_TYPE_FLAGS,
    .slots = ModelRunner_slots,
};

int cv_py_add_model(PyObject *m) { return cv_py_add_type(m, &ModelRunner_spec); }
