/* The CPU kernels of one SIMD level, as one table of function pointers
 * (ggml-cpu style): filled once per backend from its level
 * (cv_cpu_kernels_fill), then read by the drivers (gemm.c, attention.c,
 * elementwise.c, row_kernels.c, convert.c, kv_write.c) once per call or per
 * tile, never per element. A level without its own version of a kernel gets
 * the best one below it; the plain-C references live beside their drivers and
 * the SIMD versions under x86/ (x86/kernels.h). Every entry gives a row the
 * same bits whatever call, tile or batch it is in (the batch-invariance
 * contract), so a level's results depend only on the level.
 *
 * Included by cpu_internal.h after the kernel shapes (CV_MR, CV_ATT_KCHUNK). */
#ifndef CV_CPU_KERNEL_TABLE_H
#define CV_CPU_KERNEL_TABLE_H

#include <stddef.h>
#include <stdint.h>

#include "../backend.h"
#include "cpu_features.h"

/* A GEMM micro-kernel (contract in gemm_ukr.h). */
typedef void (*cv_ukr_fn)(int64_t kc, const float *x, int64_t ldx, const void *w, size_t wstride, float *c,
                          int64_t ldc, int nvalid, const float *bias, int load_c);
/* The same, also asking for the lines pf .. pf + 64 (pf_lines - 1) (prefetch
 * into L2) spread over its k steps (cv_prefetch_spread). */
typedef void (*cv_ukr_pf_fn)(int64_t kc, const float *x, int64_t ldx, const void *w, size_t wstride, float *c,
                             int64_t ldc, int nvalid, const float *bias, int load_c, const char *pf,
                             int64_t pf_lines);

/* GELU (tanh form, PyTorch's gelu(approximate="tanh")) gated by up: Gemma's
 * FFN. 0.5 x (1 + tanh(y)) = x / (1 + exp(-2y)) with y = sqrt(2/pi) (x +
 * 0.044715 x^3): SwiGLU's form with the exponent -2y, so the same exp. */
#define CV_GELU_K 0.7978845608028654f
#define CV_GELU_C 0.044715f

typedef struct cv_cpu_kernels {
    cv_simd_level level; /* the level filled for */

    /* GEMM: micro-kernels [mr] (mr 0 unused) per weight dtype (dt_index in
     * gemm_ukr.h), and panels per call at each tile height. */
    const cv_ukr_fn *gemm[3];
    int gemm_np[CV_MR + 1];
    /* The same kernels that also prefetch [dtype][mr]; NULL where the level has none. */
    const cv_ukr_pf_fn *gemm_pf[3];
    /* bf16 weights in the pair layout (vdpbf16ps) [mr], with and without
     * prefetching; NULL where the level has no such kernels. */
    const cv_ukr_fn *gemm_pairs;
    const cv_ukr_pf_fn *gemm_pairs_pf;

    /* Rows (row_kernels.c, convert.c). A `_part` entry does a leading part of
     * the row and returns how many values it did (NULL: none); the plain code
     * of its driver does the rest. */
    void (*rms_row)(float *out, const float *x, const float *w, int64_t dim, float eps);
    int64_t (*swiglu_part)(float *o, const float *g, const float *u, int64_t dim);
    int64_t (*geglu_part)(float *o, const float *g, const float *u, int64_t dim);
    int64_t (*widen_part)(float *dst, const uint16_t *src, cv_dtype dt, int64_t n);    /* float16/bfloat16 -> f32 */
    int64_t (*narrow_part)(uint16_t *dst, cv_dtype dt, const float *src, int64_t n);   /* f32 -> float16/bfloat16 */
    /* One head's row into the int8 KV cache, and its scale (kv_write.c). */
    void (*kv_quantize_i8)(int8_t *dst, float *scale, const float *x, int64_t hd);
    /* RoPE on frequencies [i0, i0 + m) of one head x[hd] with cs/sn[m]
     * (PAIRS: also cs2/sn2[2m], (c, c) and (-s, s) per frequency). */
    void (*rope_head)(float *x, int64_t hd, cv_rope_layout layout, int64_t i0, int64_t m, const float *cs,
                      const float *sn, const float *cs2, const float *sn2);

    /* Paged attention, one chunk of at most CV_ATT_KCHUNK keys of a tile of
     * nv query vectors (contract in x86/kernels.h); row[head_dim] is scratch. */
    void (*att_scores)(float *sc, const float *qt, int64_t hd, int nv, const int *nval, const void *const *kp,
                       cv_dtype dt, float *row);
    void (*att_scale)(float *sc, int nv, const int *nval, const float *s);
    void (*att_softmax)(float *sc, int nk, int nv, const int *nval, float *m, float *l, float *alpha);
    void (*att_pv)(float *acc, const float *sc, const float *alpha, int64_t hd, int nv, const int *nval,
                   const void *const *vp, cv_dtype dt, float *row);
    /* Over a bf16 cache with vdpbf16ps (NULL where the level has none): the
     * scaled queries rounded once per tile, then scores and P.V on them.
     * pf[npf] (NULL: none): the next chunk's K rows (scores) or V rows (P.V),
     * asked for a few at a time over the call's loop, so that they arrive
     * while this chunk computes without one burst filling the miss buffers. */
    void (*att_round_q_bf16)(uint16_t *qb, const float *qt, int64_t hd, int nv);
    void (*att_scores_bf16)(float *sc, const uint16_t *qb, int64_t hd, int nv, const int *nval,
                            const void *const *kp, const void *const *pf, int npf);
    void (*att_pv_bf16)(float *acc, const float *sc, const float *alpha, int64_t hd, int nv, const int *nval,
                        const void *const *vp, const void *const *pf, int npf);
    /* Over an int8 cache with VNNI (NULL where the level or CPU has none):
     * the scaled queries quantized once per tile into qp (the tile's row
     * scratch), then integer scores and P.V on the stored bytes; pf as above. */
    void (*att_quantize_q_i8)(void *qp, const float *qt, int64_t hd, int nv);
    void (*att_scores_i8)(float *sc, const void *qp, int64_t hd, int nv, const int *nval, const void *const *kp,
                          const void *const *pf, int npf);
    void (*att_pv_i8)(float *acc, const float *sc, const float *alpha, int64_t hd, int nv, const int *nval,
                      const void *const *vp, const void *const *pf, int npf);

    /* LoRA (lora.c), over nr <= CV_LORA_ROWS rows of one adapter at once,
     * its weights float32 or (bf16) bf16: the shrink t[i][r] = x[i] . a[r][in]
     * for r < rank, and the expand y[i][o] += scale * (t[i] . bt[.][o]) for o <
     * out, bt in panels (kernels/backend.h: CV_LORA_BT_AT). Row i's result is the same whatever nr is.
     * next (next_bytes of it; NULL: none) is what the following call reads (the next adapter's
     * matrix): its lines are asked for at even spacing over this call's loop, so that they arrive
     * while this call computes instead of after it. */
    void (*lora_shrink)(float *t, int64_t t_stride, const float *const *x, int nr, const void *a, int bf16,
                        int64_t rank, int64_t in, const void *next, int64_t next_bytes);
    void (*lora_expand)(float *const *y, const float *t, int64_t t_stride, int nr, const void *bt, int bf16,
                        int64_t rank, int64_t out, float scale, const void *next, int64_t next_bytes);
} cv_cpu_kernels;

/* The kernels of `level` (a level above what this build has code for gets
 * the best it has). */
void cv_cpu_kernels_fill(cv_simd_level level, cv_cpu_kernels *k);

/* The plain-C references, beside their drivers. */
extern const cv_ukr_fn cv_gemm_plain_table[3][CV_MR + 1]; /* gemm.c */
void cv_rms_row_plain(float *out, const float *x, const float *w, int64_t dim, float eps); /* row_kernels.c */
void cv_kv_quantize_i8_plain(int8_t *dst, float *scale, const float *x, int64_t hd);     /* kv_write.c */
void cv_rope_head_plain(float *x, int64_t hd, cv_rope_layout layout, int64_t i0, int64_t m, const float *cs,
                        const float *sn, const float *cs2, const float *sn2);           /* elementwise.c */
void cv_att_scores_plain(float *sc, const float *qt, int64_t hd, int nv, const int *nval, const void *const *kp,
                         cv_dtype dt, float *row); /* attention.c */
void cv_att_scale_plain(float *sc, int nv, const int *nval, const float *s);
void cv_att_softmax_plain(float *sc, int nk, int nv, const int *nval, float *m, float *l, float *alpha);
void cv_att_pv_plain(float *acc, const float *sc, const float *alpha, int64_t hd, int nv, const int *nval,
                     const void *const *vp, cv_dtype dt, float *row);
void cv_lora_shrink_plain(float *t, int64_t t_stride, const float *const *x, int nr, const void *a, int bf16,
                          int64_t rank, int64_t in, const void *next, int64_t next_bytes); /* lora.c */
void cv_lora_expand_plain(float *const *y, const float *t, int64_t t_stride, int nr, const void *bt, int bf16,
                          int64_t rank, int64_t out, float scale, const void *next, int64_t next_bytes);

#endif
