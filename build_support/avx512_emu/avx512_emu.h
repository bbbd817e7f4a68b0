/* Development only: the x86 intrinsics in portable C, so the AVX-512 and
 * AVX512_BF16 kernels can run (slowly) and be tested on a CPU without them.
 *
 * Built with CONVEYOR_EMULATE_AVX512=1 (setup.py: -DCV_EMULATE_AVX512 -I
 * build_support/avx512_emu; needs SIMDe, Debian package libsimde-dev); see
 * tools/avx512_emulated.sh. SIMDe supplies most intrinsics under their Intel
 * names; the few SIMDe 0.7 lacks are written below, lane by lane, from the
 * Intel definitions. cv_cpu_features then reports every level supported. */
#ifndef CV_AVX512_EMU_H
#define CV_AVX512_EMU_H

#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include <simde/x86/f16c.h>
#include <string.h>

#include "../../base/common.h" /* cv_f16_to_f32, cv_f32_to_f16 */

#define EMU_FN static inline

typedef simde__mmask16 __mmask16;
typedef simde__mmask32 __mmask32;
typedef simde__mmask64 __mmask64;
#ifndef _MM_FROUND_NO_EXC
#define _MM_FROUND_NO_EXC SIMDE_MM_FROUND_NO_EXC
#endif
#ifndef _MM_FROUND_TO_NEAREST_INT
#define _MM_FROUND_TO_NEAREST_INT SIMDE_MM_FROUND_TO_NEAREST_INT
#endif

#define EMU_LANES(T, n, v, arr) \
    T arr[n];                   \
    memcpy(arr, &(v), sizeof arr)
#define EMU_RET(type, arr) \
    do {                   \
        type r_;           \
        memcpy(&r_, arr, sizeof r_); \
        return r_;         \
    } while (0)

EMU_FN __m512 emu_mm512_maskz_loadu_ps(__mmask16 k, const void *p) {
    float o[16];
    for (int i = 0; i < 16; i++) o[i] = (k >> i) & 1 ? ((const float *)p)[i] : 0.0f;
    EMU_RET(__m512, o);
}
EMU_FN void emu_mm512_mask_storeu_ps(void *p, __mmask16 k, __m512 v) {
    EMU_LANES(float, 16, v, a);
    for (int i = 0; i < 16; i++)
        if ((k >> i) & 1) ((float *)p)[i] = a[i];
}
EMU_FN __m256i emu_mm256_maskz_loadu_epi16(__mmask16 k, const void *p) {
    uint16_t o[16];
    for (int i = 0; i < 16; i++) o[i] = (k >> i) & 1 ? ((const uint16_t *)p)[i] : 0;
    EMU_RET(__m256i, o);
}
EMU_FN __m256i emu_mm256_maskz_loadu_epi8(__mmask32 k, const void *p) {
    int8_t o[32];
    for (int i = 0; i < 32; i++) o[i] = (k >> i) & 1 ? ((const int8_t *)p)[i] : 0;
    EMU_RET(__m256i, o);
}
EMU_FN __m512i emu_mm512_maskz_loadu_epi8(__mmask64 k, const void *p) {
    int8_t o[64];
    for (int i = 0; i < 64; i++) o[i] = (k >> i) & 1 ? ((const int8_t *)p)[i] : 0;
    EMU_RET(__m512i, o);
}
EMU_FN __m512i emu_mm512_maskz_loadu_epi16(__mmask32 k, const void *p) {
    uint16_t o[32];
    for (int i = 0; i < 32; i++) o[i] = (k >> i) & 1 ? ((const uint16_t *)p)[i] : 0;
    EMU_RET(__m512i, o);
}
/* bf16 (round to nearest even) of b in words 0..15, of a in 16..31 */
EMU_FN __m512bh emu_mm512_cvtne2ps_pbh(__m512 a, __m512 b) {
    EMU_LANES(float, 16, a, fa);
    EMU_LANES(float, 16, b, fb);
    uint16_t o[32];
    for (int i = 0; i < 16; i++) {
        o[i] = cv_f32_to_bf16(fb[i]);
        o[16 + i] = cv_f32_to_bf16(fa[i]);
    }
    EMU_RET(__m512bh, o);
}
EMU_FN void emu_mm256_mask_storeu_epi16(void *p, __mmask16 k, __m256i v) {
    EMU_LANES(uint16_t, 16, v, a);
    for (int i = 0; i < 16; i++)
        if ((k >> i) & 1) ((uint16_t *)p)[i] = a[i];
}
EMU_FN __m512 emu_mm512_cvtph_ps(__m256i v) {
    EMU_LANES(uint16_t, 16, v, a);
    float o[16];
    for (int i = 0; i < 16; i++) o[i] = cv_f16_to_f32(a[i]);
    EMU_RET(__m512, o);
}
EMU_FN __m256i emu_mm512_cvtps_ph(__m512 v, int rounding) {
    (void)rounding; /* round to nearest even, the only mode the kernels use */
    EMU_LANES(float, 16, v, a);
    uint16_t o[16];
    for (int i = 0; i < 16; i++) o[i] = cv_f32_to_f16(a[i]);
    EMU_RET(__m256i, o);
}
EMU_FN __m512i emu_mm512_cvtepu16_epi32(__m256i v) {
    EMU_LANES(uint16_t, 16, v, a);
    uint32_t o[16];
    for (int i = 0; i < 16; i++) o[i] = a[i];
    EMU_RET(__m512i, o);
}
EMU_FN __m256i emu_mm512_cvtepi32_epi16(__m512i v) {
    EMU_LANES(uint32_t, 16, v, a);
    uint16_t o[16];
    for (int i = 0; i < 16; i++) o[i] = (uint16_t)a[i];
    EMU_RET(__m256i, o);
}
EMU_FN __m512i emu_mm512_cvtps_epi32(__m512 v) {
    EMU_LANES(float, 16, v, a);
    int32_t o[16];
    for (int i = 0; i < 16; i++) o[i] = (int32_t)__builtin_nearbyintf(a[i]);
    EMU_RET(__m512i, o);
}
EMU_FN float emu_mm512_reduce_add_ps(__m512 v) {
    EMU_LANES(float, 16, v, a);
    /* pairwise, as the real sequence of shuffles and adds */
    for (int w = 8; w >= 1; w /= 2)
        for (int i = 0; i < w; i++) a[i] += a[i + w];
    return a[0];
}
EMU_FN float emu_mm512_reduce_max_ps(__m512 v) {
    EMU_LANES(float, 16, v, a);
    float m = a[0];
    for (int i = 1; i < 16; i++) m = a[i] > m ? a[i] : m;
    return m;
}
EMU_FN __m512 emu_mm512_permute_ps(__m512 v, int imm) {
    EMU_LANES(float, 16, v, a);
    float o[16];
    for (int i = 0; i < 16; i++) o[i] = a[(i & ~3) + ((imm >> (2 * (i & 3))) & 3)];
    EMU_RET(__m512, o);
}
EMU_FN int emu_mm512_reduce_add_epi32(__m512i v) {
    EMU_LANES(uint32_t, 16, v, a);
    uint32_t s = 0;
    for (int i = 0; i < 16; i++) s += a[i];
    return (int)s;
}
EMU_FN __m512 emu_mm512_cvtepi32_ps(__m512i v) {
    EMU_LANES(int32_t, 16, v, a);
    float o[16];
    for (int i = 0; i < 16; i++) o[i] = (float)a[i]; /* round to nearest even, as the instruction */
    EMU_RET(__m512, o);
}
EMU_FN __m128i emu_mm512_cvtepi32_epi8(__m512i v) { /* truncating */
    EMU_LANES(uint32_t, 16, v, a);
    uint8_t o[16];
    for (int i = 0; i < 16; i++) o[i] = (uint8_t)a[i];
    EMU_RET(__m128i, o);
}
EMU_FN __m128i emu_mm_maskz_loadu_epi8(__mmask16 k, const void *p) {
    int8_t o[16];
    for (int i = 0; i < 16; i++) o[i] = (k >> i) & 1 ? ((const int8_t *)p)[i] : 0;
    EMU_RET(__m128i, o);
}
EMU_FN __m512i emu_mm512_cvtepi8_epi32(__m128i v) { /* sign-extending */
    EMU_LANES(int8_t, 16, v, a);
    int32_t o[16];
    for (int i = 0; i < 16; i++) o[i] = a[i];
    EMU_RET(__m512i, o);
}
EMU_FN __m512i emu_mm512_maskz_cvtps_epi32(__mmask16 k, __m512 v) {
    EMU_LANES(float, 16, v, a);
    int32_t o[16];
    for (int i = 0; i < 16; i++) o[i] = (k >> i) & 1 ? (int32_t)__builtin_nearbyintf(a[i]) : 0;
    EMU_RET(__m512i, o);
}
EMU_FN void emu_mm_mask_storeu_epi8(void *p, __mmask16 k, __m128i v) {
    EMU_LANES(int8_t, 16, v, a);
    for (int i = 0; i < 16; i++)
        if ((k >> i) & 1) ((int8_t *)p)[i] = a[i];
}
#define _mm512_maskz_cvtps_epi32 emu_mm512_maskz_cvtps_epi32
#define _mm_mask_storeu_epi8 emu_mm_mask_storeu_epi8
#define _mm_maskz_loadu_epi8 emu_mm_maskz_loadu_epi8
#define _mm512_cvtepi8_epi32 emu_mm512_cvtepi8_epi32
#define _mm512_cvtepi32_ps emu_mm512_cvtepi32_ps
#define _mm512_cvtepi32_epi8 emu_mm512_cvtepi32_epi8
#define _mm512_reduce_add_epi32 emu_mm512_reduce_add_epi32
#define _mm512_maskz_loadu_ps emu_mm512_maskz_loadu_ps
#define _mm512_mask_storeu_ps emu_mm512_mask_storeu_ps
#define _mm256_maskz_loadu_epi16 emu_mm256_maskz_loadu_epi16
#define _mm256_mask_storeu_epi16 emu_mm256_mask_storeu_epi16
#define _mm512_maskz_loadu_epi16 emu_mm512_maskz_loadu_epi16
#define _mm256_maskz_loadu_epi8 emu_mm256_maskz_loadu_epi8
#define _mm512_maskz_loadu_epi8 emu_mm512_maskz_loadu_epi8
#define _mm512_cvtne2ps_pbh emu_mm512_cvtne2ps_pbh
#ifndef _mm512_shuffle_f32x4 /* SIMDe 0.7 has it without the alias */
#define _mm512_shuffle_f32x4(a, b, imm8) simde_mm512_shuffle_f32x4(a, b, imm8)
#endif
#define _mm512_cvtph_ps emu_mm512_cvtph_ps
#define _mm512_cvtps_ph emu_mm512_cvtps_ph
#define _mm512_cvtepu16_epi32 emu_mm512_cvtepu16_epi32
#define _mm512_cvtepi32_epi16 emu_mm512_cvtepi32_epi16
#define _mm512_cvtps_epi32 emu_mm512_cvtps_epi32
#define _mm512_reduce_add_ps emu_mm512_reduce_add_ps
#define _mm512_reduce_max_ps emu_mm512_reduce_max_ps
#define _mm512_permute_ps emu_mm512_permute_ps
#undef _mm512_madd_epi16 /* SIMDe 0.7.4's alias takes the wrong arguments */
#define _mm512_madd_epi16(a, b) simde_mm512_madd_epi16(a, b)

#endif
