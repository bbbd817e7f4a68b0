/* Run-time CPU feature detection (cpuid + xgetbv) and SIMD level choice. */
#include "cpu_features.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define CV_X86 1
#else
#define CV_X86 0
#endif

static cv_cpu_features g_features;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

#if CV_X86
/* XCR0: which register states the OS saves (read only when OSXSAVE is set). */
static unsigned long long read_xcr0(void) {
    unsigned int lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((unsigned long long)hi << 32) | lo;
}
#endif

static void detect(void) {
    cv_cpu_features f;
    memset(&f, 0, sizeof f);
#if CV_X86
    unsigned int a, b, c, d;
    if (__get_cpuid(1, &a, &b, &c, &d)) {
        const int osxsave = (c >> 27) & 1;
        f.fma = (c >> 12) & 1;
        f.f16c = (c >> 29) & 1;
        f.avx = (c >> 28) & 1;
        if (osxsave) {
            const unsigned long long xcr0 = read_xcr0();
            f.os_avx = (xcr0 & 0x6) == 0x6;            /* SSE + YMM */
            f.os_avx512 = f.os_avx && (xcr0 & 0xe0) == 0xe0; /* opmask, ZMM_Hi256, Hi16_ZMM */
        }
    }
    unsigned int max_leaf = __get_cpuid_max(0, NULL);
    if (max_leaf >= 7 && __get_cpuid_count(7, 0, &a, &b, &c, &d)) {
        f.avx2 = (b >> 5) & 1;
        f.avx512f = (b >> 16) & 1;
        f.avx512dq = (b >> 17) & 1;
        f.avx512bw = (b >> 30) & 1;
        f.avx512vl = (b >> 31) & 1;
        f.avx512vnni = (c >> 11) & 1;
        const unsigned int subleaves = a;
        if (subleaves >= 1 && __get_cpuid_count(7, 1, &a, &b, &c, &d)) {
            f.avxvnni = (a >> 4) & 1;
            f.avx512bf16 = (a >> 5) & 1;
        }
    }
    /* a feature whose registers the OS does not save cannot be used */
    if (!f.os_avx) f.avx = f.avx2 = f.fma = f.f16c = f.avxvnni = 0;
    if (!f.os_avx512) f.avx512f = f.avx512bw = f.avx512vl = f.avx512dq = f.avx512bf16 = f.avx512vnni = 0;
#endif
#if defined(CV_EMULATE_AVX512) /* every path runs, on portable intrinsics */
    f.avx = f.avx2 = f.fma = f.f16c = f.os_avx = f.os_avx512 = 1;
    f.avx512f = f.avx512bw = f.avx512vl = f.avx512dq = f.avx512bf16 = f.avx512vnni = 1;
#endif
    g_features = f;
}

const cv_cpu_features *cv_cpu_features_get(void) {
    pthread_once(&g_once, detect);
    return &g_features;
}

int cv_simd_supported(cv_simd_level level) {
    const cv_cpu_features *f = cv_cpu_features_get();
    const int avx2 = f->avx2 && f->fma && f->f16c;
    const int avx512 = avx2 && f->avx512f && f->avx512bw && f->avx512vl && f->avx512dq;
    switch (level) {
    case CV_SIMD_SCALAR: return 1;
    case CV_SIMD_AVX2: return avx2;
    case CV_SIMD_AVX512: return avx512;
    case CV_SIMD_AVX512_BF16: return avx512 && f->avx512bf16;
    }
    return 0;
}

cv_simd_level cv_simd_best(void) {
    for (int l = CV_SIMD_LEVELS - 1; l > 0; l--)
        if (cv_simd_supported((cv_simd_level)l)) return (cv_simd_level)l;
    return CV_SIMD_SCALAR;
}

static const char *const g_names[CV_SIMD_LEVELS] = {"scalar", "avx2", "avx512", "avx512_bf16"};

const char *cv_simd_name(cv_simd_level level) {
    return (unsigned)level < CV_SIMD_LEVELS ? g_names[level] : "unknown";
}

int cv_simd_resolve(const char *name, cv_simd_level *out) {
    *out = cv_simd_best();
    if (!name || !*name) return CV_SIMD_OK;
    for (int l = 0; l < CV_SIMD_LEVELS; l++) {
        if (strcmp(name, g_names[l]) != 0) continue;
        if (!cv_simd_supported((cv_simd_level)l)) return CV_SIMD_UNSUPPORTED;
        *out = (cv_simd_level)l;
        return CV_SIMD_OK;
    }
    return CV_SIMD_UNKNOWN;
}

int cv_simd_from_env(cv_simd_level *out, const char **requested) {
    const char *s = getenv("CONVEYOR_SIMD");
    if (requested) *requested = (s && *s) ? s : NULL;
    if (s && *s) return cv_simd_resolve(s, out);
    const char *fs = getenv("CONVEYOR_FORCE_SCALAR");
    if (fs && fs[0] && strcmp(fs, "0") != 0) {
        *out = CV_SIMD_SCALAR;
        return CV_SIMD_OK;
    }
    *out = cv_simd_best();
    return CV_SIMD_OK;
}
