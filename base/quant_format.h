/* Block-quantized weight formats: GGUF's Q8_0, Q4_0, Q4_1 (quantized here
 * too), Q5_0, Q5_1, Q3_K, Q4_K, Q5_K, Q6_K (read from files), and the two exact
 * repackings the CPU kernels compute the latter in; the block layouts, the
 * scalar dequantizers and the quantizers.
 *
 * Inline in this header so that the CPU backend, the model loader and the
 * CUDA backend (a separate library that dequantizes at load) share one
 * definition; quant_format.c adds the whole-array conversions the core links. Every
 * block covers 32 consecutive elements of a row; d and m are IEEE float16:
 *   Q8_0  d, int8 q[32]                                   x = d * q
 *   Q4_0  d, u8 qs[16] (byte j: element j low nibble,     x = d * (q - 8)
 *                       element j + 16 high nibble)
 *   Q4_1  d, m, u8 qs[16] (same nibble order)             x = d * q + m
 * The quantizers round as ggml's reference ones do (scale from float32
 * arithmetic, stored as float16), so a model quantized here at load equals
 * the same model quantized by llama.cpp's tools or conveyor.gguf. */
#ifndef CV_QUANT_FORMAT_H
#define CV_QUANT_FORMAT_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "common.h"

#define CV_QK 32 /* elements per block */

/* Converts n elements of src (dtype st) to float32 dst (quantized types:
 * n a multiple of 32, dequantized); defined in quant_format.c, which the
 * core links and the CUDA library does not need. */
void cv_convert_to_f32(float *dst, const void *src, cv_dtype st, size_t n);
/* Converts n float32 values to dtype dt (F32, F16 or BF16). */
void cv_convert_from_f32(void *dst, cv_dtype dt, const float *src, size_t n);

/* K-quant super-blocks: 256 elements, 8 sub-blocks of 32 (Q4_K, Q5_K) or
 * 16 of 16 (Q6_K). Q4_K/Q5_K's 12 scale bytes hold eight 6-bit scales sc
 * and eight 6-bit mins mn (cv_kq_scale_min); sub-block s is
 *   x = (d * sc_s) * q - (dmin * mn_s)
 * with q 4 bits (Q4_K: sub-blocks 2c and 2c+1 are the low and high nibbles
 * of qs[32c..32c+31]) or 5 (Q5_K: the same nibbles plus bit 2c / 2c+1 of
 * qh[l] as the fifth bit). Q6_K's element 128h + 32k + l (h half, k 0..3,
 * l 0..31) takes 4 bits from ql[64h + l + 32(k&1)] (low nibble for k < 2,
 * high else) and 2 from qh[32h + l] (bits 2k, 2k+1):
 *   x = d * sc[8h + 2k + l/16] * (q - 32), sc signed 8-bit.
 * Q3_K: 16 sub-blocks of 16 with 6-bit scales sc (low 4 bits: byte i of
 * scales[0..7] for i < 8, else the high nibble of byte i - 8; top 2 bits:
 * bits 2(i/4), +1 of scales[8 + i%4]); element 128h + 32k + l takes 2 bits
 * (2k, 2k+1) of qs[32h + l] and one of hmask[l] (bit 4h + k; clear means
 * minus 4):  x = d * (sc[8h + 2k + l/16] - 32) * q, q in -4..3.
 * Q2_K: 16 sub-blocks of 16, each with a 4-bit scale (low nibble of
 * scales[i]) and a 4-bit min (high nibble); element 128h + 32k + l is bits
 * 2k, 2k+1 of qs[32h + l] (Q3_K's low bits), in sub-block i = 8h + 2k + l/16:
 *   x = (d * sc_i) * q - (dmin * mn_i), q in 0..3.
 * Its two mins per 32 elements do not fit Q8_F (one min a block): the
 * kernels compute Q2_K as stored (cv_quant_compute_type), with the
 * activations' sums per 16 for the mins. */
#define CV_QK_K 256

typedef struct cv_block_q5_0 {
    uint16_t d;
    uint8_t qh[4];          /* bit j: the fifth bit of element j */
    uint8_t qs[CV_QK / 2];  /* Q4_0's nibble order */
} cv_block_q5_0;            /* x = d * (q - 16) */

typedef struct cv_block_q5_1 {
    uint16_t d, m;
    uint8_t qh[4];
    uint8_t qs[CV_QK / 2];
} cv_block_q5_1;            /* x = d * q + m */

typedef struct cv_block_q4_k {
    uint16_t d, dmin;
    uint8_t scales[12];
    uint8_t qs[CV_QK_K / 2];
} cv_block_q4_k;

typedef struct cv_block_q5_k {
    uint16_t d, dmin;
    uint8_t scales[12];
    uint8_t qh[CV_QK_K / 8];
    uint8_t qs[CV_QK_K / 2];
} cv_block_q5_k;

typedef struct cv_block_q3_k {
    uint8_t hmask[CV_QK_K / 8];
    uint8_t qs[CV_QK_K / 4];
    uint8_t scales[12];
    uint16_t d;
} cv_block_q3_k;

typedef struct cv_block_q2_k {
    uint8_t scales[CV_QK_K / 16]; /* low nibble scale, high nibble min */
    uint8_t qs[CV_QK_K / 4];
    uint16_t d, dmin;
} cv_block_q2_k;

typedef struct cv_block_q6_k {
    uint8_t ql[CV_QK_K / 2];
    uint8_t qh[CV_QK_K / 4];
    int8_t scales[CV_QK_K / 16];
    uint16_t d;
} cv_block_q6_k;

/* The repackings (CPU only, never in files). A K-quant sub-block's scale
 * d * sc and min dmin * mn are exact in float32 (11-bit half mantissas
 * times 6- or 8-bit integers: at most 19 significant bits), and so is each
 * product scale * q (at most 24 bits). Keeping those products as float32
 * gives every block the form x = scale * q + min with small integers q:
 *   Q4_F  d, m (float32), u8 qs[16] in Q4_0's nibble order    x = d * q + m
 *         (Q4_K: the 4-bit sub-blocks, m = -(dmin * mn))
 *   Q8_F  d[2], m (float32), int8 q[32]       x = d[j / 16] * q_j (+ m)
 *         (the other formats: Q6_K q - 32 and Q3_K's -4..3 with a scale
 *         per 16, Q5_1/Q5_K q with their min; m = 0 where the format has
 *         none; Q5_0 too in a stack mixed with those)
 * Q5_0 alone is computed as Q8_0: its x = d * (q - 16), d float16, is a
 * Q8_0 block with the int8 q - 16 (34 bytes a block against Q8_F's 44).
 * The dequantized values are the same floats as the format's own
 * (cv_dequantize computes both the same way); the GEMM's integer dot
 * products are exact, so only its float32 scaling and summation differ
 * from a dot over the dequantized values. */
typedef struct cv_block_q4_f {
    float d, m;
    uint8_t qs[CV_QK / 2];
} cv_block_q4_f;

typedef struct cv_block_q8_f {
    float d[2], m;
    int8_t qs[CV_QK];
} cv_block_q8_f;

/* Q8_M (CPU only): a scale and a min per 16, the form of a stacked matrix
 * that mixes Q2_K (two mins a block) with other formats; every format fits
 * it exactly (Q8_F's values, and Q2_K's d * sc, -(dmin * mn)):
 *   x = d[j / 16] * q_j + m[j / 16]
 * computed like Q2_K, with the activations' sums per 16. */
typedef struct cv_block_q8_m {
    float d[2], m[2];
    int8_t qs[CV_QK];
} cv_block_q8_m;

typedef struct cv_block_q8_0 {
    uint16_t d;
    int8_t qs[CV_QK];
} cv_block_q8_0;

typedef struct cv_block_q4_0 {
    uint16_t d;
    uint8_t qs[CV_QK / 2];
} cv_block_q4_0;

typedef struct cv_block_q4_1 {
    uint16_t d, m;
    uint8_t qs[CV_QK / 2];
} cv_block_q4_1;

/* GGUF stores the blocks back to back with no padding. */
typedef char cv_q8_0_is_34_bytes[sizeof(cv_block_q8_0) == 34 ? 1 : -1];
typedef char cv_q4_0_is_18_bytes[sizeof(cv_block_q4_0) == 18 ? 1 : -1];
typedef char cv_q4_1_is_20_bytes[sizeof(cv_block_q4_1) == 20 ? 1 : -1];
typedef char cv_q5_0_is_22_bytes[sizeof(cv_block_q5_0) == 22 ? 1 : -1];
typedef char cv_q5_1_is_24_bytes[sizeof(cv_block_q5_1) == 24 ? 1 : -1];
typedef char cv_q4_k_is_144_bytes[sizeof(cv_block_q4_k) == 144 ? 1 : -1];
typedef char cv_q5_k_is_176_bytes[sizeof(cv_block_q5_k) == 176 ? 1 : -1];
typedef char cv_q3_k_is_110_bytes[sizeof(cv_block_q3_k) == 110 ? 1 : -1];
typedef char cv_q6_k_is_210_bytes[sizeof(cv_block_q6_k) == 210 ? 1 : -1];
typedef char cv_q2_k_is_84_bytes[sizeof(cv_block_q2_k) == 84 ? 1 : -1];
typedef char cv_q8_m_is_48_bytes[sizeof(cv_block_q8_m) == 48 ? 1 : -1];

static inline int cv_dtype_is_quant(cv_dtype t) { return (t >= CV_Q8_0 && t <= CV_Q8_F) || t == CV_Q2_K || t == CV_Q8_M; }

/* The types cv_quantize makes (quantization at load). */
static inline int cv_dtype_can_quantize(cv_dtype t) { return t == CV_Q8_0 || t == CV_Q4_0 || t == CV_Q4_1; }

/* Elements of one block (0 for a type that is not block-quantized). */
static inline size_t cv_quant_block_elems(cv_dtype t) {
    if (t == CV_Q2_K) return CV_QK_K;
    return t == CV_Q3_K || t == CV_Q4_K || t == CV_Q5_K || t == CV_Q6_K ? CV_QK_K : cv_dtype_is_quant(t) ? CV_QK : 0;
}

/* Bytes of one block (0 for a type that is not block-quantized). */
static inline size_t cv_quant_block_bytes(cv_dtype t) {
    switch (t) {
    case CV_Q8_0: return sizeof(cv_block_q8_0);
    case CV_Q4_0: return sizeof(cv_block_q4_0);
    case CV_Q4_1: return sizeof(cv_block_q4_1);
    case CV_Q5_0: return sizeof(cv_block_q5_0);
    case CV_Q5_1: return sizeof(cv_block_q5_1);
    case CV_Q4_K: return sizeof(cv_block_q4_k);
    case CV_Q5_K: return sizeof(cv_block_q5_k);
    case CV_Q6_K: return sizeof(cv_block_q6_k);
    case CV_Q3_K: return sizeof(cv_block_q3_k);
    case CV_Q2_K: return sizeof(cv_block_q2_k);
    case CV_Q8_M: return sizeof(cv_block_q8_m);
    case CV_Q4_F: return sizeof(cv_block_q4_f);
    case CV_Q8_F: return sizeof(cv_block_q8_f);
    default: return 0;
    }
}

/* The type the CPU kernels compute a stored type in: Q8_0, Q4_0, Q4_1 and
 * the repackings as they are, Q4_K as Q4_F, Q5_0 as Q8_0, the others as
 * Q8_F. */
static inline cv_dtype cv_quant_compute_type(cv_dtype t) {
    return t == CV_Q4_K ? CV_Q4_F
         : t == CV_Q5_0 ? CV_Q8_0
         : t == CV_Q5_1 || t == CV_Q5_K || t == CV_Q6_K || t == CV_Q3_K ? CV_Q8_F : t;
}

/* Bytes of n elements of any weight dtype (n a multiple of the block for
 * the quantized ones); 0 on overflow or an unknown dtype. */
static inline size_t cv_dtype_bytes(cv_dtype t, size_t n) {
    size_t unit = cv_dtype_is_quant(t) ? cv_quant_block_bytes(t) : cv_dtype_size(t);
    size_t count = cv_dtype_is_quant(t) ? n / cv_quant_block_elems(t) : n;
    if (unit == 0 || (count != 0 && unit > SIZE_MAX / count)) return 0;
    return count * unit;
}

/* IEEE half <-> float (round to nearest even), self-contained so that the
 * CUDA library can use this header without the core's common.c. */
static inline float cv_qh_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        u = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        u = sign;
    } else { /* subnormal: value man * 2^-24 */
        float f = (float)man * 5.9604644775390625e-8f;
        memcpy(&u, &f, 4);
        u |= sign;
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t cv_qh_from_f32(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000);
    uint32_t a = u & 0x7fffffffu;
    if (a >= 0x7f800000u) return (uint16_t)(sign | 0x7c00 | (a > 0x7f800000u ? 0x200 : 0));
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00); /* rounds past 65504: inf */
    if (a < 0x38800000u) { /* below the smallest normal half: round in units of 2^-24 */
        float v;
        memcpy(&v, &a, 4);
        float q = v * 16777216.0f; /* exact: a power-of-two scale */
        uint32_t r = (uint32_t)q;
        float frac = q - (float)r;
        if (frac > 0.5f || (frac == 0.5f && (r & 1))) r++;
        return (uint16_t)(sign | r);
    }
    uint32_t mant_odd = (a >> 13) & 1;
    a += 0xc8000fffu + mant_odd; /* rebias exponent (-112 << 23) and round to nearest even */
    return (uint16_t)(sign | (a >> 13));
}

/* ---- dequantize ------------------------------------------------------------ */

/* Sub-block j's 6-bit scale and min from Q4_K/Q5_K's 12 scale bytes: the
 * first four pairs are the low 6 bits of bytes 0..3 and 4..7; the last four
 * take their low 4 bits from bytes 8..11 and their top 2 from the top bits
 * of bytes 0..3 (scales) and 4..7 (mins). */
static inline void cv_kq_scale_min(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xf) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* Block i (of 32 elements) of a row stored in type t as integers q with
 * x_j = d[j / 16] * q_j + m (*has_min: 0 where the format has no min, and
 * then x_j = d[j / 16] * q_j exactly as the format computes it, so that a
 * zero keeps its sign). For every format these are the same float32
 * operations as the format's own dequantization, hence the same values. */
static inline void cv_quant_block32(const void *src, cv_dtype t, size_t i, int q[CV_QK], float d[2], float *m,
                                    int *has_min) {
    *m = 0.0f;
    *has_min = 0;
    switch (t) {
    case CV_Q8_0: {
        const cv_block_q8_0 *b = (const cv_block_q8_0 *)src + i;
        d[0] = d[1] = cv_qh_to_f32(b->d);
        for (int j = 0; j < CV_QK; j++) q[j] = b->qs[j];
        break;
    }
    case CV_Q4_0: {
        const cv_block_q4_0 *b = (const cv_block_q4_0 *)src + i;
        d[0] = d[1] = cv_qh_to_f32(b->d);
        for (int j = 0; j < CV_QK / 2; j++) {
            q[j] = (b->qs[j] & 0xf) - 8;
            q[j + CV_QK / 2] = (b->qs[j] >> 4) - 8;
        }
        break;
    }
    case CV_Q4_1: {
        const cv_block_q4_1 *b = (const cv_block_q4_1 *)src + i;
        d[0] = d[1] = cv_qh_to_f32(b->d);
        *m = cv_qh_to_f32(b->m);
        *has_min = 1;
        for (int j = 0; j < CV_QK / 2; j++) {
            q[j] = b->qs[j] & 0xf;
            q[j + CV_QK / 2] = b->qs[j] >> 4;
        }
        break;
    }
    case CV_Q5_0:
    case CV_Q5_1: {
        const uint8_t *qh, *qs;
        if (t == CV_Q5_0) {
            const cv_block_q5_0 *b = (const cv_block_q5_0 *)src + i;
            d[0] = d[1] = cv_qh_to_f32(b->d);
            qh = b->qh;
            qs = b->qs;
        } else {
            const cv_block_q5_1 *b = (const cv_block_q5_1 *)src + i;
            d[0] = d[1] = cv_qh_to_f32(b->d);
            *m = cv_qh_to_f32(b->m);
            *has_min = 1;
            qh = b->qh;
            qs = b->qs;
        }
        const uint32_t h = (uint32_t)qh[0] | (uint32_t)qh[1] << 8 | (uint32_t)qh[2] << 16 | (uint32_t)qh[3] << 24;
        const int off = t == CV_Q5_0 ? 16 : 0;
        for (int j = 0; j < CV_QK / 2; j++) {
            q[j] = ((qs[j] & 0xf) | (int)((h >> j) & 1) << 4) - off;
            q[j + CV_QK / 2] = ((qs[j] >> 4) | (int)((h >> (j + 16)) & 1) << 4) - off;
        }
        break;
    }
    case CV_Q4_K:
    case CV_Q5_K: {
        const size_t sb = i / 8;
        const int s = (int)(i % 8), c = s / 2, shift = (s & 1) * 4;
        const uint16_t *dd;
        const uint8_t *scales, *qs, *qh = NULL;
        if (t == CV_Q4_K) {
            const cv_block_q4_k *b = (const cv_block_q4_k *)src + sb;
            dd = &b->d;
            scales = b->scales;
            qs = b->qs;
        } else {
            const cv_block_q5_k *b = (const cv_block_q5_k *)src + sb;
            dd = &b->d;
            scales = b->scales;
            qs = b->qs;
            qh = b->qh;
        }
        uint16_t dh, dminh;
        memcpy(&dh, dd, 2);
        memcpy(&dminh, dd + 1, 2);
        int sc, mn;
        cv_kq_scale_min(scales, s, &sc, &mn);
        d[0] = d[1] = cv_qh_to_f32(dh) * (float)sc; /* exact */
        *m = -(cv_qh_to_f32(dminh) * (float)mn);     /* exact */
        *has_min = 1;
        for (int l = 0; l < CV_QK; l++) {
            q[l] = (qs[32 * c + l] >> shift) & 0xf;
            if (qh) q[l] |= ((qh[l] >> s) & 1) << 4;
        }
        break;
    }
    case CV_Q6_K: {
        const cv_block_q6_k *b = (const cv_block_q6_k *)src + i / 8;
        const int s = (int)(i % 8), h = s / 4, k = s % 4; /* elements 128h + 32k + l */
        uint16_t dh;
        memcpy(&dh, &b->d, 2);
        const float sd = cv_qh_to_f32(dh);
        d[0] = sd * (float)b->scales[8 * h + 2 * k];     /* exact */
        d[1] = sd * (float)b->scales[8 * h + 2 * k + 1];
        const uint8_t *ql = b->ql + 64 * h + 32 * (k & 1), *qh = b->qh + 32 * h;
        for (int l = 0; l < CV_QK; l++) {
            const int lo = k < 2 ? ql[l] & 0xf : ql[l] >> 4;
            q[l] = (lo | ((qh[l] >> (2 * k)) & 3) << 4) - 32;
        }
        break;
    }
    case CV_Q3_K: {
        const cv_block_q3_k *b = (const cv_block_q3_k *)src + i / 8;
        const int s = (int)(i % 8), h = s / 4, k = s % 4; /* elements 128h + 32k + l */
        uint16_t dh;
        memcpy(&dh, &b->d, 2);
        const float sd = cv_qh_to_f32(dh);
        for (int half = 0; half < 2; half++) {
            const int si = 8 * h + 2 * k + half; /* the 6-bit scale of this 16 */
            const int lo = si < 8 ? b->scales[si] & 0xf : b->scales[si - 8] >> 4;
            const int hi = (b->scales[8 + si % 4] >> (2 * (si / 4))) & 3;
            d[half] = sd * (float)((lo | hi << 4) - 32); /* exact */
        }
        const uint8_t *qs = b->qs + 32 * h;
        for (int l = 0; l < CV_QK; l++)
            q[l] = ((qs[l] >> (2 * k)) & 3) - ((b->hmask[l] >> (4 * h + k)) & 1 ? 0 : 4);
        break;
    }
    case CV_Q4_F: {
        const cv_block_q4_f *b = (const cv_block_q4_f *)src + i;
        d[0] = d[1] = b->d;
        *m = b->m;
        *has_min = 1;
        for (int j = 0; j < CV_QK / 2; j++) {
            q[j] = b->qs[j] & 0xf;
            q[j + CV_QK / 2] = b->qs[j] >> 4;
        }
        break;
    }
    case CV_Q8_F: {
        const cv_block_q8_f *b = (const cv_block_q8_f *)src + i;
        d[0] = b->d[0];
        d[1] = b->d[1];
        *m = b->m;
        *has_min = 1;
        for (int j = 0; j < CV_QK; j++) q[j] = b->qs[j];
        break;
    }
    default:
        d[0] = d[1] = 0.0f;
        for (int j = 0; j < CV_QK; j++) q[j] = 0;
        break;
    }
}

/* dst[n] = the n elements (a multiple of 256) of Q2_K blocks at src, as the
 * format computes them: (d * sc) * q - (dmin * mn), both products exact. */
static inline void cv_dequantize_q2_k(float *dst, const void *src, size_t n) {
    for (size_t sb = 0; sb < n / CV_QK_K; sb++) {
        const cv_block_q2_k *b = (const cv_block_q2_k *)src + sb;
        uint16_t dh, dminh;
        memcpy(&dh, &b->d, 2);
        memcpy(&dminh, &b->dmin, 2);
        const float d = cv_qh_to_f32(dh), dmin = cv_qh_to_f32(dminh);
        for (int e = 0; e < CV_QK_K; e++) {
            const int h = e / 128, k = (e / 32) % 4, l = e % 32, i = 8 * h + 2 * k + l / 16;
            const float scale = d * (float)(b->scales[i] & 0xf), low = dmin * (float)(b->scales[i] >> 4);
            dst[sb * CV_QK_K + (size_t)e] = scale * (float)((b->qs[32 * h + l] >> (2 * k)) & 3) - low;
        }
    }
}

/* dst[n] = the n elements (a multiple of the type's block) stored at src in type t. */
static inline void cv_dequantize(float *dst, const void *src, cv_dtype t, size_t n) {
    int q[CV_QK], has_min;
    float d[2], m;
    if (t == CV_Q2_K) {
        cv_dequantize_q2_k(dst, src, n);
        return;
    }
    if (t == CV_Q8_M) {
        for (size_t i = 0; i < n / CV_QK; i++) {
            const cv_block_q8_m *b = (const cv_block_q8_m *)src + i;
            for (int j = 0; j < CV_QK; j++) dst[i * CV_QK + (size_t)j] = b->d[j / 16] * (float)b->qs[j] + b->m[j / 16];
        }
        return;
    }
    for (size_t i = 0; i < n / CV_QK; i++) {
        cv_quant_block32(src, t, i, q, d, &m, &has_min);
        float *y = dst + i * CV_QK;
        if (has_min)
            for (int j = 0; j < CV_QK; j++) y[j] = d[j / 16] * (float)q[j] + m;
        else
            for (int j = 0; j < CV_QK; j++) y[j] = d[j / 16] * (float)q[j];
    }
}

/* Repacks n elements of any quantized type (a multiple of its block) into
 * Q8_M: Q2_K's sub-block scales and mins as they are, every other format's
 * Q8_F values with its one min twice. */
static inline void cv_quant_repack_q8_m(void *dst, const void *src, cv_dtype src_t, size_t n) {
    int q[CV_QK], has_min;
    float d[2], m;
    for (size_t i = 0; i < n / CV_QK; i++) {
        cv_block_q8_m *b = (cv_block_q8_m *)dst + i;
        if (src_t == CV_Q2_K) {
            const cv_block_q2_k *s = (const cv_block_q2_k *)src + i / 8;
            const int h = (int)(i % 8) / 4, k = (int)(i % 4);
            uint16_t dh, dminh;
            memcpy(&dh, &s->d, 2);
            memcpy(&dminh, &s->dmin, 2);
            for (int half = 0; half < 2; half++) {
                const uint8_t sc = s->scales[8 * h + 2 * k + half];
                b->d[half] = cv_qh_to_f32(dh) * (float)(sc & 0xf);     /* exact */
                b->m[half] = -(cv_qh_to_f32(dminh) * (float)(sc >> 4)); /* exact */
            }
            for (int l = 0; l < CV_QK; l++) b->qs[l] = (int8_t)((s->qs[32 * h + l] >> (2 * k)) & 3);
        } else {
            cv_quant_block32(src, src_t, i, q, d, &m, &has_min);
            b->d[0] = d[0];
            b->d[1] = d[1];
            b->m[0] = b->m[1] = m;
            for (int j = 0; j < CV_QK; j++) b->qs[j] = (int8_t)q[j];
        }
    }
}

/* Repacks n elements (a multiple of the source's block) of a row stored in
 * type src_t into dst_t = cv_quant_compute_type(src_t), into Q8_F from any
 * quantized type but Q2_K (every other format's blocks fit it exactly:
 * |q| <= 128, scales and mins as above), or into Q8_M from any. Returns 0
 * when dst_t cannot hold src_t. */
static inline int cv_quant_repack(void *dst, cv_dtype dst_t, const void *src, cv_dtype src_t, size_t n) {
    if (!cv_dtype_is_quant(src_t) || (dst_t != CV_Q8_F && dst_t != CV_Q8_M && dst_t != cv_quant_compute_type(src_t)))
        return 0;
    if ((src_t == CV_Q2_K || src_t == CV_Q8_M) && dst_t == CV_Q8_F) return 0; /* two mins a block: not Q8_F */
    if (dst_t == src_t) {
        memcpy(dst, src, cv_dtype_bytes(src_t, n));
        return 1;
    }
    if (dst_t == CV_Q8_M) {
        cv_quant_repack_q8_m(dst, src, src_t, n);
        return 1;
    }
    int q[CV_QK], has_min;
    float d[2], m;
    for (size_t i = 0; i < n / CV_QK; i++) {
        cv_quant_block32(src, src_t, i, q, d, &m, &has_min);
        if (dst_t == CV_Q8_0) { /* from Q5_0: the same float16 scale, q - 16 in -16..15 */
            cv_block_q8_0 *b = (cv_block_q8_0 *)dst + i;
            memcpy(&b->d, &((const cv_block_q5_0 *)src + i)->d, 2);
            for (int j = 0; j < CV_QK; j++) b->qs[j] = (int8_t)q[j];
        } else if (dst_t == CV_Q4_F) { /* from Q4_K: q in 0..15 */
            cv_block_q4_f *b = (cv_block_q4_f *)dst + i;
            b->d = d[0];
            b->m = m;
            for (int j = 0; j < CV_QK / 2; j++) b->qs[j] = (uint8_t)(q[j] | q[j + CV_QK / 2] << 4);
        } else {
            cv_block_q8_f *b = (cv_block_q8_f *)dst + i;
            b->d[0] = d[0];
            b->d[1] = d[1];
            b->m = m;
            for (int j = 0; j < CV_QK; j++) b->qs[j] = (int8_t)q[j];
        }
    }
    return 1;
}

/* ---- quantize (ggml reference rounding) ------------------------------------- */

static inline float cv_q_inverse(float d) { return d != 0.0f ? 1.0f / d : 0.0f; }

/* Quantizes n elements (a multiple of CV_QK, all finite) of src into dst. */
static inline void cv_quantize(void *dst, const float *src, cv_dtype t, size_t n) {
    const size_t nb = n / CV_QK;
    for (size_t i = 0; i < nb; i++) {
        const float *x = src + i * CV_QK;
        if (t == CV_Q8_0) {
            cv_block_q8_0 *b = (cv_block_q8_0 *)dst + i;
            float amax = 0.0f;
            for (int j = 0; j < CV_QK; j++) amax = fabsf(x[j]) > amax ? fabsf(x[j]) : amax;
            const float d = amax / 127.0f, id = cv_q_inverse(d);
            b->d = cv_qh_from_f32(d);
            for (int j = 0; j < CV_QK; j++) {
                const float v = x[j] * id;
                b->qs[j] = (int8_t)roundf(v);
            }
        } else if (t == CV_Q4_0) {
            cv_block_q4_0 *b = (cv_block_q4_0 *)dst + i;
            float amax = 0.0f, max = 0.0f; /* the element of largest magnitude, signed */
            for (int j = 0; j < CV_QK; j++)
                if (fabsf(x[j]) > amax) { amax = fabsf(x[j]); max = x[j]; }
            const float d = max / -8.0f, id = cv_q_inverse(d);
            b->d = cv_qh_from_f32(d);
            for (int j = 0; j < CV_QK / 2; j++) {
                const float v0 = x[j] * id, v1 = x[j + CV_QK / 2] * id;
                const float w0 = v0 + 8.5f, w1 = v1 + 8.5f;
                const int q0 = (int)w0 < 15 ? (int)w0 : 15, q1 = (int)w1 < 15 ? (int)w1 : 15;
                b->qs[j] = (uint8_t)(q0 | (q1 << 4));
            }
        } else if (t == CV_Q4_1) {
            cv_block_q4_1 *b = (cv_block_q4_1 *)dst + i;
            float lo = x[0], hi = x[0];
            for (int j = 1; j < CV_QK; j++) {
                lo = x[j] < lo ? x[j] : lo;
                hi = x[j] > hi ? x[j] : hi;
            }
            const float d = (hi - lo) / 15.0f, id = cv_q_inverse(d);
            b->d = cv_qh_from_f32(d);
            b->m = cv_qh_from_f32(lo);
            for (int j = 0; j < CV_QK / 2; j++) {
                const float v0 = (x[j] - lo) * id, v1 = (x[j + CV_QK / 2] - lo) * id;
                const float w0 = v0 + 0.5f, w1 = v1 + 0.5f;
                const int q0 = (int)w0 < 15 ? (int)w0 : 15, q1 = (int)w1 < 15 ? (int)w1 : 15;
                b->qs[j] = (uint8_t)(q0 | (q1 << 4));
            }
        }
    }
}

#endif
