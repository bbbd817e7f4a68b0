/* CPU features read at run time, and the SIMD level each kernel family runs at.
 *
 * conveyor._core is built without -march (every SIMD path is compiled with
 * per-function target attributes), so the kernels choose their path here, at
 * run time: the best level this CPU (and its OS: the register state must be
 * enabled in XCR0) supports, or the one CONVEYOR_SIMD asks for.
 *
 * Stable API (other kernel files, e.g. the quantized ones, use it too):
 *   cv_cpu_features_get()   the flags, detected once (thread-safe)
 *   cv_simd_best()          the best level the machine supports
 *   cv_simd_resolve(name)   a level by name ("scalar", "avx2", "avx512",
 *                           "avx512_bf16"; NULL/"" = best), checked against the CPU
 *   cv_simd_from_env()      what CONVEYOR_SIMD / CONVEYOR_FORCE_SCALAR ask for
 *   CV_TARGET_*_BEGIN/END   bracket the functions of one SIMD path in a file
 * This header does not depend on the rest of the project. */
#ifndef CV_CPU_FEATURES_H
#define CV_CPU_FEATURES_H

#include <stddef.h>

/* Ordered: a level includes everything below it. */
typedef enum cv_simd_level {
    CV_SIMD_SCALAR = 0,      /* plain C */
    CV_SIMD_AVX2 = 1,        /* AVX2 + FMA + F16C */
    CV_SIMD_AVX512 = 2,      /* AVX2 level + AVX-512 F/BW/VL/DQ */
    CV_SIMD_AVX512_BF16 = 3, /* AVX512 level + AVX512_BF16 (vdpbf16ps) */
} cv_simd_level;
#define CV_SIMD_LEVELS 4

typedef struct cv_cpu_features {
    int avx, avx2, fma, f16c;
    int avx512f, avx512bw, avx512vl, avx512dq;
    int avx512bf16;   /* vdpbf16ps, vcvtne2ps2bf16 */
    int avx512vnni;   /* vpdpbusd on zmm/ymm/xmm (EVEX) */
    int avxvnni;      /* vpdpbusd on ymm/xmm (VEX, e.g. Alder Lake) */
    int os_avx;       /* XCR0 enables the YMM state */
    int os_avx512;    /* XCR0 enables the opmask and ZMM state */
} cv_cpu_features;

/* Detected on first call; the same pointer every time. */
const cv_cpu_features *cv_cpu_features_get(void);

/* Best level this CPU supports. */
cv_simd_level cv_simd_best(void);
/* 1 when this CPU supports level. */
int cv_simd_supported(cv_simd_level level);
/* "scalar", "avx2", "avx512", "avx512_bf16". */
const char *cv_simd_name(cv_simd_level level);

#define CV_SIMD_OK 0
#define CV_SIMD_UNKNOWN (-1)     /* not a level name */
#define CV_SIMD_UNSUPPORTED (-2) /* a level this CPU lacks */

/* The level named by name (NULL or "": best). Returns CV_SIMD_OK, or one of
 * the codes above (*out is then the best level). */
int cv_simd_resolve(const char *name, cv_simd_level *out);
/* The level the environment asks for: CONVEYOR_SIMD (a level name), else
 * CONVEYOR_FORCE_SCALAR=1 (scalar), else the best. Return codes as
 * cv_simd_resolve; *requested is CONVEYOR_SIMD's value (NULL when unset). */
int cv_simd_from_env(cv_simd_level *out, const char **requested);

/* Brackets for the functions of one SIMD path (both GCC and clang): every
 * function defined between BEGIN and END is compiled for that target. */
#if defined(CV_EMULATE_AVX512) /* portable intrinsics: no target needed */
#define CV_TARGET_BEGIN(t)
#define CV_TARGET_END
#elif defined(__clang__)
#define CV_PRAGMA(x) _Pragma(#x)
#define CV_TARGET_BEGIN(t) CV_PRAGMA(clang attribute push(__attribute__((target(t))), apply_to = function))
#define CV_TARGET_END CV_PRAGMA(clang attribute pop)
#elif defined(__GNUC__)
#define CV_PRAGMA(x) _Pragma(#x)
#define CV_TARGET_BEGIN(t) CV_PRAGMA(GCC push_options) CV_PRAGMA(GCC target(t))
#define CV_TARGET_END CV_PRAGMA(GCC pop_options)
#endif
#define CV_TARGET_AVX2 "avx2,fma,f16c"
#define CV_TARGET_AVX512 "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq"
#define CV_TARGET_AVX512_BF16 "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16"
#define CV_TARGET_AVX2_BEGIN CV_TARGET_BEGIN("avx2,fma,f16c")
#define CV_TARGET_AVX512_BEGIN CV_TARGET_BEGIN("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")
#define CV_TARGET_AVX512_BF16_BEGIN \
    CV_TARGET_BEGIN("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")

#endif
