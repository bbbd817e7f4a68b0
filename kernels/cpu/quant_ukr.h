/* The quantized micro-kernel contract: the activation blocks, the tile and
 * panel kernel types, the panel layout, and the per-level kernels that
 * x86/ defines and the drivers in quant.c choose from. The SIMD files need
 * only this header; quant.h adds the drivers' own functions on top. */
#ifndef CV_CPU_QUANT_UKR_H
#define CV_CPU_QUANT_UKR_H

#include <stddef.h>
#include <stdint.h>

#include "../../base/quant_format.h"
#include "cpu_internal.h"

/* One block of quantized activations. */
typedef struct cv_xq_block {
    int8_t q[CV_QK];
    float d; /* x = d * q */
    float s; /* d * sum(q) */
    int32_t sum; /* sum(q) */
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

/* The micro-kernels for dtype at a SIMD level into *out: 1, or 0 when the
 * level is not built or dtype is not quantized. */
int cv_qtiles_avx2(cv_dtype t, cv_qtiles *out);
int cv_qtiles_vnni(cv_dtype t, int avx512, cv_qtiles *out); /* avx512: EVEX vpdpbusd, else AVX-VNNI */
/* Q2_K (computed as stored) and Q8_M (quant_format.h): the AVX2 tiles every
 * SIMD level uses (x86/avx2_q2k.c; 0 when not built). */
int cv_qtiles_q2k(cv_dtype t, cv_qtiles *out);

/* The panel layout (cv_matrix.layout CV_QLAYOUT_P16) of the AVX512-VNNI
 * level, for Q8_0, Q4_0, Q4_1, Q4_F and Q5_0 (cv_qp16_packs): rows in panels of
 * 16 (zero rows pad the last), each panel `stride` bytes (a multiple of 64).
 * Block i's weights, as u8 operands of vpdpbusd: 64-byte vector g holds, for
 * row r, bytes 4r..4r+3:
 *   Q8_0 (g 0..7): w + 128 of elements 4g..4g+3; blocks in pairs: the two
 *        blocks' 512 bytes each, then their scales d[16] (float16, 32 bytes
 *        each): 1,088 bytes (17 lines) a pair, the last pair's second half
 *        unused when nb is odd;
 *   Q4   (g 0..3): GGUF's bytes 4g..4g+3 of the row's block (low nibbles:
 *        elements 4g.., high: 16 + 4g..), then the block's d[16] and m[16]
 *        (float16, 32 bytes each, Q4_0's m unused; Q4_F float32): 320 or
 *        384 bytes a block;
 *   Q5_0 (g 0..3): Q4's nibble vectors, then one vector of the fifth bits
 *        (row r's bytes 4r + k: bit g that of element 4g + k, bit 4 + g
 *        that of 16 + 4g + k); blocks in pairs as Q8_0's: 2 x 320 bytes,
 *        then the two d[16]: 704 bytes (11 lines) a pair, the file's 16 x 2 x 22.
 * So a panel is one stream of whole cache lines, read front to back.
 * Each output lane (row, token) runs, over the blocks i in order:
 *   acc = fma(float(idot_i), dw_i * dx_i, acc) [; acc = fma(m_i, s_i, acc)]
 * where idot_i is the exact integer block dot (Q8_0's +128, Q4_0's -8 and
 * Q5_0's -16 taken out exactly, in the integer start value), whatever the tile, so a
 * token's outputs are the same bits alone or in any batch. The other levels
 * read such a matrix through cv_qp16_unpack (exact: the GGUF blocks).
 *
 * CV_QLAYOUT_P16_Q4K / CV_QLAYOUT_P16_Q5K: a Q4_F / Q8_F matrix
 * (cv_quant_compute_type of Q4_K / Q5_K) packed from Q4_K / Q5_K rows
 * keeping the file's 144 / 176 bytes a super-block (the P16 functions take
 * the type CV_Q4_K / CV_Q5_K for it): per super-block, d[16], dmin[16]
 * (float16) and the 12 scale bytes (byte k of the 16 rows together), for
 * Q5_K its qh as 8 vectors (vector g: qh[4g..4g+3] of each row), then 4
 * pairs of sub-blocks of 8 vectors (vector g: bytes 32c + 4g..4g+3 of each
 * row's qs, low nibbles sub-block 2c, high 2c + 1), so that a panel is read
 * front to back. The kernels
 * take the 6-bit scales expanded (cv_qp16k_scales: Q4_F's d and m, once
 * per chunk of panels for all its token tiles) and run Q4_F's operations,
 * so Q4_K's results are the Q4_F path's bits; unpacking gives the Q4_F
 * (Q8_F) blocks.
 *
 * CV_QLAYOUT_P16_Q50: a Q8_0 matrix (Q5_0's compute type) packed from Q5_0
 * rows keeping the file's 22 bytes a block (the P16 functions take the type
 * CV_Q5_0 for it). Its lanes run Q8_0's operations on the same integers
 * (q - 16) and scales, so the results are the bits of the Q8_0 repacking;
 * unpacking gives those Q8_0 blocks.
 *
 * CV_QLAYOUT_P16_Q6K: a Q8_F matrix (Q6_K's compute type) packed from Q6_K
 * rows keeping the file's 210 bytes a super-block row (plus 2 a row of
 * padding; the P16 functions take the type CV_Q6_K for it; layout in
 * x86/vnni512_quant.c). Each lane runs, per block, the contract's step for
 * each half of 16 with its own scale d * sc (exact); unpacking gives the
 * Q8_F blocks. */
enum {
    CV_QLAYOUT_ROWS = 0,
    CV_QLAYOUT_P16 = 1,
    CV_QLAYOUT_P16_Q4K = 2,
    CV_QLAYOUT_P16_Q5K = 3,
    CV_QLAYOUT_P16_Q50 = 4,
    CV_QLAYOUT_P16_Q6K = 5
};
/* The type the P16 functions take for a matrix of this dtype and layout. */
static inline cv_dtype cv_qp16_type(cv_dtype dtype, int layout) {
    return layout == CV_QLAYOUT_P16_Q4K ? CV_Q4_K : layout == CV_QLAYOUT_P16_Q5K ? CV_Q5_K
         : layout == CV_QLAYOUT_P16_Q50 ? CV_Q5_0 : layout == CV_QLAYOUT_P16_Q6K ? CV_Q6_K : dtype;
}
/* The layout of a matrix packed from panels of the P16 functions' type t. */
static inline int cv_qp16_layout(cv_dtype t) {
    return t == CV_Q4_K ? CV_QLAYOUT_P16_Q4K : t == CV_Q5_K ? CV_QLAYOUT_P16_Q5K
         : t == CV_Q5_0 ? CV_QLAYOUT_P16_Q50 : t == CV_Q6_K ? CV_QLAYOUT_P16_Q6K : CV_QLAYOUT_P16;
}
#define CV_QP16_ROWS 16
#define CV_QP16_MAX_TOKENS 4
int cv_qp16_packs(cv_dtype t);
size_t cv_qp16_stride(cv_dtype t, int64_t nb);
/* Packs rows x (nb blocks) of row-major blocks of type t into dst
 * (panels(rows) * stride bytes). */
void cv_qp16_pack(void *dst, const void *src, cv_dtype t, int64_t rows, int64_t nb);
/* Rows [0, n) (n <= 16) of one panel back into row-major blocks (row_bytes apart). */
void cv_qp16_unpack(void *dst, size_t row_bytes, const void *panel, cv_dtype t, int n, int64_t nb);
/* P panels (stride bytes apart) x T tokens (x_stride blocks apart): the
 * first nvalid rows' outputs y of token t go to out[t * ldo + row] (y + bias[row]
 * when bias, then out + that when accumulate). With pf, the lines pf .. pf +
 * 64 (pf_lines - 1) are asked for into L2, spread over the nb blocks
 * (cv_prefetch_spread). */
typedef void (*cv_qp16_fn)(const void *w, size_t stride, int64_t nb, const cv_xq_block *x, int64_t x_stride,
                           float *out, int64_t ldo, int nvalid, const float *bias, int accumulate, const char *pf,
                           int64_t pf_lines);
/* The kernel of P panels (1 or cv_qp16_panels_for(T)) x T tokens (1..4) for dtype; NULL when not built. */
cv_qp16_fn cv_qp16_kernel(cv_dtype t, int panels, int tokens);
/* Q4_K / Q5_K panels (type t): the scales of np panels (stride bytes
 * apart) into dst[np][nb][32] floats (block i's d for the 16 rows, then its
 * m), and the kernels as cv_qp16_kernel's that read them (sc: the expanded
 * scales of the tile's first panel, the next panels nb * 32 floats apart;
 * NULL: the kernel expands them itself, the same values, for one token tile). */
void cv_qp16k_scales(float *dst, const void *panels, size_t stride, cv_dtype t, int np, int64_t nb);
typedef void (*cv_qp16k_fn)(const void *w, size_t stride, int64_t nb, const cv_xq_block *x, int64_t x_stride,
                            float *out, int64_t ldo, int nvalid, const float *bias, int accumulate, const char *pf,
                            int64_t pf_lines, const float *sc);
cv_qp16k_fn cv_qp16k_kernel(cv_dtype t, int panels, int tokens);
/* One Q5_0 panel (nb blocks) as a Q8_0 panel (cv_qp16_stride(CV_Q8_0, nb)
 * bytes at dst), the same integers and scales: the batched tiles of a Q5_0
 * matrix run Q8_0's kernels on it. */
void cv_qp16_q5_to_q8(void *dst, const void *panel, int64_t nb);
/* Panels of a full tile at T tokens. */
static inline int cv_qp16_panels_for(int tokens) { return tokens <= 2 ? 4 : 2; }

typedef void (*cv_quantize_x_fn)(cv_xq_block *out, const float *x, int64_t n);
/* The same bytes with AVX2 (NULL when not built). */
cv_quantize_x_fn cv_quantize_x_avx2(void);
/* With AVX-512 (x86/vnni512_quant.c; NULL when not built): the P16 path's. */
cv_quantize_x_fn cv_quantize_x_avx512(void);

#endif
