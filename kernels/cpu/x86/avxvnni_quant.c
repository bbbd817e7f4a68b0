/* The VNNI quantized micro-kernels (quant_ukr.h, quant_tile.h): the block dot is
 * vpdpbusd (u8 x s8, four products summed into each s32 lane, the same lanes
 * as the AVX2 dot) on ymm registers, once with the EVEX encoding (AVX512-VNNI
 * + VL) and once with the VEX one (AVX-VNNI, e.g. Alder Lake). Built with
 * per-function target attributes; chosen at run time only where the CPU has
 * them. Under tools/avx512_emulated.sh both run on portable intrinsics. */
#include "../quant_ukr.h"

#if CV_HAVE_AVX2 && (defined(CV_EMULATE_AVX512) || (defined(__GNUC__) && (__GNUC__ >= 11 || \
    (defined(__clang_major__) && __clang_major__ >= 12))))

#define QT_TARGET "avx2,fma,f16c,avx512f,avx512vl,avx512vnni"
#define QT_NAME(name) name##_evex
#define QT_DOT(a, b) _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, b)
#include "quant_tile.h"
#undef QT_TARGET
#undef QT_NAME
#undef QT_DOT

#define QT_TARGET "avx2,fma,f16c,avxvnni"
#define QT_NAME(name) name##_vex
#ifdef CV_EMULATE_AVX512 /* the same instruction, VEX-encoded */
#define QT_DOT(a, b) _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, b)
#else
#define QT_DOT(a, b) _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), a, b)
#endif
#include "quant_tile.h"

int cv_qtiles_vnni(cv_dtype t, int avx512, cv_qtiles *out) {
    const cv_qtiles *k = avx512 ? qtiles_for_evex(t) : qtiles_for_vex(t);
    if (k) *out = *k;
    return k != NULL;
}

#else
int cv_qtiles_vnni(cv_dtype t, int avx512, cv_qtiles *out) {
    (void)t;
    (void)avx512;
    (void)out;
    return 0;
}
#endif
