/* Small vector helpers every CPU kernel file may use (a shared piece: it calls
 * nothing above it): lane masks, horizontal sums, exp. */
#ifndef CV_VEC_MATH_H
#define CV_VEC_MATH_H

#include "cpu_internal.h"

#if CV_HAVE_AVX2
CV_TARGET_AVX2_BEGIN
/* exp(x) for 8 lanes (relative error ~2 ulp; -inf gives 0). */
__m256 cv_exp256(__m256 x);

static inline float cv_hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
CV_TARGET_END
#endif

#if CV_HAVE_AVX512
CV_TARGET_AVX512_BEGIN
/* exp(x) for 16 lanes, as cv_exp256. */
__m512 cv_exp512(__m512 x);

/* The first min(left, 16) lanes. */
static CV_ALWAYS_INLINE __mmask16 cv_tail_mask16(int64_t left) {
    return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u);
}
CV_TARGET_END
#endif

#endif
