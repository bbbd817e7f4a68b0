/* The backend table: one function table per device (CPU, CUDA).
 *
 * Kernels know nothing about sequences or the scheduler: they see raw arrays
 * and sizes. All activations are float32; weights may be float32, bfloat16 or
 * float16 (widened in registers, fp32 accumulation) or block-quantized
 * (base/quant_format.h), all through the same cv_matrix; the KV cache is float32,
 * float16, bfloat16 or int8 (CPU only: symmetric, one scale per token and KV head).
 *
 * Every function works on memory of the backend's device (host memory for CPU).
 * No function allocates inside a step: buffers come from the caller. */
#ifndef CV_BACKEND_H
#define CV_BACKEND_H

#include <stdint.h>
#include "../base/common.h"

typedef struct cv_backend cv_backend;

/* A weight matrix W[rows][cols] (y = W x), in the layout the backend's GEMM
 * reads (the CPU backend packs it into panels; see kernels/cpu/gemm.c).
 * Created by backend->matrix_prepare, freed by backend->matrix_free. */
typedef struct cv_matrix {
    void *data;      /* backend-owned, layout private to the backend */
    cv_dtype dtype;  /* CV_F32, CV_BF16, CV_F16 or a block-quantized type (base/quant_format.h) */
    int64_t rows;    /* output features */
    int64_t cols;    /* input features */
    size_t bytes;    /* bytes held by data */
    int layout;      /* backend-private variant of the layout (0: the backend's default) */
} cv_matrix;

/* A row-major lookup table T[rows][cols] (token embeddings), not packed. */
typedef struct cv_table {
    void *data;      /* [rows][cols] of dtype */
    cv_dtype dtype;
    int64_t rows, cols;
    size_t bytes;
} cv_table;

/* One layer of the paged KV cache.
 * Layout (both k and v): [num_blocks][n_kv_heads][block_size][head_dim] of dtype,
 * so one block of one head is a contiguous [block_size][head_dim] tile.
 * Token slot s lives in block s / block_size at offset s % block_size.
 * CV_I8: a row x is stored as round(x / scale) clamped to +-127 with
 * scale = max|x| / 127 (0 for a zero row: values 0), the scale of token
 * slot s and KV head h at k_scale / v_scale [block][h][offset]. */
/* The rows [row0, row0 + n_rows) of a batch under one LoRA adapter, for one
 * projection whose outputs are y's columns [col0, col0 + out): A [rank][in]
 * and B^T (device) of dtype CV_F32 or CV_BF16, and its scale. Projections
 * that read the same input (q, k, v; gate, up) go in one call. B^T
 * is held in panels of CV_LORA_PANEL output columns, [out / CV_LORA_PANEL
 * rounded up][rank][CV_LORA_PANEL], the last panel zero-padded, so that the
 * expand of a run of columns reads one contiguous stretch:
 * B^T[j][o] is at CV_LORA_BT_AT(rank, j, o). */
#define CV_LORA_PANEL 16
#define CV_LORA_BT_AT(rank, j, o) \
    ((((o) / CV_LORA_PANEL) * (rank) + (j)) * CV_LORA_PANEL + (o) % CV_LORA_PANEL)
/* Elements of a B^T of out columns. */
#define CV_LORA_BT_SIZE(rank, out) ((rank) * (((out) + CV_LORA_PANEL - 1) / CV_LORA_PANEL) * CV_LORA_PANEL)
typedef struct cv_lora_segment {
    int64_t row0, n_rows, rank, col0, out;
    const void *a, *bt;
    cv_dtype dtype;
    float scale;
} cv_lora_segment;

typedef struct cv_kv_layer {
    void *k;         /* [num_blocks][n_kv_heads][block_size][head_dim] */
    void *v;         /* [num_blocks][n_kv_heads][block_size][head_dim] */
    cv_dtype dtype;  /* CV_F32, CV_F16, CV_BF16 or CV_I8 */
    int64_t num_blocks, n_kv_heads, block_size, head_dim;
    float *k_scale;  /* CV_I8 only (else NULL): [num_blocks][n_kv_heads][block_size] */
    float *v_scale;
} cv_kv_layer;

/* Rotary embedding parameters, precomputed by the model. */
typedef enum cv_rope_layout {
    CV_ROPE_HALVES = 0, /* HF: rotate (x[i], x[i + head_dim/2]) */
    CV_ROPE_PAIRS = 1   /* llama2.c / Meta: rotate (x[2i], x[2i+1]) */
} cv_rope_layout;

typedef struct cv_rope {
    const float *inv_freq; /* [head_dim/2] frequencies (llama3 scaling already applied) */
    int64_t head_dim;      /* rotated dimension == head_dim */
    cv_rope_layout layout;
} cv_rope;

/* The attention part of a ragged batch. Sequence s owns query rows
 * query_start[s] .. query_start[s+1]-1 (its new tokens, in order); after this
 * step's KV write its context holds context_lens[s] tokens, so its new token j
 * sits at position context_lens[s] - n_new + j and attends causally to
 * positions 0 .. that position. */
typedef struct cv_attn_batch {
    int64_t n_seqs;
    const int32_t *query_start;  /* [n_seqs + 1] */
    const int32_t *context_lens; /* [n_seqs] */
    const int32_t *block_tables; /* [n_seqs][max_blocks_per_seq] block ids */
    int64_t max_blocks_per_seq;
    int64_t max_context_len;     /* max over context_lens (sizing hint) */
    int64_t n_heads, n_kv_heads, head_dim;
    float scale;                 /* usually 1/sqrt(head_dim) */
    int64_t window;              /* sliding window: 0 none, else a query at position p
                                    sees only the keys at positions p - window + 1 .. p */
} cv_attn_batch;

struct cv_backend {
    const char *name;  /* "cpu" or "cuda" */
    void *ctx;         /* backend private state (thread pool, streams, ...) */

    /* --- lifetime of weights and caches --------------------------------- */
    /* Builds a matrix from host src[rows][cols] (row-major, dtype src_dtype),
     * converting to dtype and packing. */
    int (*matrix_prepare)(cv_backend *b, cv_matrix *out, const void *src, cv_dtype src_dtype,
                          int64_t rows, int64_t cols, cv_dtype dtype, cv_err *err);
    void (*matrix_free)(cv_backend *b, cv_matrix *m);
    int (*table_prepare)(cv_backend *b, cv_table *out, const void *src, cv_dtype src_dtype,
                         int64_t rows, int64_t cols, cv_dtype dtype, cv_err *err);
    void (*table_free)(cv_backend *b, cv_table *t);
    /* out[n][m.cols] = rows[n] of a prepared matrix, as float32 (rows already
     * validated): the token embedding read from a tied LM head, so its
     * weights are stored once. The values are those the matrix was prepared
     * from, as a table of m's dtype would hold them. Returns CV_OK, or
     * CV_ERR_UNSUPPORTED (nothing read or written) for a matrix whose layout
     * it cannot read; n == 0 only asks which. NULL: the backend has none. */
    int (*matrix_rows)(cv_backend *b, float *out, const int32_t *rows, int64_t n, const cv_matrix *m);
    /* Device buffer of bytes (zeroed); host malloc on the CPU. */
    void *(*alloc)(cv_backend *b, size_t bytes);
    void (*free)(cv_backend *b, void *p);
    /* Copies between host and the device (plain memcpy on the CPU). */
    void (*to_device)(cv_backend *b, void *dst, const void *src, size_t bytes);
    void (*to_host)(cv_backend *b, void *dst, const void *src, size_t bytes);

    /* --- kernels (all pointers are device memory) ------------------------ */
    /* out[n][w.rows] = x[n][w.cols] . W^T (+ bias[w.rows] if bias) (+= out if accumulate) */
    void (*gemm)(cv_backend *b, float *out, const float *x, int64_t n, const cv_matrix *w,
                 const float *bias, int accumulate);
    /* out[n][dim] = x * rsqrt(mean(x^2) + eps) * weight */
    void (*rmsnorm)(cv_backend *b, float *out, const float *x, const float *weight, int64_t n,
                    int64_t dim, float eps);
    /* Rotates, in place, the n_heads query heads at q (row stride q_stride floats)
     * and n_kv_heads key heads at k (row stride k_stride) of n tokens at pos[n]. */
    void (*rope)(cv_backend *b, float *q, int64_t q_stride, int64_t n_heads, float *k,
                 int64_t k_stride, int64_t n_kv_heads, const int32_t *pos, int64_t n,
                 const cv_rope *rope);
    /* out[n][dim] = silu(gate) * up, where gate = gu[t][0..dim), up = gu[t][dim..2dim) */
    void (*swiglu)(cv_backend *b, float *out, const float *gu, int64_t n, int64_t dim);
    /* out[n][table.cols] = table[tokens[i]] (tokens already validated) */
    void (*embedding)(cv_backend *b, float *out, const int32_t *tokens, int64_t n,
                      const cv_table *table);
    /* Writes the keys k (row stride k_stride) and values v (row stride v_stride)
     * of n tokens into the cache at slot_mapping[n] (slot = block*block_size + offset). */
    void (*kv_write)(cv_backend *b, cv_kv_layer *cache, const float *k, int64_t k_stride,
                     const float *v, int64_t v_stride, const int64_t *slot_mapping, int64_t n);
    /* out[q_rows][n_heads*head_dim] = softmax(q k^T * scale, causal) v over each
     * sequence's paged context; q has row stride q_stride. */
    void (*paged_attention)(cv_backend *b, float *out, const float *q, int64_t q_stride,
                            const cv_kv_layer *cache, const cv_attn_batch *batch);

    /* --- the extra kernels of Qwen3 and Gemma 3 (NULL where a backend lacks
     * them: the model loader then refuses those architectures) ------------ */
    /* In place, for each of n rows of x (row stride x_stride floats), each of
     * its n_heads heads of head_dim floats = rmsnorm(head) * weight[head_dim]. */
    void (*head_rmsnorm)(cv_backend *b, float *x, int64_t x_stride, int64_t n_heads, int64_t n,
                         int64_t head_dim, const float *weight, float eps);
    /* x[n][dim] += rmsnorm(y) * weight; y is overwritten (with the normed rows). */
    void (*add_rmsnorm)(cv_backend *b, float *x, float *y, const float *weight, int64_t n, int64_t dim,
                        float eps);
    /* out[n][dim] = gelu_tanh(gate) * up, gu as for swiglu. */
    void (*geglu)(cv_backend *b, float *out, const float *gu, int64_t n, int64_t dim);
    /* x[n] *= s */
    void (*scale)(cv_backend *b, float *x, int64_t n, float s);
    /* --- LoRA: y[r][col0 ..] += scale * (x[r] . A^T) . B^T for the rows r of
     * each segment (rows of one adapter and projection, as Punica's SGMV). x
     * rows (in floats each) x_stride floats apart, y rows y_stride apart; segs
     * in host memory, their matrices on the device; tmp: [rows][max rank]
     * device scratch. A row's result depends on that row and its segment's
     * matrices alone. NULL: no LoRA support. */
    void (*lora_sgmv)(cv_backend *b, float *y, int64_t y_stride, const float *x, int64_t x_stride,
                      const cv_lora_segment *segs, int64_t n_segs, int64_t in, float *tmp);
    /* --- fused kernels: one pass where the unfused sequence in each comment
     * takes two, with the same results bit for bit. NULL where a backend has
     * none: the caller then runs that sequence. ---------------------------- */
    /* rope(q, k) then kv_write(k, v): rotates q and k in place and writes the
     * rotated k and v of each token into the cache (k must not be NULL). */
    void (*rope_kv_write)(cv_backend *b, float *q, int64_t q_stride, int64_t n_heads, float *k,
                          int64_t k_stride, int64_t n_kv_heads, const float *v, int64_t v_stride,
                          const int32_t *pos, int64_t n, const cv_rope *rope, cv_kv_layer *cache,
                          const int64_t *slot_mapping);
    /* gemm(out, rmsnorm(x[n][w.cols], norm_weight, eps), n, w, bias, accumulate).
     * scratch: [n][w.cols] floats the kernel may use for the normalized rows
     * (its contents afterwards are unspecified). */
    void (*rmsnorm_gemm)(cv_backend *b, float *out, const float *x, const float *norm_weight, float eps,
                         int64_t n, const cv_matrix *w, const float *bias, int accumulate, float *scratch);
    /* gemm(out, swiglu(gu[n][2 * w.cols]), n, w, bias, accumulate); scratch
     * as for rmsnorm_gemm. */
    void (*swiglu_gemm)(cv_backend *b, float *out, const float *gu, int64_t n, const cv_matrix *w,
                        const float *bias, int accumulate, float *scratch);

    /* --- host work ------------------------------------------------------ */
    /* Calls fn(arg, i, worker) once for every i in [0, n) on up to
     * host_workers threads of the host (worker in [0, host_workers)) and
     * returns when all calls have finished. Items are claimed one at a time,
     * so fn must not depend on which worker runs which item. NULL (and
     * host_workers 0): the caller runs them itself, in order, as worker 0. */
    void (*host_parallel)(cv_backend *b, int64_t n, void (*fn)(void *arg, int64_t i, int worker), void *arg);
    int host_workers;

    /* Waits for queued device work (no-op on the CPU). */
    void (*sync)(cv_backend *b);
    /* Free and total memory of the device in bytes (may be NULL: the engine
     * then asks the OS for host memory). */
    int (*mem_info)(cv_backend *b, size_t *free_bytes, size_t *total_bytes);
    /* Failures of queued device work (bad indices, launch errors), reported
     * after the fact: CV_OK or a code with err set. NULL: the kernels report
     * nothing after the fact (the CPU). */
    int (*last_error)(cv_backend *b, cv_err *err);
    /* Non-zero when buffers from alloc() live in device memory: inputs must be
     * copied there and logits back (0 on the CPU, whose table leaves it unset). */
    int device_memory;
    /* Options the core sets on any backend, before preparing any matrix (they
     * may pick the packed layout); NULL: the backend has no use for the option.
     * exact != 0: GEMMs read float32 activations as they are, never rounded to
     * bf16 first (the CPU's AVX512_BF16 vdpbf16ps path rounds them). */
    void (*set_exact_activations)(cv_backend *b, int exact);
    void (*destroy)(cv_backend *b);
};

/* The options above, for any backend. */
static inline void cv_backend_set_exact_activations(cv_backend *b, int exact) {
    if (b && b->set_exact_activations) b->set_exact_activations(b, exact);
}

/* CPU backend with num_threads workers (<= 0: all cores). Its kernels run at
 * the SIMD level chosen at run time (kernels/cpu/cpu_features.h): the best
 * the CPU supports, or CONVEYOR_SIMD=scalar|avx2|avx512|avx512_bf16 (a level
 * the CPU lacks or an unknown name: NULL with CV_ERR_INVALID), or plain C when
 * CONVEYOR_FORCE_SCALAR=1 is set or force_scalar is non-zero. */
cv_backend *cv_cpu_backend_create(int num_threads, int force_scalar, cv_err *err);
/* Creation at a named level, measurements and introspection: kernels/cpu/cpu_backend.h. */

/* CUDA backend (kernels/cuda), loaded on demand; NULL with err set when
 * CUDA is not built or no device is present. */
cv_backend *cv_cuda_backend_create(int device, cv_err *err);

#endif
