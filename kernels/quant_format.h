/* Block-quantized weight formats (GGUF's Q8_0, Q4_0, Q4_1): the block
 * layouts and the scalar quantizers and dequantizers.
 *
 * Header-only so that the CPU backend, the model loader and the CUDA backend
 * (a separate library that dequantizes at load) share one definition. Every
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

static inline int cv_dtype_is_quant(cv_dtype t) { return t == CV_Q8_0 || t == CV_Q4_0 || t == CV_Q4_1; }

/* Bytes of one block (0 for a type that is not block-quantized). */
static inline size_t cv_quant_block_bytes(cv_dtype t) {
    return t == CV_Q8_0 ? sizeof(cv_block_q8_0)
         : t == CV_Q4_0 ? sizeof(cv_block_q4_0)
         : t == CV_Q4_1 ? sizeof(cv_block_q4_1) : 0;
}

/* Bytes of n elements of any weight dtype (n a multiple of CV_QK for the
 * quantized ones); 0 on overflow or an unknown dtype. */
static inline size_t cv_dtype_bytes(cv_dtype t, size_t n) {
    size_t unit = cv_dtype_is_quant(t) ? cv_quant_block_bytes(t) : cv_dtype_size(t);
    size_t count = cv_dtype_is_quant(t) ? n / CV_QK : n;
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

/* dst[n] = the n elements (a multiple of CV_QK) stored at src in type t. */
static inline void cv_dequantize(float *dst, const void *src, cv_dtype t, size_t n) {
    const size_t nb = n / CV_QK;
    if (t == CV_Q8_0) {
        const cv_block_q8_0 *b = (const cv_block_q8_0 *)src;
        for (size_t i = 0; i < nb; i++) {
            const float d = cv_qh_to_f32(b[i].d);
            for (int j = 0; j < CV_QK; j++) dst[i * CV_QK + j] = d * (float)b[i].qs[j];
        }
    } else if (t == CV_Q4_0) {
        const cv_block_q4_0 *b = (const cv_block_q4_0 *)src;
        for (size_t i = 0; i < nb; i++) {
            const float d = cv_qh_to_f32(b[i].d);
            for (int j = 0; j < CV_QK / 2; j++) {
                dst[i * CV_QK + j] = d * (float)((b[i].qs[j] & 0xf) - 8);
                dst[i * CV_QK + j + CV_QK / 2] = d * (float)((b[i].qs[j] >> 4) - 8);
            }
        }
    } else if (t == CV_Q4_1) {
        const cv_block_q4_1 *b = (const cv_block_q4_1 *)src;
        for (size_t i = 0; i < nb; i++) {
            const float d = cv_qh_to_f32(b[i].d), m = cv_qh_to_f32(b[i].m);
            for (int j = 0; j < CV_QK / 2; j++) {
                dst[i * CV_QK + j] = d * (float)(b[i].qs[j] & 0xf) + m;
                dst[i * CV_QK + j + CV_QK / 2] = d * (float)(b[i].qs[j] >> 4) + m;
            }
        }
    }
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
