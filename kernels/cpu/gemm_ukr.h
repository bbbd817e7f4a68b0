/* The GEMM micro-kernel contract shared by gemm.c (driver, plain C) and the
 * SIMD kernels (x86/avx2_gemm.c; x86/avx512_gemm.c: AVX-512 and AVX512_BF16).
 *
 * A kernel computes an mr x (np * 16) tile: np consecutive panels of W (np is
 * fixed per level and tile height, UKR_NP_*) over mr rows of x:
 *   c[i][q*16 + j] (i < mr, q < np, q*16 + j < nvalid) gets
 *     (load_c ? c : 0) + (bias ? bias : 0) + sum_k x[i][k] w_q[k][j]
 *   x: [mr][ldx] rows of activations (kc used), or when ldx == 0 a packed
 *      tile [kc][mr]; w_q = (char *)w + q * wstride: panel q's chunk [kc][16];
 *   nvalid in 1 .. np*16: outputs past it (the matrix's last rows, or zero
 *   panels that pad the matrix to whole groups) are neither read nor written.
 * The bf16-pair kernels (AVX512_BF16) read x as bfloat16 [mr][ldx] (ldx in
 * bf16 values, even, never 0) and each w_q as pairs along k: [kc/2][16][2],
 * kc even.
 *
 * THE REDUCTION-ORDER RULE (batch invariance). Every output is one fp32
 * accumulator: its start value ((c + bias), bias or 0, as above), then the
 * terms x[i][k] w[k][j] added in increasing k, one k at a time (one k pair
 * per vdpbf16ps for the pair kernels), each kernel of a level doing the same
 * operation per term (one FMA, or one dot instruction). No kernel splits k
 * over several accumulators. Independent chains for latency come from more
 * columns (np panels) and rows (mr), never from k. So a row's result does not
 * depend on mr (the tile it falls in), np, the driver's k chunks (c is stored
 * and reloaded exactly in fp32 between chunks), the thread that computes it,
 * or the other rows of the batch: the same token gives the same bits alone
 * and in any batch, at every level. tests/test_batch_invariance.py holds it. */
#ifndef CV_CPU_GEMM_UKR_H
#define CV_CPU_GEMM_UKR_H

#include "cpu_internal.h"

/* cv_ukr_fn and cv_ukr_pf_fn, the kernels' types: kernel_table.h. */

/* Packed matrices hold whole groups of CV_GROUP panels (zero panels pad the
 * last group), so every kernel call reads whole panels of its np. */
#define CV_GROUP 4

/* Panels per kernel call at a tile height, per level (each divides CV_GROUP):
 * enough independent accumulators (mr * np * vectors per panel) to cover the
 * FMA latency without spilling (AVX2: 16 ymm; AVX-512: 32 zmm, np = 4 gives
 * 24 accumulators + 4 weights + 1 broadcast at mr = 6). */
#define UKR_NP_AVX2(mr) ((mr) == 1 ? 4 : ((mr) == 2 ? 2 : 1))
#define UKR_NP_AVX512(mr) 4

/* bf16 panels (slot layout, all levels but the pair layout): output j at
 * slot 2j (j < 8) or 2(j-8)+1, so a 32-bit lane holds outputs (j, j+8). */
static inline int bf16_slot(int j) { return j < 8 ? 2 * j : 2 * (j - 8) + 1; }

/* Index of a weight dtype in the kernel tables. */
static inline int dt_index(cv_dtype dt) { return dt == CV_F32 ? 0 : (dt == CV_BF16 ? 1 : 2); }

/* Valid outputs of panel q of a call with nvalid outputs: 0 .. 16. */
static inline int panel_valid(int nvalid, int q) {
    const int v = nvalid - q * CV_NR;
    return v <= 0 ? 0 : (v >= CV_NR ? CV_NR : v);
}

/* Instantiates GEN(mr, dtype, name) for tile heights 1..CV_MR (== 6) and the
 * three weight dtypes, as P##f32_1 .. P##f16_6, and TABLE[dt_index][mr] of
 * them (mr 0 unused; SC: its storage class): one place keeps the table in dt_index() order. */
#define UKR_ROW(GEN, DT, P)                                                                     \
    GEN(1, DT, P##1) GEN(2, DT, P##2) GEN(3, DT, P##3) GEN(4, DT, P##4) GEN(5, DT, P##5) GEN(6, DT, P##6)
#define UKR_LIST(P) {NULL, P##1, P##2, P##3, P##4, P##5, P##6}
#define UKR_PF_LIST(P) {NULL, P##1_pf, P##2_pf, P##3_pf, P##4_pf, P##5_pf, P##6_pf}
#define UKR_TABLE(GEN, P, SC, TABLE)                                                            \
    UKR_ROW(GEN, CV_F32, P##f32_) UKR_ROW(GEN, CV_BF16, P##bf16_) UKR_ROW(GEN, CV_F16, P##f16_)   \
    SC const cv_ukr_fn TABLE[3][CV_MR + 1] = {UKR_LIST(P##f32_), UKR_LIST(P##bf16_), UKR_LIST(P##f16_)};
_Static_assert(CV_MR == 6, "UKR_ROW instantiates tile heights 1..6");

#endif
