/* Quantized weights on the CPU (Q8_0, Q4_0, Q4_1; layouts in quant_format.h).
 *
 * A quantized matrix keeps GGUF's row-major blocks. The GEMM quantizes the
 * activations on the fly, per token and block of 32, to int8 with a float32
 * scale d and the block's sum s = d * sum(q) (for Q4_1's min term); each
 * output is then a sum over blocks of integer dot products times the two
 * scales. A register-blocked micro-kernel (cv_qtile_fn, quant_tile.h) takes
 * a tile of weight rows x tokens at a time; every (row, token) pair runs the
 * same operations in the same order whatever tile or batch it is in, so a
 * token's outputs do not depend on the batch it came in (decode and batched
 * steps give the same bits). */
#ifndef CV_CPU_QUANT_H
#define CV_CPU_QUANT_H

#include <stddef.h>
#include <stdint.h>

#include "../quant_format.h"
#include "cpu_internal.h"

/* One block of quantized activations. */
typedef struct cv_xq_block {
    int8_t q[CV_QK];
    float d; /* x = d * q */
    float s; /* d * sum(q) */
} cv_xq_block;

/* Dot product of one weight row (nb blocks) with nb activation blocks. */
typedef float (*cv_qdot_fn)(const void *w, const cv_xq_block *x, int64_t nb);

/* The largest tile: rows x tokens of a micro-kernel call. */
#define CV_QTILE_MAX_ROWS 4
#define CV_QTILE_MAX_TOKENS 4

/* One tile: out[r * T + t] = the dot of weight row r (at w + r * w_stride
 * bytes) with token t (at x + t * x_stride blocks), for the kernel's R rows
 * and T tokens; bit for bit the same as the pair in any other tile. */
typedef void (*cv_qtile_fn)(const void *w, size_t w_stride, const cv_xq_block *x, int64_t x_stride, int64_t nb,
                            float *out);

/* A level's micro-kernels for one type: for T tokens (1..max_tokens),
 * tile[T] takes rows[T] rows at once and row[T] one row (the rows left). */
typedef struct cv_qtiles {
    int max_tokens;
    int rows[CV_QTILE_MAX_TOKENS + 1];
    cv_qtile_fn tile[CV_QTILE_MAX_TOKENS + 1];
    cv_qtile_fn row[CV_QTILE_MAX_TOKENS + 1];
} cv_qtiles;

/* The plain-C dot for dtype (NULL for a type that is not quantized). */
cv_qdot_fn cv_qdot_scalar(cv_dtype t);
/* The micro-kernels for dtype at a SIMD level into *out: 1, or 0 when the
 * level is not built or dtype is not quantized. */
int cv_qtiles_avx2(cv_dtype t, cv_qtiles *out);
int cv_qtiles_vnni(cv_dtype t, int avx512, cv_qtiles *out); /* avx512: EVEX vpdpbusd, else AVX-VNNI */
/* Q2_K (computed as stored) and Q8_M (quant_format.h): the plain-C dots, and
 * the AVX2 tiles every SIMD level uses (quant_q2k.c; 0 when not built). */
float cv_q2k_dot_scalar(const void *w, const cv_xq_block *x, int64_t nb);
float cv_q8m_dot_scalar(const void *w, const cv_xq_block *x, int64_t nb);
int cv_qtiles_q2k(cv_dtype t, cv_qtiles *out);

/* Quantizes the n activations x (n a multiple of CV_QK) into n/32 blocks. */
void cv_quantize_x(cv_xq_block *out, const float *x, int64_t n);
typedef void (*cv_quantize_x_fn)(cv_xq_block *out, const float *x, int64_t n);
/* The same bytes with AVX2 (NULL when not built). */
cv_quantize_x_fn cv_quantize_x_avx2(void);

/* gemm.c / backend_cpu.c hand quantized matrices and tables here. */
int cv_cpu_qmatrix_prepare(cv_backend *b, cv_matrix *out, const void *src, cv_dtype src_dtype, int64_t rows,
                           int64_t cols, cv_dtype dtype, cv_err *err);
/* The GEMM of the rows `in` makes (gemm.c: cv_cpu_gemm_in) on a quantized
 * matrix at `level`: each row is made where it is quantized. */
void cv_cpu_qgemm_in(cv_backend *b, float *out, const cv_gemm_in *in, int64_t n, const cv_matrix *w,
                     const float *bias, int accumulate, cv_qlevel level, float *scratch);
/* cv_qlevel, cv_qlevel_best/name/supported and cv_cpu_qgemm_level (an explicit
 * level) are public: cpu_backend.h. */
/* out[n][cols] = dequantized rows tokens[n] of a quantized table. */
void cv_cpu_qembedding(cv_backend *b, float *out, const int32_t *tokens, int64_t n, const cv_table *t);

#endif
