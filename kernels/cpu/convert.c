/* Float dtype conversions of the CPU kernels (a shared piece: it calls nothing
 * above it): widening float16/bfloat16 rows to float32, narrowing float32 into
 * them (round to nearest even), and the check of which float dtypes a prepared
 * matrix or table may be stored in. */
#include <string.h>

#include "cpu_internal.h"

void cv_cpu_widen(float *dst, const void *src, cv_dtype dt, int64_t n, const cv_cpu_kernels *k) {
    int64_t i = 0;
    if (dt == CV_F32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
        return;
    }
    const uint16_t *s = src; /* [n] */
    if (k && k->widen_part) i = k->widen_part(dst, s, dt, n);
    if (dt == CV_BF16)
        for (; i < n; i++) dst[i] = cv_bf16_to_f32(s[i]);
    else
        for (; i < n; i++) dst[i] = cv_f16_to_f32(s[i]);
}

void cv_cpu_narrow(void *dst, cv_dtype dt, const float *src, int64_t n, const cv_cpu_kernels *k) {
    int64_t i = 0;
    if (dt == CV_F32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
        return;
    }
    uint16_t *d = dst; /* [n] */
    if (k && k->narrow_part) i = k->narrow_part(d, dt, src, n);
    if (dt == CV_BF16)
        for (; i < n; i++) d[i] = cv_f32_to_bf16(src[i]);
    else
        for (; i < n; i++) d[i] = cv_f32_to_f16(src[i]);
}

int cv_cpu_check_prepare(const char *what, const char *noun, const void *src, cv_dtype src_dtype,
                         int64_t rows, int64_t cols, cv_dtype dtype, cv_err *err) {
    if (!src || rows <= 0 || cols <= 0)
        return cv_set_err(err, CV_ERR_INVALID, "%s: bad shape [%lld][%lld] or NULL source", what,
                          (long long)rows, (long long)cols);
    if (src_dtype != CV_F32 && src_dtype != CV_F16 && src_dtype != CV_BF16 && src_dtype != CV_F64)
        return cv_set_err(err, CV_ERR_TYPE, "%s: source dtype %s is not a float type", what,
                          cv_dtype_name(src_dtype));
    if (dtype != CV_F32 && dtype != CV_F16 && dtype != CV_BF16)
        return cv_set_err(err, CV_ERR_UNSUPPORTED, "%s: %s %s (want float32, float16 or bfloat16)", what,
                          noun, cv_dtype_name(dtype));
    return CV_OK;
}
