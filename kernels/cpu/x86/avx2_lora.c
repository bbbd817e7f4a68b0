/* AVX2 LoRA kernels (lora.c: the shrink dot and the expand of one row). */
#include "../lora.h"
#include "kernels.h"
#include "vec_math.h"

#if CV_HAVE_AVX2
CV_TARGET_AVX2_BEGIN
static inline __m256 load8_avx2(const void *w, int bf16, size_t i) {
    if (!bf16) return _mm256_loadu_ps((const float *)w + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

float cv_lora_dot_avx2(const float *x, const void *w, int bf16, size_t off, int64_t n) {
    __m256 s = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) s = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), load8_avx2(w, bf16, off + (size_t)i), s);
    float r = cv_hsum256(s);
    for (; i < n; i++) r += x[i] * cv_lora_w_at(w, bf16, off + (size_t)i);
    return r;
}

void cv_lora_expand_avx2(float *y, const float *t, const void *bt, int bf16, int64_t rank, int64_t out, float scale) {
    const __m256 vs = _mm256_set1_ps(scale);
    int64_t o = 0;
    for (; o + 8 <= out; o += 8) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t j = 0; j < rank; j++)
            acc = _mm256_fmadd_ps(_mm256_set1_ps(t[j]), load8_avx2(bt, bf16, (size_t)(j * out + o)), acc);
        _mm256_storeu_ps(y + o, _mm256_fmadd_ps(vs, acc, _mm256_loadu_ps(y + o)));
    }
    for (; o < out; o++) { /* the tail as the plain code computes it */
        float acc = 0.0f;
        for (int64_t j = 0; j < rank; j++) acc += t[j] * cv_lora_w_at(bt, bf16, (size_t)(j * out + o));
        y[o] += scale * acc;
    }
}
CV_TARGET_END
#endif
