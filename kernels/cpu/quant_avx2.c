/* The AVX2 quantized micro-kernels (quant.h, quant_tile.h): the block dot is
 * vpmaddubsw (u8 x s8 -> s16 pairs) then vpmaddwd (-> s32), with the sign
 * trick for signed weights (|w| x sign(x, w)); no pair saturates (|w| <= 128,
 * |x| <= 127). Per-function target attributes: this file builds without
 * -mavx2 and runs only where the CPU has AVX2/FMA/F16C (cv_qlevel_supported). */
#include "quant.h"

#if CV_HAVE_AVX2

#define QT_TARGET "avx2,fma,f16c"
#define QT_NAME(name) name##_avx2
#define QT_DOT(a, b) _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1))
#include "quant_tile.h"

int cv_qtiles_avx2(cv_dtype t, cv_qtiles *out) {
    const cv_qtiles *k = qtiles_for_avx2(t);
    if (k) *out = *k;
    return k != NULL;
}

#else
int cv_qtiles_avx2(cv_dtype t, cv_qtiles *out) {
    (void)t;
    (void)out;
    return 0;
}
#endif
