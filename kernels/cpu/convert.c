/* Float dtype conversions of the CPU kernels (a shared piece: it calls nothing
 * above it): widening float16/bfloat16 rows to float32, narrowing float32 into
 * them (round to nearest even), and the check of which float dtypes a prepared
 * matrix or table may be stored in. */
#include <string.h>

#include "cpu_internal.h"
#include "vec_math.h"

#if CV_HAVE_AVX512
CV_TARGET_AVX512_BEGIN
static void widen_avx512(float *dst, const uint16_t *s, cv_dtype dt, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = cv_tail_mask16(n - i);
        const __m256i h = _mm256_maskz_loadu_epi16(m, s + i);
        const __m512 v = dt == CV_BF16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
                                       : _mm512_cvtph_ps(h);
        _mm512_mask_storeu_ps(dst + i, m, v);
    }
}

/* Round-to-nearest-even float32 -> bfloat16 of 16 lanes (NaN stays a quiet
 * NaN), as f32_to_bf16_8 and cv_f32_to_bf16. */
static CV_ALWAYS_INLINE __m256i f32_to_bf16_16(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
    const __m512i nan = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), nan);
    return _mm512_cvtepi32_epi16(r); /* keeps the low 16 bits of each lane */
}

static void narrow_avx512(uint16_t *d, cv_dtype dt, const float *src, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = cv_tail_mask16(n - i);
        const __m512 v = _mm512_maskz_loadu_ps(m, src + i);
        const __m256i h = dt == CV_BF16 ? f32_to_bf16_16(v) : _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT);
        _mm256_mask_storeu_epi16(d + i, m, h);
    }
}
CV_TARGET_END
#endif

#if CV_HAVE_AVX2
CV_TARGET_AVX2_BEGIN
/* The 8-wide part of cv_cpu_widen from a 16-bit dtype; returns the count done. */
static int64_t widen_avx2(float *dst, const uint16_t *s, cv_dtype dt, int64_t n) {
    int64_t i = 0;
    if (dt == CV_BF16) {
        for (; i + 8 <= n; i += 8) {
            __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(s + i)));
            _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
        }
    } else {
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i))));
    }
    return i;
}
CV_TARGET_END
#endif

void cv_cpu_widen(float *dst, const void *src, cv_dtype dt, int64_t n, int simd) {
    int64_t i = 0;
    if (dt == CV_F32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
        return;
    }
    const uint16_t *s = src; /* [n] */
#if CV_HAVE_AVX2
    if (simd >= CV_SIMD_AVX512) {
        widen_avx512(dst, s, dt, n);
        return;
    }
    if (simd >= CV_SIMD_AVX2) i = widen_avx2(dst, s, dt, n);
#else
    (void)simd;
#endif
    if (dt == CV_BF16)
        for (; i < n; i++) dst[i] = cv_bf16_to_f32(s[i]);
    else
        for (; i < n; i++) dst[i] = cv_f16_to_f32(s[i]);
}

#if CV_HAVE_AVX2
CV_TARGET_AVX2_BEGIN
/* Round-to-nearest-even float32 -> bfloat16 of 8 lanes (NaN stays a quiet NaN). */
static inline __m128i f32_to_bf16_8(__m256 x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
    r = _mm256_srli_epi32(r, 16);
    const __m256i nan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    const __m256 isnan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    r = _mm256_castps_si256(
        _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(nan), isnan));
    r = _mm256_and_si256(r, _mm256_set1_epi32(0xffff));
    const __m256i packed = _mm256_packus_epi32(r, _mm256_setzero_si256());
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

/* The 8-wide part of cv_cpu_narrow into a 16-bit dtype; returns the count done. */
static int64_t narrow_avx2(uint16_t *d, cv_dtype dt, const float *src, int64_t n) {
    int64_t i = 0;
    if (dt == CV_BF16) {
        for (; i + 8 <= n; i += 8)
            _mm_storeu_si128((__m128i *)(d + i), f32_to_bf16_8(_mm256_loadu_ps(src + i)));
    } else {
        for (; i + 8 <= n; i += 8)
            _mm_storeu_si128((__m128i *)(d + i),
                             _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    }
    return i;
}
CV_TARGET_END
#endif

void cv_cpu_narrow(void *dst, cv_dtype dt, const float *src, int64_t n, int simd) {
    int64_t i = 0;
    if (dt == CV_F32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
        return;
    }
    uint16_t *d = dst; /* [n] */
#if CV_HAVE_AVX2
    if (simd >= CV_SIMD_AVX512) {
        narrow_avx512(d, dt, src, n);
        return;
    }
    if (simd >= CV_SIMD_AVX2) i = narrow_avx2(d, dt, src, n);
#else
    (void)simd;
#endif
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
