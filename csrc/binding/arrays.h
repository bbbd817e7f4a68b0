/* Helpers shared by the binding files (csrc/binding/): NumPy argument checks,
 * dict and list building, file paths, and the argument checks that the CPU
 * kernel hooks (py_kernels.c) and the CUDA ones (py_cuda.c) have in common.
 *
 * Every check that fails returns NULL or -1 with a Python exception set:
 * TypeError for a wrong type or dtype, ValueError for a wrong shape or value,
 * each message naming the argument. Arrays returned are borrowed references
 * to the caller's objects unless a comment says "new". */
#ifndef CV_BINDING_ARRAYS_H
#define CV_BINDING_ARRAYS_H

#include "binding.h"

#include "../../kernels/backend.h"
#include "../model/config.h"

/* Runs the statement(s) with the GIL released and `lock` (a
 * PyThread_type_lock) held: pure C work on a backend used one call at a time. */
#define CV_PY_RUN_LOCKED(lock, ...)                                                             \
    do {                                                                                        \
        Py_BEGIN_ALLOW_THREADS PyThread_acquire_lock((lock), WAIT_LOCK);                        \
        __VA_ARGS__;                                                                            \
        PyThread_release_lock((lock));                                                          \
        Py_END_ALLOW_THREADS                                                                    \
    } while (0)

/* ------------------------------------------------------------------------ */
/* NumPy arrays                                                              */

/* "float32", "int64", ... for the NumPy types the binding asks for;
 * "another dtype" for the rest. */
const char *cv_py_npy_name(int type);

/* Parses "float32", "bfloat16" or "float16" (and "auto" -> CV_DTYPE_INVALID
 * when allow_auto) into *out; `what` names the argument in the ValueError. */
int cv_py_parse_dtype(const char *s, const char *what, int allow_auto, cv_dtype *out);
/* As cv_py_parse_dtype, for a KV cache: also "int8". */
int cv_py_parse_kv_dtype(const char *s, const char *what, int allow_auto, cv_dtype *out);
/* quantization=None | 'q8_0' | 'q4_0' | 'q4_1' (NULL is None); -1 with ValueError. */
int cv_py_parse_quantization(const char *s, cv_dtype *out);
/* activation_dtype='auto' (0: bf16 GEMM inputs where vdpbf16ps runs) | 'float32' (1: exact);
 * -1 with ValueError. */
int cv_py_parse_activation_dtype(const char *s, int *exact);

/* o as a C-contiguous, aligned, native-order array of NumPy type `type` with
 * `ndim` dimensions (ndim < 0: any), writeable when asked. */
PyArrayObject *cv_py_want_array(PyObject *o, const char *name, int type, int ndim, int writeable);

/* A float32 array [n][h][d] whose rows may be strided (a view into a wider
 * buffer, like the fused qkv rows) but whose [h][d] part is contiguous. */
typedef struct cv_py_rows3 {
    float *data;             /* [n] rows of [h][d] floats, `stride` floats apart */
    int64_t n, h, d, stride; /* stride: floats between rows */
} cv_py_rows3;

int cv_py_want_rows3(PyObject *o, const char *name, int writeable, cv_py_rows3 *r);

/* A 2-D source of weights: float32, float64, float16, or uint16 holding
 * bfloat16 bits; *dt gets its dtype. */
PyArrayObject *cv_py_want_source(PyObject *o, const char *name, cv_dtype *dt);

/* A non-empty 2-D matrix [rows][cols]: any source dtype of cv_py_want_source
 * when any_source, else float32 only; *dt gets its dtype. */
PyArrayObject *cv_py_want_matrix(PyObject *o, const char *name, int any_source, cv_dtype *dt);

/* A new zero-filled float32 array of shape dims[nd]. */
PyObject *cv_py_new_f32(int nd, npy_intp *dims);

/* k_cache / v_cache [num_blocks][n_kv_heads][block_size][head_dim] of one
 * dtype and shape: cache_dtype (NULL or "": from the arrays, float32 or
 * float16) names it, with uint16 arrays holding bfloat16 bits. Fills c with
 * their host pointers and sizes; *k and *v (when not NULL) get the arrays. */
int cv_py_want_cache(PyObject *k_obj, PyObject *v_obj, const char *cache_dtype, int writeable,
                     cv_kv_layer *c, PyArrayObject **k, PyArrayObject **v);
/* The scales of an int8 cache c (int8 arrays or cache_dtype='int8'): k_scale
 * and v_scale float32 [num_blocks][n_kv_heads][block_size], required for int8
 * and refused (when not None) for other dtypes. */
int cv_py_want_kv_scales(cv_kv_layer *c, PyObject *ks_obj, PyObject *vs_obj, int writeable);

/* ------------------------------------------------------------------------ */
/* Dicts, lists, paths                                                       */

/* Sets d[key] = v and drops the reference to v; -1 on error (v may be NULL:
 * the error of the call that made it). */
int cv_py_put(PyObject *d, const char *key, PyObject *v);

/* A new list of Python ints from v[n]. */
PyObject *cv_py_int32_list(const int32_t *v, int64_t n);
PyObject *cv_py_int64_list(const int64_t *v, int64_t n);

/* "llama", "mistral", "qwen2", or "unknown". */
const char *cv_py_arch_name(int arch);

/* Puts the model sizes every config dict starts with: arch, dim, hidden_dim,
 * n_layers, n_heads, n_kv_heads, head_dim, vocab_size, max_pos. */
int cv_py_put_model_dims(PyObject *d, const cv_model_config *c);

/* cv_py_put_model_dims, then rms_eps, rope_theta, rope_layout. */
int cv_py_put_model_config(PyObject *d, const cv_model_config *c);

/* A path argument (str, bytes or os.PathLike) as new bytes in the file
 * system encoding; ValueError "<what> path contains a NUL byte". When str is
 * not NULL, *str gets the path as a new exact str (as given, or decoded). */
PyObject *cv_py_fs_path(PyObject *arg, const char *what, PyObject **str);

/* ------------------------------------------------------------------------ */
/* Arguments of the kernel hooks (the same on the CPU and CUDA backends)     */

/* gemm / matmul: x [n][cols] . W^T with W [rows][cols]. */
typedef struct cv_py_gemm_args {
    PyArrayObject *x;   /* [n][cols] float32 */
    const float *bias;  /* [rows], or NULL */
    PyObject *out;      /* new [n][rows] float32: a copy of accumulate, or zeros */
    int accumulate;     /* out holds accumulate's values to add to */
    int64_t n;
} cv_py_gemm_args;

int cv_py_want_gemm_args(cv_py_gemm_args *a, PyObject *x_obj, PyObject *bias_obj, PyObject *acc_obj,
                         int64_t rows, int64_t cols);

/* rmsnorm: x [n][dim] and weight [dim], float32, and the new array the hook
 * returns. */
typedef struct cv_py_norm_args {
    PyArrayObject *x, *w; /* x [n][dim]; weight [dim] */
    PyObject *out;        /* new [n][dim] float32 zeros */
    int64_t n, dim;
} cv_py_norm_args;

int cv_py_want_norm_args(cv_py_norm_args *a, PyObject *x_obj, PyObject *w_obj);

/* swiglu: gu [n][2 * dim] float32, rows [gate | up]. */
PyArrayObject *cv_py_want_gate_up(PyObject *o);

/* rope: q [n][n_heads][head_dim] and k [n][n_kv_heads][head_dim] (or None),
 * rotated in place; pos [n] int32; inv_freq [head_dim/2] float32. */
typedef struct cv_py_rope_args {
    cv_py_rows3 q, k;   /* k.data NULL when k is None */
    const int32_t *pos; /* [n] */
    cv_rope rope;       /* inv_freq: the host array */
} cv_py_rope_args;

int cv_py_want_rope_args(cv_py_rope_args *a, PyObject *q_obj, PyObject *k_obj, PyObject *pos_obj,
                         PyObject *f_obj, const char *layout);

/* embedding: tokens [n] int32 rows of table [rows][cols]; validate: also
 * checks every token is a row (0: left to the kernel). */
PyArrayObject *cv_py_want_tokens(PyObject *tok_obj, PyArrayObject *table, int validate);

/* kv_write: k, v [n][n_kv_heads][head_dim] into the caches (writeable) at
 * slot_mapping [n] int64 (slot < 0: skipped); validate: also checks every
 * slot is in the cache (0: left to the kernel). */
typedef struct cv_py_kv_write_args {
    cv_kv_layer cache;                /* host pointers into the arrays below */
    PyArrayObject *k_cache, *v_cache; /* [num_blocks][n_kv_heads][block_size][head_dim] */
    cv_py_rows3 k, v;                 /* [n][n_kv_heads][head_dim] */
    const int64_t *slots;             /* [n] */
} cv_py_kv_write_args;

int cv_py_want_kv_write_args(cv_py_kv_write_args *a, PyObject *kc_obj, PyObject *vc_obj,
                             PyObject *k_obj, PyObject *v_obj, PyObject *s_obj,
                             const char *cache_dtype, int validate);

/* paged_attention: q [rows][n_heads][head_dim] over the caches with
 * block_tables [n_seqs][max_blocks], context_lens [n_seqs] and query_start
 * [n_seqs + 1] (int32). query_start and context_lens >= new tokens are always
 * checked (the kernels index q and out with them); validate: also that each
 * context fits its block table and its blocks are in the cache (0: left to
 * the kernel). min_blocks: fewest block_tables columns; max_head_dim: the
 * largest head_dim (0: any); scale_obj: None for 1/sqrt(head_dim);
 * mcl_obj: max_context_len hint, None to compute it. */
typedef struct cv_py_attention_args {
    cv_kv_layer cache;                /* host pointers into the arrays below */
    PyArrayObject *k_cache, *v_cache; /* [num_blocks][n_kv_heads][block_size][head_dim] */
    cv_py_rows3 q;                    /* [rows][n_heads][head_dim] */
    cv_attn_batch ab;                 /* host pointers into the int32 arrays */
} cv_py_attention_args;

int cv_py_want_attention_args(cv_py_attention_args *a, PyObject *q_obj, PyObject *kc_obj,
                              PyObject *vc_obj, PyObject *bt_obj, PyObject *cl_obj, PyObject *qs_obj,
                              PyObject *scale_obj, PyObject *mcl_obj, const char *cache_dtype,
                              int validate, int64_t min_blocks, int64_t max_head_dim);

#endif
