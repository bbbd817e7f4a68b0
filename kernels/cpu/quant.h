/* Quantized weights on the CPU (Q8_0, Q4_0, Q4_1; layouts in quant_format.h).
 *
 * A quantized matrix keeps GGUF's row-major blocks. The GEMM quantizes the
 * activations on the fly, per token and block of 32, to int8 with a float32
 * scale d and the block's sum s = d * sum(q) (for Q4_1's min term); each
 * output is then a sum over blocks of integer dot products times the two
 * scales. One dot function per (type, SIMD level) computes every (row, token)
 * pair, so a token's outputs do not depend on the batch it came in (decode
 * and batched steps give the same bits). */
#ifndef CV_CPU_QUANT_H
#define CV_CPU_QUANT_H

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

/* The same dot for 4 tokens at once (x, x + x_stride, ... blocks apart):
 * out[t] is bit for bit dot(w, x + t * x_stride, nb) -- each token's sums run
 * in the same order -- but each weight block is loaded and unpacked once. */
typedef void (*cv_qdot4_fn)(const void *w, const cv_xq_block *x, int64_t x_stride, int64_t nb, float *out);

/* The dot for dtype at level (NULL when that level is not built). */
cv_qdot_fn cv_qdot_scalar(cv_dtype t);
cv_qdot_fn cv_qdot_avx2(cv_dtype t);
cv_qdot4_fn cv_qdot4_avx2(cv_dtype t);
cv_qdot_fn cv_qdot_vnni(cv_dtype t, int avx512); /* avx512: EVEX vpdpbusd, else AVX-VNNI */
/* Quantizes the n activations x (n a multiple of CV_QK) into n/32 blocks. */
void cv_quantize_x(cv_xq_block *out, const float *x, int64_t n);

/* gemm.c / backend_cpu.c hand quantized matrices and tables here. */
int cv_cpu_qmatrix_prepare(cv_backend *b, cv_matrix *out, const void *src, cv_dtype src_dtype, int64_t rows,
                           int64_t cols, cv_dtype dtype, cv_err *err);
void cv_cpu_qgemm(cv_backend *b, float *out, const float *x, int64_t n, const cv_matrix *w, const float *bias,
                  int accumulate);
/* cv_qlevel, cv_qlevel_best/name/supported and cv_cpu_qgemm_level (an explicit
 * level) are public: cpu_backend.h. */
/* out[n][cols] = dequantized rows tokens[n] of a quantized table. */
void cv_cpu_qembedding(cv_backend *b, float *out, const int32_t *tokens, int64_t n, const cv_table *t);

#endif
