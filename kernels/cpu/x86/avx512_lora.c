/* AVX-512 LoRA kernels (lora.c: the shrink dot and the expand of one row). */
#include "../lora.h"
#include "kernels.h"
#include "vec_math.h"

#if CV_HAVE_AVX512
CV_TARGET_AVX512_BEGIN
static inline __m512 load16_avx512(const void *w, int bf16, size_t i, __mmask16 m) {
    if (!bf16) return _mm512_maskz_loadu_ps(m, (const float *)w + i);
    const __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)w + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

float cv_lora_dot_avx512(const float *x, const void *w, int bf16, size_t off, int64_t n) {
    __m512 s = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = cv_tail_mask16(n - i);
        s = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x + i), load16_avx512(w, bf16, off + (size_t)i, m), s);
    }
    return _mm512_reduce_add_ps(s);
}

void cv_lora_expand_avx512(float *y, const float *t, const void *bt, int bf16, int64_t rank, int64_t out,
                          float scale) {
    const __m512 vs = _mm512_set1_ps(scale);
    for (int64_t o = 0; o < out; o += 16) {
        const __mmask16 m = cv_tail_mask16(out - o);
        __m512 acc = _mm512_setzero_ps();
        for (int64_t j = 0; j < rank; j++)
            acc = _mm512_fmadd_ps(_mm512_set1_ps(t[j]), load16_avx512(bt, bf16, (size_t)(j * out + o), m), acc);
        _mm512_mask_storeu_ps(y + o, m, _mm512_fmadd_ps(vs, acc, _mm512_maskz_loadu_ps(m, y + o)));
    }
}
CV_TARGET_END
#endif
