/* What the benchmarks measure the machine by: memory bandwidth (a
 * STREAM-style triad and a read of one array) and the compute peaks of the
 * instructions the kernels use.
 *
 * Compute peaks are measured with register-only loops (no memory traffic):
 * the bounds `conveyor bench roofline` and `bench kernels` divide by, so that
 * a figure is compared with the peak of the very instruction it runs on (a
 * bf16 GEMM on vdpbf16ps with the vdpbf16ps peak, the widened one with the
 * fp32 FMA peak).
 *
 * Every loop keeps PEAK_CHAINS independent dependency chains (enough to cover
 * the latency of two issue ports), each step depending on the chain's last
 * value, so the compiler can neither hoist nor merge the work. Operations are
 * counted as 2 per multiply-add (FLOP for floats, OP for int8). */
#include <stdatomic.h>
#include <string.h>

#include "cpu_internal.h"

#define PEAK_CHAINS 12
#define PEAK_BLOCK 4096 /* iterations between looks at the clock */

typedef int64_t (*peak_loop)(int64_t iters, double *sink); /* returns operations done */

static int64_t fma_plain(int64_t iters, double *sink) {
    float acc[PEAK_CHAINS];
    for (int k = 0; k < PEAK_CHAINS; k++) acc[k] = 1.0f + 0.001f * (float)k;
    for (int64_t it = 0; it < iters; it++)
        for (int k = 0; k < PEAK_CHAINS; k++) acc[k] = acc[k] * 0.999999f + 1e-7f;
    double s = 0;
    for (int k = 0; k < PEAK_CHAINS; k++) s += acc[k];
    *sink += s;
    return iters * PEAK_CHAINS * 2;
}

static int64_t int8_plain(int64_t iters, double *sink) {
    uint32_t acc[PEAK_CHAINS];
    for (int k = 0; k < PEAK_CHAINS; k++) acc[k] = (uint32_t)k;
    for (int64_t it = 0; it < iters; it++)
        for (int k = 0; k < PEAK_CHAINS; k++) acc[k] += (uint32_t)(uint8_t)acc[k] * 5u;
    uint32_t s = 0;
    for (int k = 0; k < PEAK_CHAINS; k++) s ^= acc[k];
    *sink += s;
    return iters * PEAK_CHAINS * 2;
}

#if CV_HAVE_AVX2
CV_TARGET_AVX2_BEGIN
static int64_t fma_avx2(int64_t iters, double *sink) {
    __m256 acc[PEAK_CHAINS];
    const __m256 m = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-7f);
    for (int k = 0; k < PEAK_CHAINS; k++) acc[k] = _mm256_set1_ps(1.0f + 0.001f * (float)k);
    for (int64_t it = 0; it < iters; it++)
#pragma GCC unroll 12
        for (int k = 0; k < PEAK_CHAINS; k++) acc[k] = _mm256_fmadd_ps(acc[k], m, c);
    for (int k = 1; k < PEAK_CHAINS; k++) acc[0] = _mm256_add_ps(acc[0], acc[k]);
    float o[8];
    _mm256_storeu_ps(o, acc[0]);
    *sink += o[0];
    return iters * PEAK_CHAINS * 8 * 2;
}

/* u8 x s8 products summed into int32 the AVX2 way: vpmaddubsw (pairs to
 * int16), vpmaddwd by ones (to int32), vpaddd; 32 multiply-adds a step. */
static int64_t int8_avx2(int64_t iters, double *sink) {
    __m256i acc[PEAK_CHAINS];
    const __m256i w = _mm256_set1_epi8(5), ones = _mm256_set1_epi16(1);
    for (int k = 0; k < PEAK_CHAINS; k++) acc[k] = _mm256_set1_epi32(k);
    for (int64_t it = 0; it < iters; it++)
#pragma GCC unroll 12
        for (int k = 0; k < PEAK_CHAINS; k++)
            acc[k] = _mm256_add_epi32(acc[k], _mm256_madd_epi16(_mm256_maddubs_epi16(acc[k], w), ones));
    for (int k = 1; k < PEAK_CHAINS; k++) acc[0] = _mm256_xor_si256(acc[0], acc[k]);
    *sink += (double)_mm256_extract_epi32(acc[0], 0);
    return iters * PEAK_CHAINS * 32 * 2;
}
CV_TARGET_END

#ifndef CV_EMULATE_AVX512
CV_TARGET_BEGIN("avx2,fma,avxvnni")
static int64_t int8_avxvnni(int64_t iters, double *sink) {
    __m256i acc[PEAK_CHAINS];
    const __m256i a = _mm256_set1_epi8(3), w = _mm256_set1_epi8(5);
    for (int k = 0; k < PEAK_CHAINS; k++) acc[k] = _mm256_set1_epi32(k);
    for (int64_t it = 0; it < iters; it++)
#pragma GCC unroll 12
        for (int k = 0; k < PEAK_CHAINS; k++) acc[k] = _mm256_dpbusd_avx_epi32(acc[k], a, w);
    for (int k = 1; k < PEAK_CHAINS; k++) acc[0] = _mm256_xor_si256(acc[0], acc[k]);
    *sink += (double)_mm256_extract_epi32(acc[0], 0);
    return iters * PEAK_CHAINS * 32 * 2;
}
CV_TARGET_END
#endif
#endif

#if CV_HAVE_AVX512
CV_TARGET_AVX512_BEGIN
static int64_t fma_avx512(int64_t iters, double *sink) {
    __m512 acc[PEAK_CHAINS];
    const __m512 m = _mm512_set1_ps(0.999999f), c = _mm512_set1_ps(1e-7f);
    for (int k = 0; k < PEAK_CHAINS; k++) acc[k] = _mm512_set1_ps(1.0f + 0.001f * (float)k);
    for (int64_t it = 0; it < iters; it++)
#pragma GCC unroll 12
        for (int k = 0; k < PEAK_CHAINS; k++) acc[k] = _mm512_fmadd_ps(acc[k], m, c);
    for (int k = 1; k < PEAK_CHAINS; k++) acc[0] = _mm512_add_ps(acc[0], acc[k]);
    *sink += _mm512_reduce_add_ps(acc[0]);
    return iters * PEAK_CHAINS * 16 * 2;
}

static int64_t int8_avx512(int64_t iters, double *sink) {
    __m512i acc[PEAK_CHAINS];
    const __m512i w = _mm512_set1_epi8(5), ones = _mm512_set1_epi16(1);
    for (int k = 0; k < PEAK_CHAINS; k++) acc[k] = _mm512_set1_epi32(k);
    for (int64_t it = 0; it < iters; it++)
#pragma GCC unroll 12
        for (int k = 0; k < PEAK_CHAINS; k++)
            acc[k] = _mm512_add_epi32(acc[k], _mm512_madd_epi16(_mm512_maddubs_epi16(acc[k], w), ones));
    for (int k = 1; k < PEAK_CHAINS; k++) acc[0] = _mm512_xor_si512(acc[0], acc[k]);
    *sink += (double)_mm512_reduce_add_epi32(acc[0]);
    return iters * PEAK_CHAINS * 64 * 2;
}
CV_TARGET_END

CV_TARGET_BEGIN(CV_TARGET_AVX512 ",avx512vnni")
static int64_t int8_avx512vnni(int64_t iters, double *sink) {
    __m512i acc[PEAK_CHAINS];
    const __m512i a = _mm512_set1_epi8(3), w = _mm512_set1_epi8(5);
    for (int k = 0; k < PEAK_CHAINS; k++) acc[k] = _mm512_set1_epi32(k);
    for (int64_t it = 0; it < iters; it++)
#pragma GCC unroll 12
        for (int k = 0; k < PEAK_CHAINS; k++) acc[k] = _mm512_dpbusd_epi32(acc[k], a, w);
    for (int k = 1; k < PEAK_CHAINS; k++) acc[0] = _mm512_xor_si512(acc[0], acc[k]);
    *sink += (double)_mm512_reduce_add_epi32(acc[0]);
    return iters * PEAK_CHAINS * 64 * 2;
}
CV_TARGET_END

CV_TARGET_AVX512_BF16_BEGIN
static int64_t bf16_avx512(int64_t iters, double *sink) {
    __m512 acc[PEAK_CHAINS];
    __m512bh a, w;
    const __m512i av = _mm512_set1_epi32(0x3f803f80), wv = _mm512_set1_epi32(0x3c003c00); /* 1.0, ~0.0078 */
    memcpy(&a, &av, sizeof a);
    memcpy(&w, &wv, sizeof w);
    for (int k = 0; k < PEAK_CHAINS; k++) acc[k] = _mm512_set1_ps(0.001f * (float)k);
    for (int64_t it = 0; it < iters; it++)
#pragma GCC unroll 12
        for (int k = 0; k < PEAK_CHAINS; k++) acc[k] = _mm512_dpbf16_ps(acc[k], a, w);
    for (int k = 1; k < PEAK_CHAINS; k++) acc[0] = _mm512_add_ps(acc[0], acc[k]);
    *sink += _mm512_reduce_add_ps(acc[0]);
    return iters * PEAK_CHAINS * 32 * 2;
}
CV_TARGET_END
#endif

/* The loop (and its instruction's name) the backend's kernels use for kind. */
static peak_loop choose(const cv_cpu *c, cv_peak_kind kind, const char **instr) {
    const cv_cpu_features *f = cv_cpu_features_get();
    const int lv = c->simd;
    (void)f;
#if CV_HAVE_AVX512
    if (kind == CV_PEAK_BF16_DOT && lv >= CV_SIMD_AVX512_BF16) {
        *instr = "vdpbf16ps zmm";
        return bf16_avx512;
    }
    if (kind == CV_PEAK_INT8_DOT && lv >= CV_SIMD_AVX512 && f->avx512vnni) {
        *instr = "vpdpbusd zmm (AVX512-VNNI)";
        return int8_avx512vnni;
    }
#endif
#if CV_HAVE_AVX2 && !defined(CV_EMULATE_AVX512)
    if (kind == CV_PEAK_INT8_DOT && lv >= CV_SIMD_AVX2 && f->avxvnni) {
        *instr = "vpdpbusd ymm (AVX-VNNI)";
        return int8_avxvnni;
    }
#endif
#if CV_HAVE_AVX512
    if (kind == CV_PEAK_INT8_DOT && lv >= CV_SIMD_AVX512) {
        *instr = "vpmaddubsw+vpmaddwd+vpaddd zmm";
        return int8_avx512;
    }
    if (lv >= CV_SIMD_AVX512 && kind != CV_PEAK_INT8_DOT) {
        *instr = kind == CV_PEAK_BF16_DOT ? "vfmadd231ps zmm (bf16 widened to fp32)" : "vfmadd231ps zmm";
        return fma_avx512;
    }
#endif
#if CV_HAVE_AVX2
    if (kind == CV_PEAK_INT8_DOT && lv >= CV_SIMD_AVX2) {
        *instr = "vpmaddubsw+vpmaddwd+vpaddd ymm";
        return int8_avx2;
    }
    if (lv >= CV_SIMD_AVX2) {
        *instr = kind == CV_PEAK_BF16_DOT ? "vfmadd231ps ymm (bf16 widened to fp32)" : "vfmadd231ps ymm";
        return fma_avx2;
    }
#endif
    if (kind == CV_PEAK_INT8_DOT) {
        *instr = "plain C integer multiply-add";
        return int8_plain;
    }
    *instr = kind == CV_PEAK_BF16_DOT ? "plain C float multiply-add (bf16 widened)" : "plain C float multiply-add";
    return fma_plain;
}

typedef struct peak_job {
    peak_loop loop;
    double seconds;
    int64_t ops[256];
    double elapsed[256];
    double sink[256];
} peak_job;

static void peak_fn(void *arg, int tid, int nth) {
    peak_job *j = arg;
    (void)nth;
    double sink = 0;
    (void)j->loop(PEAK_BLOCK / 16, &sink); /* warm-up (powers up the wide units), not counted */
    int64_t ops = 0;
    const double start = cv_now();
    double t;
    do {
        ops += j->loop(PEAK_BLOCK, &sink);
        t = cv_now();
    } while (t - start < j->seconds);
    j->ops[tid] = ops;
    j->elapsed[tid] = t - start;
    j->sink[tid] = sink; /* keeps the results alive */
}

double cv_cpu_measure_peak(cv_backend *b, cv_peak_kind kind, int nth, double seconds, const char **instr) {
    cv_cpu *c = cv_cpu_of(b);
    const char *name = "";
    if (instr) *instr = name;
    if (kind < CV_PEAK_FP32_FMA || kind > CV_PEAK_INT8_DOT || seconds <= 0) return -1.0;
    if (nth <= 0 || nth > c->nthreads) nth = c->nthreads;
    if (nth > 256) nth = 256;
    peak_job j;
    memset(&j, 0, sizeof j);
    j.loop = choose(c, kind, &name);
    j.seconds = seconds;
    cv_pool_run(c->pool, nth, peak_fn, &j);
    double ops = 0, longest = 0;
    for (int t = 0; t < nth; t++) {
        ops += (double)j.ops[t];
        if (j.elapsed[t] > longest) longest = j.elapsed[t];
    }
    if (instr) *instr = name;
    return longest > 0 ? ops / longest * 1e-9 : -1.0;
}

/* ------------------------------------------------------------------------ */
/* Memory bandwidth                                                      */

typedef struct triad_job {
    float *a, *b, *c; /* [n] each */
    size_t n;
    int mode;         /* 0: first touch, 1: triad, 2: read only */
    atomic_ullong sink; /* keeps the read-only sums alive */
} triad_job;

static void triad_fn(void *arg, int tid, int nth) {
    triad_job *j = arg;
    const size_t i0 = j->n * (size_t)tid / (size_t)nth, i1 = j->n * (size_t)(tid + 1) / (size_t)nth;
    float *restrict a = j->a;
    const float *restrict bb = j->b;
    const float *restrict cc = j->c;
    if (j->mode == 0) { /* first touch by the thread that will stream the range */
        for (size_t i = i0; i < i1; i++) {
            j->a[i] = 0.0f;
            j->b[i] = 1.0f;
            j->c[i] = 2.0f;
        }
    } else if (j->mode == 1) {
        for (size_t i = i0; i < i1; i++) a[i] = bb[i] + 3.0f * cc[i];
    } else {
        /* integer words: a reduction the compiler may vectorize */
        const uint64_t *w = (const uint64_t *)(const void *)(bb + (i0 & ~(size_t)1));
        const size_t nw = (i1 - (i0 & ~(size_t)1)) / 2;
        uint64_t s = 0;
        for (size_t i = 0; i < nw; i++) s += w[i];
        atomic_fetch_xor(&j->sink, s);
    }
}

/* Best GB/s over repeats of a triad (mode 1: 3 arrays of n_bytes counted) or
 * a read of one array (mode 2). */
static double bandwidth(cv_backend *b, size_t n_bytes, int repeats, int mode) {
    cv_cpu *c = cv_cpu_of(b);
    const size_t n = n_bytes / sizeof(float) & ~(size_t)1;
    if (n == 0 || repeats <= 0) return -1.0;
    triad_job j = {.n = n, .mode = 0};
    atomic_init(&j.sink, 0);
    j.a = b->alloc(b, n * sizeof(float));
    j.b = b->alloc(b, n * sizeof(float));
    j.c = b->alloc(b, n * sizeof(float));
    double best = -1.0;
    if (j.a && j.b && j.c) {
        cv_pool_run(c->pool, c->nthreads, triad_fn, &j);
        j.mode = mode;
        for (int r = 0; r < repeats; r++) {
            const double t0 = cv_now();
            cv_pool_run(c->pool, c->nthreads, triad_fn, &j);
            const double dt = cv_now() - t0;
            if (dt > 0 && (best < 0 || dt < best)) best = dt;
        }
    }
    b->free(b, j.a);
    b->free(b, j.b);
    b->free(b, j.c);
    if (best <= 0) return -1.0;
    return (mode == 1 ? 3.0 : 1.0) * (double)(n * sizeof(float)) / best * 1e-9;
}

double cv_cpu_triad(cv_backend *b, size_t n_bytes, int repeats) { return bandwidth(b, n_bytes, repeats, 1); }

double cv_cpu_read_bw(cv_backend *b, size_t n_bytes, int repeats) { return bandwidth(b, n_bytes, repeats, 2); }
