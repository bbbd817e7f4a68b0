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

#include "quant_ukr.h"

/* The plain-C dot for dtype (NULL for a type that is not quantized), and the
 * plain-C dots of Q2_K (computed as stored) and Q8_M. */
cv_qdot_fn cv_qdot_scalar(cv_dtype t);
float cv_q2k_dot_scalar(const void *w, const cv_xq_block *x, int64_t nb);
float cv_q8m_dot_scalar(const void *w, const cv_xq_block *x, int64_t nb);

/* Quantizes the n activations x (n a multiple of CV_QK) into n/32 blocks. */
void cv_quantize_x(cv_xq_block *out, const float *x, int64_t n);

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
