/* Whole-array conversions between every stored dtype and float32: the plain
 * float types through common.c's scalar conversions, the block formats
 * through this header's dequantizers. */
#include "quant_format.h"

#include <string.h>

void cv_convert_to_f32(float *dst, const void *src, cv_dtype st, size_t n) {
    size_t i;
    switch (st) {
    case CV_F32: memcpy(dst, src, n * 4); break;
    case CV_F16: { const uint16_t *s = src; for (i = 0; i < n; i++) dst[i] = cv_f16_to_f32(s[i]); } break;
    case CV_BF16: { const uint16_t *s = src; for (i = 0; i < n; i++) dst[i] = cv_bf16_to_f32(s[i]); } break;
    case CV_F64: { const double *s = src; for (i = 0; i < n; i++) dst[i] = (float)s[i]; } break;
    default:
        if (cv_dtype_is_quant(st)) cv_dequantize(dst, src, st, n);
        else memset(dst, 0, n * 4);
        break;
    }
}

void cv_convert_from_f32(void *dst, cv_dtype dt, const float *src, size_t n) {
    size_t i;
    switch (dt) {
    case CV_F32: memcpy(dst, src, n * 4); break;
    case CV_F16: { uint16_t *d = dst; for (i = 0; i < n; i++) d[i] = cv_f32_to_f16(src[i]); } break;
    case CV_BF16: { uint16_t *d = dst; for (i = 0; i < n; i++) d[i] = cv_f32_to_bf16(src[i]); } break;
    default: break;
    }
}
