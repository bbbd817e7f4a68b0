/* The x86 kernels of every SIMD level, as the kernel table
 * (kernel_table.c) takes them: each level's functions are in x86/<level>_<family>.c,
 * compiled for that level's target (CV_TARGET_*_BEGIN), and run only when the
 * backend's level reaches it. Their contracts are those of the plain code they
 * stand for (gemm_ukr.h, row_kernels.c, convert.c, kv_write.c, elementwise.c,
 * attention.c); each gives the same bits for a row whatever call or batch it
 * is in. */
#ifndef CV_X86_KERNELS_H
#define CV_X86_KERNELS_H

#include "../cpu_internal.h"

#if CV_HAVE_AVX2
/* avx2_gemm.c, avx512_gemm.c: the micro-kernels [dt_index][mr] (gemm_ukr.h),
 * and the AVX512_BF16 ones of the pair layout (vdpbf16ps) [mr], each with and
 * without prefetching (_pf_table). */
extern const cv_ukr_fn cv_gemm_avx2_table[3][CV_MR + 1];
extern const cv_ukr_pf_fn cv_gemm_avx2_pf_table[3][CV_MR + 1];
extern const cv_ukr_fn cv_gemm_avx512_table[3][CV_MR + 1];
extern const cv_ukr_pf_fn cv_gemm_avx512_pf_table[3][CV_MR + 1];
extern const cv_ukr_fn cv_gemm_bf16dot_table[CV_MR + 1];
extern const cv_ukr_pf_fn cv_gemm_bf16dot_pf_table[CV_MR + 1];

/* avx2_lora.c, avx512_lora.c (the kernel table's LoRA entries). */
void cv_lora_shrink_avx2(float *t, int64_t t_stride, const float *const *x, int nr, const void *a, int bf16,
                         int64_t rank, int64_t in, const void *next, int64_t next_bytes);
void cv_lora_shrink_avx512(float *t, int64_t t_stride, const float *const *x, int nr, const void *a, int bf16,
                           int64_t rank, int64_t in, const void *next, int64_t next_bytes);
void cv_lora_expand_avx2(float *const *y, const float *t, int64_t t_stride, int nr, const void *bt, int bf16,
                         int64_t rank, int64_t out, float scale, const void *next, int64_t next_bytes);
void cv_lora_expand_avx512(float *const *y, const float *t, int64_t t_stride, int nr, const void *bt, int bf16,
                           int64_t rank, int64_t out, float scale, const void *next, int64_t next_bytes);

/* avx2_rows.c, avx512_rows.c (the kernel table's row entries). */
void cv_rms_row_avx2(float *out, const float *x, const float *w, int64_t dim, float eps);
void cv_rms_row_avx512(float *out, const float *x, const float *w, int64_t dim, float eps);
int64_t cv_swiglu_part_avx2(float *o, const float *g, const float *u, int64_t dim);
int64_t cv_swiglu_part_avx512(float *o, const float *g, const float *u, int64_t dim);
int64_t cv_geglu_part_avx2(float *o, const float *g, const float *u, int64_t dim);
int64_t cv_widen_part_avx2(float *dst, const uint16_t *s, cv_dtype dt, int64_t n);
int64_t cv_widen_part_avx512(float *dst, const uint16_t *s, cv_dtype dt, int64_t n);
int64_t cv_narrow_part_avx2(uint16_t *d, cv_dtype dt, const float *src, int64_t n);
int64_t cv_narrow_part_avx512(uint16_t *d, cv_dtype dt, const float *src, int64_t n);
void cv_rope_head_avx2(float *x, int64_t hd, cv_rope_layout layout, int64_t i0, int64_t m, const float *cs,
                       const float *sn, const float *cs2, const float *sn2);
void cv_rope_head_avx512(float *x, int64_t hd, cv_rope_layout layout, int64_t i0, int64_t m, const float *cs,
                         const float *sn, const float *cs2, const float *sn2);
void cv_kv_quantize_i8_avx512(int8_t *dst, float *scale, const float *x, int64_t hd);

/* avx2_attention.c: the chunk kernels of paged attention (contract below). */
void cv_att_scores_avx2(float *sc, const float *qt, int64_t hd, int nv, const int *nval, const void *const *kp,
                        cv_dtype dt, float *row);
void cv_att_pv_avx2(float *acc, const float *sc, const float *alpha, int64_t hd, int nv, const int *nval,
                    const void *const *vp, cv_dtype dt, float *row);
void cv_att_scale_avx2(float *sc, int nv, const int *nval, const float *s);
void cv_att_softmax_avx2(float *sc, int nk, int nv, const int *nval, float *m, float *l, float *alpha);
#endif

/* avx512_attention.c: the AVX-512 chunk kernels of paged attention, for one
 * chunk of at most CV_ATT_KCHUNK keys of a tile of nv query vectors. Vector v
 * has valid keys [0, nval[v]) of the chunk; kp[i] and vp[i] point at key i's
 * K and V rows (head_dim values of dtype dt) for i < max(nval);
 * sc[v][CV_ATT_KCHUNK] holds scores, then probabilities.
 *
 * Batch invariance (see attention.c): every vector's sums run in an order
 * fixed by head_dim alone, whichever group of its tile a vector falls in. */
#if CV_HAVE_AVX512
/* AVX512 level, fp32 math over any cache dtype (int8: the stored integers;
 * attention.c applies the rows' scales). Scores: per (vector, key)
 * 16-lane FMA accumulators over head_dim, then 16 of them summed together by
 * one transpose-add tree (each lane pair at distance 8, 4, 2, 1). */
void cv_att_scores_avx512(float *sc, const float *qt, int64_t hd, int nv, const int *nval,
                          const void *const *kp, cv_dtype dt, float *row);
/* acc[v] = acc[v] * alpha[v] + sum_i p[v][i] V_i. */
void cv_att_pv_avx512(float *acc, const float *sc, const float *alpha, int64_t hd, int nv,
                      const int *nval, const void *const *vp, cv_dtype dt, float *row);
/* int8 cache: sc[v][i] *= s[i] for i < nval[v] (as cv_att_scale_plain in attention.c). */
void cv_att_scale_avx512(float *sc, int nv, const int *nval, const float *s);
/* Online-softmax step of the nv vectors (each as cv_att_softmax_plain in
 * attention.c): m, l and alpha are [nv]. */
void cv_att_softmax_avx512(float *sc, int nk, int nv, const int *nval, float *m, float *l, float *alpha);

/* AVX512_BF16 level over a bf16 cache: vdpbf16ps on pairs along head_dim
 * for q.k (the scaled queries rounded to bf16 once per tile, qb; the chunk's
 * keys transposed to pairs of dims by key, so a score is one lane summed over
 * the pairs in order) and on pairs of keys for p.V (probabilities rounded to
 * bf16; the softmax sum l stays the fp32 one). Error against fp32 math: a
 * score moves by at most 2^-9 sum_d |q_d k_d| (q rounding; products and sums
 * are fp32), an output by at most 2^-9 sum_i w_i |v_i| more (p rounding);
 * tests/test_kernels.py holds the kernel to that bound. */
/* qb is [nv][cv_att_qb_stride(hd)] bf16, zero past head_dim. */
int64_t cv_att_qb_stride(int64_t hd);
void cv_att_round_q_bf16(uint16_t *qb, const float *qt, int64_t hd, int nv);
void cv_att_scores_bf16(float *sc, const uint16_t *qb, int64_t hd, int nv, const int *nval,
                        const void *const *kp, const void *const *pf, int npf);
void cv_att_pv_bf16(float *acc, const float *sc, const float *alpha, int64_t hd, int nv,
                    const int *nval, const void *const *vp, const void *const *pf, int npf);
#endif

/* AVX512-VNNI over an int8 cache (with the AVX512_BF16 level, which every CPU
 * that has it pairs with VNNI): integer dot products on the stored bytes.
 * - Scores: the scaled queries quantized once per tile, per 32 dims, to
 *   15-bit integers (a float scale a block, max / 16383), each split into two
 *   signed bytes q = 128 h + l (qp, laid out by cv_att_quantize_q_i8); the
 *   chunk's keys transposed to 4 bytes a key (plus 128, unsigned for
 *   vpdpbusd; each block's two accumulators start at -128 times the sums of
 *   their query bytes, so 128 h + l is the exact integer block dot). sc gets
 *   the sum over blocks, in order, of the block scale times the block dot:
 *   the raw score before the rows' key scales, as the fp32 kernels give it.
 * - P.V: each vector's chunk of p times the value scales (sc after
 *   att_scale) as int16 of one scale per vector and chunk (max / 32767), by
 *   pairs of keys on vpdpwssd against the value rows widened to int16; the
 *   exact int32 sums turn into floats once per chunk: acc = acc * alpha +
 *   scale * sum.
 * Error against fp32 math on the same cache: a score moves by at most
 * sum over blocks of d_b / 2 sum_{d in b} |k_d| (d_b the block's query
 * scale, k the dequantized key), an output by at most 2^-16 max_i(w_i) sum_i |v8_i|
 * more (w the probabilities times the value scales, v8 the stored values);
 * tests/test_kv_int8.py holds the kernels to that bound. */
#if CV_HAVE_AVX512 && (defined(CV_EMULATE_AVX512) || (defined(__GNUC__) && (__GNUC__ >= 11 || \
    (defined(__clang_major__) && __clang_major__ >= 12))))
#define CV_HAVE_ATT_I8DOT 1
/* qp holds 2 nv x (hd rounded up to 64) bytes and 12 bytes per 32 of them:
 * within a tile's row scratch (nv * hd <= CV_ATT_TILE * CV_ATT_MAX_HD floats). */
void cv_att_quantize_q_i8(void *qp, const float *qt, int64_t hd, int nv);
void cv_att_scores_i8(float *sc, const void *qp, int64_t hd, int nv, const int *nval, const void *const *kp,
                      const void *const *pf, int npf);
void cv_att_pv_i8(float *acc, const float *sc, const float *alpha, int64_t hd, int nv, const int *nval,
                  const void *const *vp, const void *const *pf, int npf);
#else
#define CV_HAVE_ATT_I8DOT 0
#endif

#endif /* CV_X86_KERNELS_H */
