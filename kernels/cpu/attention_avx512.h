/* The AVX-512 chunk kernels of paged attention (attention_avx512.c), called
 * by attention.c for one chunk of at most CV_ATT_KCHUNK keys of a tile of nv
 * query vectors. Vector v has valid keys [0, nval[v]) of the chunk; kp[i] and
 * vp[i] point at key i's K and V rows (head_dim values of dtype dt) for i <
 * max(nval); sc[v][CV_ATT_KCHUNK] holds scores, then probabilities.
 *
 * Batch invariance (see attention.c): every vector's sums run in an order
 * fixed by head_dim alone, whichever group of its tile a vector falls in. */
#ifndef CV_ATTENTION_AVX512_H
#define CV_ATTENTION_AVX512_H

#include "cpu_internal.h"

#if CV_HAVE_AVX512
/* AVX512 level, fp32 math over any cache dtype (int8: the stored integers;
 * attention.c applies the rows' scales). Scores: per (vector, key)
 * 16-lane FMA accumulators over head_dim, then 16 of them summed together by
 * one transpose-add tree (each lane pair at distance 8, 4, 2, 1). */
void cv_att_scores_avx512(float *sc, const float *qt, int64_t hd, int nv, const int *nval,
                          const void *const *kp, cv_dtype dt);
/* acc[v] = acc[v] * alpha[v] + sum_i p[v][i] V_i. */
void cv_att_pv_avx512(float *acc, const float *sc, const float *alpha, int64_t hd, int nv,
                      const int *nval, const void *const *vp, cv_dtype dt);
/* int8 cache: sc[v][i] *= s[i] for i < nval[v] (as i8_scale in attention.c). */
void cv_att_scale_avx512(float *sc, int nv, const int *nval, const float *s);
/* Online-softmax step of the nv vectors (each as softmax_step_plain in
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
                        const void *const *kp);
void cv_att_pv_bf16(float *acc, const float *sc, const float *alpha, int64_t hd, int nv,
                    const int *nval, const void *const *vp);
#endif

#endif
