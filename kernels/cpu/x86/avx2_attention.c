/* AVX2 chunk kernels of paged attention (contract: x86/kernels.h): register
 * blocks of up to 4 query vectors x 4 keys for the scores, x 32 dims for P.V;
 * every vector's sums run in an order fixed by head_dim alone. */
#include <math.h>
#include <string.h>

#include "kernels.h"
#include "vec_math.h"

/* One value of a K or V row as float32 (int8: the stored integer). */
static inline float kv_get(const void *p, cv_dtype dt, int64_t i) {
    if (dt == CV_F32) return ((const float *)p)[i];
    if (dt == CV_I8) return (float)((const int8_t *)p)[i];
    if (dt == CV_F16) return cv_f16_to_f32(((const uint16_t *)p)[i]);
    return cv_bf16_to_f32(((const uint16_t *)p)[i]);
}

#if CV_HAVE_AVX2
CV_TARGET_AVX2_BEGIN
static CV_ALWAYS_INLINE __m256 kv_load8(const void *p, cv_dtype dt, int64_t d) {
    if (dt == CV_F32) return _mm256_loadu_ps((const float *)p + d);
    if (dt == CV_I8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)p + d))));
    if (dt == CV_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + d)));
    const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + d)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

/* The four horizontal sums of a, b, c, d. */
static inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

/* Vector groups of the chunk kernels: groups of 4 when nv is a multiple of
 * 4, else groups of 3 (a tile of t tokens x 3 heads splits evenly), then the
 * rest. Returns the size of the group starting at v0. */
static inline int group_size(int nv, int v0) {
    const int g = (nv % 4 == 0) ? 4 : 3;
    return nv - v0 < g ? nv - v0 : g;
}

/* Keeps v in a register: stops the compiler from folding a reused load into
 * every FMA (which would cost a load per FMA). */
#ifdef CV_EMULATE_AVX512
#define CV_KEEP(v) ((void)0)
#else
#define CV_KEEP(v) __asm__("" : "+x"(v))
#endif

/* Scores of NV (<= 4) vectors against NK (<= 4) keys starting at key i0: a
 * register block of NV x NK dot products (NV * NK <= 12 accumulators), each
 * key row loaded once per 8 dims for all NV vectors, each query once for
 * all NK keys. */
static CV_ALWAYS_INLINE void scores_blk(float *sc, const float *qt, int64_t hd, const int NV,
                                        const int NK, int i0, const void *const *kp,
                                        const cv_dtype dt) {
    __m256 a[16];
#pragma GCC unroll 16
    for (int x = 0; x < NV * NK; x++) a[x] = _mm256_setzero_ps();
    const int64_t hd8 = hd & ~(int64_t)7;
    /* Sixteen registers: the NV x NK accumulators, then either the NK key
     * slices and one query or the NV queries and one key, whichever fits (a
     * spilled accumulator puts a store-to-load round trip into its FMA chain).
     * Each accumulator sees the same FMAs in the same order either way. */
    const int keys_held = NV * NK + NK + 1 <= 16;
    for (int64_t d = 0; d < hd8; d += 8) {
        if (keys_held) {
            __m256 kv[4];
#pragma GCC unroll 4
            for (int k = 0; k < NK; k++) {
                kv[k] = kv_load8(kp[i0 + k], dt, d);
                if (NV > 1) CV_KEEP(kv[k]);
            }
#pragma GCC unroll 4
            for (int v = 0; v < NV; v++) {
                __m256 q = _mm256_loadu_ps(qt + v * hd + d);
                if (NK > 1) CV_KEEP(q);
#pragma GCC unroll 4
                for (int k = 0; k < NK; k++) a[v * NK + k] = _mm256_fmadd_ps(q, kv[k], a[v * NK + k]);
            }
        } else {
            __m256 q[4];
#pragma GCC unroll 4
            for (int v = 0; v < NV; v++) {
                q[v] = _mm256_loadu_ps(qt + v * hd + d);
                CV_KEEP(q[v]);
            }
#pragma GCC unroll 4
            for (int k = 0; k < NK; k++) {
                const __m256 kk = kv_load8(kp[i0 + k], dt, d);
#pragma GCC unroll 4
                for (int v = 0; v < NV; v++) a[v * NK + k] = _mm256_fmadd_ps(q[v], kk, a[v * NK + k]);
            }
        }
    }
    if (NK == 4 && hd8 == hd) { /* a vector's four scores are one register's sums */
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++)
            _mm_storeu_ps(sc + v * CV_ATT_KCHUNK + i0, hsum4(a[4 * v], a[4 * v + 1], a[4 * v + 2], a[4 * v + 3]));
        return;
    }
    float r[16];
    const __m256 z = _mm256_setzero_ps();
#pragma GCC unroll 4
    for (int x = 0; x < NV * NK; x += 4)
        _mm_storeu_ps(r + x, hsum4(a[x], x + 1 < NV * NK ? a[x + 1] : z, x + 2 < NV * NK ? a[x + 2] : z,
                                   x + 3 < NV * NK ? a[x + 3] : z));
    for (int v = 0; v < NV; v++)
        for (int k = 0; k < NK; k++) {
            float s = r[v * NK + k];
            for (int64_t d = hd8; d < hd; d++) s += qt[v * hd + d] * kv_get(kp[i0 + k], dt, d);
            sc[v * CV_ATT_KCHUNK + i0 + k] = s;
        }
}

#define SCB_DT(NV, NK)                                                                          \
    do {                                                                                        \
        if (dt == CV_F32) scores_blk(s, q, hd, NV, NK, i0, kp, CV_F32);                         \
        else if (dt == CV_F16) scores_blk(s, q, hd, NV, NK, i0, kp, CV_F16);                    \
        else if (dt == CV_I8) scores_blk(s, q, hd, NV, NK, i0, kp, CV_I8);                      \
        else scores_blk(s, q, hd, NV, NK, i0, kp, CV_BF16);                                     \
    } while (0)
#define SCB_NK(NV)                                                                              \
    do {                                                                                        \
        switch (nkb) {                                                                          \
        case 4: SCB_DT(NV, (NV == 4 ? 3 : 4)); break;                                           \
        case 3: SCB_DT(NV, 3); break;                                                           \
        case 2: SCB_DT(NV, 2); break;                                                           \
        default: SCB_DT(NV, 1); break;                                                          \
        }                                                                                       \
    } while (0)

void cv_att_scores_avx2(float *sc, const float *qt, int64_t hd, int nv, const int *nval,
                        const void *const *kp, cv_dtype dt, float *row) {
    (void)row; /* scratch of the plain kernels */
    for (int v0 = 0; v0 < nv;) {
        const int nvg = group_size(nv, v0);
        const int nk = cv_att_max_valid(nval, v0, nvg);
        const int kb = nvg == 4 ? 3 : 4; /* keys per block: at most 12 accumulators */
        float *s = sc + v0 * CV_ATT_KCHUNK;
        const float *q = qt + v0 * hd;
        for (int i0 = 0; i0 < nk; i0 += kb) {
            const int nkb = nk - i0 < kb ? nk - i0 : kb;
            switch (nvg) {
            case 1: SCB_NK(1); break;
            case 2: SCB_NK(2); break;
            case 3: SCB_NK(3); break;
            default: SCB_NK(4); break;
            }
        }
        v0 += nvg;
    }
}
#undef SCB_NK
#undef SCB_DT

/* acc[v][d0 .. d0 + 8 DB) = acc * alpha[v] + sum_i p[v][i] V_i for NV vectors:
 * NV x DB accumulators, each V row chunk loaded once for all NV vectors. */
static CV_ALWAYS_INLINE void pv_blk(float *acc, const float *sc, const float *alpha, int64_t hd,
                                    int64_t d0, const int NV, const int DB, int nk,
                                    const void *const *vp, const cv_dtype dt) {
    __m256 a[12];
#pragma GCC unroll 4
    for (int v = 0; v < NV; v++) {
        const __m256 al = _mm256_set1_ps(alpha[v]);
#pragma GCC unroll 4
        for (int b = 0; b < DB; b++)
            a[v * DB + b] = _mm256_mul_ps(_mm256_loadu_ps(acc + v * hd + d0 + 8 * b), al);
    }
    /* registers as in scores_blk: the DB value slices and one weight, or the
     * NV weights and one slice */
    const int values_held = NV * DB + DB + 1 <= 16;
    for (int i = 0; i < nk; i++) {
        if (values_held) {
            __m256 vv[4];
#pragma GCC unroll 4
            for (int b = 0; b < DB; b++) {
                vv[b] = kv_load8(vp[i], dt, d0 + 8 * b);
                if (NV > 1) CV_KEEP(vv[b]);
            }
#pragma GCC unroll 4
            for (int v = 0; v < NV; v++) {
                const __m256 p = _mm256_broadcast_ss(sc + v * CV_ATT_KCHUNK + i);
#pragma GCC unroll 4
                for (int b = 0; b < DB; b++) a[v * DB + b] = _mm256_fmadd_ps(p, vv[b], a[v * DB + b]);
            }
        } else {
            __m256 p[4];
#pragma GCC unroll 4
            for (int v = 0; v < NV; v++) {
                p[v] = _mm256_broadcast_ss(sc + v * CV_ATT_KCHUNK + i);
                CV_KEEP(p[v]);
            }
#pragma GCC unroll 4
            for (int b = 0; b < DB; b++) {
                const __m256 vb = kv_load8(vp[i], dt, d0 + 8 * b);
#pragma GCC unroll 4
                for (int v = 0; v < NV; v++) a[v * DB + b] = _mm256_fmadd_ps(p[v], vb, a[v * DB + b]);
            }
        }
    }
#pragma GCC unroll 4
    for (int v = 0; v < NV; v++)
#pragma GCC unroll 4
        for (int b = 0; b < DB; b++) _mm256_storeu_ps(acc + v * hd + d0 + 8 * b, a[v * DB + b]);
}

/* All of head_dim for one group: blocks of 8 * (12 / NV) dims (at most 32),
 * then single 8-dim blocks, then a scalar tail. */
static CV_ALWAYS_INLINE void pv_group(float *acc, const float *sc, const float *alpha, int64_t hd,
                                      const int NV, int nk, const void *const *vp, const cv_dtype dt) {
    const int DB = NV == 4 ? 3 : 4;
    int64_t d = 0;
    for (; d + 8 * DB <= hd; d += 8 * DB) pv_blk(acc, sc, alpha, hd, d, NV, DB, nk, vp, dt);
    for (; d + 8 <= hd; d += 8) pv_blk(acc, sc, alpha, hd, d, NV, 1, nk, vp, dt);
    for (; d < hd; d++) {
        for (int v = 0; v < NV; v++) {
            float s = acc[v * hd + d] * alpha[v];
            for (int i = 0; i < nk; i++) s += sc[v * CV_ATT_KCHUNK + i] * kv_get(vp[i], dt, d);
            acc[v * hd + d] = s;
        }
    }
}

#define PV_DT(NV)                                                                               \
    do {                                                                                        \
        if (dt == CV_F32) pv_group(a, s, al, hd, NV, nk, vp, CV_F32);                           \
        else if (dt == CV_F16) pv_group(a, s, al, hd, NV, nk, vp, CV_F16);                      \
        else if (dt == CV_I8) pv_group(a, s, al, hd, NV, nk, vp, CV_I8);                        \
        else pv_group(a, s, al, hd, NV, nk, vp, CV_BF16);                                       \
    } while (0)

void cv_att_pv_avx2(float *acc, const float *sc, const float *alpha, int64_t hd, int nv,
                    const int *nval, const void *const *vp, cv_dtype dt, float *row) {
    (void)row; /* scratch of the plain kernels */
    for (int v0 = 0; v0 < nv;) {
        const int nvg = group_size(nv, v0);
        const int nk = cv_att_max_valid(nval, v0, nvg);
        float *a = acc + v0 * hd;
        const float *s = sc + v0 * CV_ATT_KCHUNK;
        const float *al = alpha + v0;
        switch (nvg) {
        case 1: PV_DT(1); break;
        case 2: PV_DT(2); break;
        case 3: PV_DT(3); break;
        default: PV_DT(4); break;
        }
        v0 += nvg;
    }
}
#undef PV_DT

/* The plain int8 scaling (attention.c) on AVX2: the same one multiply per entry. */
void cv_att_scale_avx2(float *sc, int nv, const int *nval, const float *s) {
    for (int v = 0; v < nv; v++) {
        float *r = sc + v * CV_ATT_KCHUNK;
        int i = 0;
        for (; i + 8 <= nval[v]; i += 8) _mm256_storeu_ps(r + i, _mm256_mul_ps(_mm256_loadu_ps(r + i), _mm256_loadu_ps(s + i)));
        for (; i < nval[v]; i++) r[i] *= s[i];
    }
}

static void softmax_step_avx2(float *sc, int nk, float *m, float *l, float *alpha, int nval) {
    if (nval > 0) {
        float mx = sc[0];
        int i = 0;
        if (nval >= 8) {
            __m256 vmx = _mm256_loadu_ps(sc);
            for (i = 8; i + 8 <= nval; i += 8) vmx = _mm256_max_ps(vmx, _mm256_loadu_ps(sc + i));
            __m128 h = _mm_max_ps(_mm256_castps256_ps128(vmx), _mm256_extractf128_ps(vmx, 1));
            h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            h = _mm_max_ss(h, _mm_movehdup_ps(h));
            mx = _mm_cvtss_f32(h);
        }
        for (; i < nval; i++) mx = sc[i] > mx ? sc[i] : mx;
        const float mn = *m > mx ? *m : mx;
        const float a = *m == -INFINITY ? 0.0f : expf(*m - mn);
        const __m256 vm = _mm256_set1_ps(mn);
        __m256 vs = _mm256_setzero_ps();
        for (i = 0; i + 8 <= nval; i += 8) {
            const __m256 e = cv_exp256(_mm256_sub_ps(_mm256_loadu_ps(sc + i), vm));
            _mm256_storeu_ps(sc + i, e);
            vs = _mm256_add_ps(vs, e);
        }
        float buf[8];
        _mm256_storeu_ps(buf, vs);
        float sum = ((buf[0] + buf[1]) + (buf[2] + buf[3])) + ((buf[4] + buf[5]) + (buf[6] + buf[7]));
        for (; i < nval; i++) {
            sc[i] = expf(sc[i] - mn);
            sum += sc[i];
        }
        *l = *l * a + sum;
        *m = mn;
        *alpha = a;
    } else {
        *alpha = 1.0f;
    }
    for (int i = nval > 0 ? nval : 0; i < nk; i++) sc[i] = 0.0f;
}

void cv_att_softmax_avx2(float *sc, int nk, int nv, const int *nval, float *m, float *l, float *alpha) {
    for (int v = 0; v < nv; v++) softmax_step_avx2(sc + v * CV_ATT_KCHUNK, nk, &m[v], &l[v], &alpha[v], nval[v]);
}
CV_TARGET_END
#endif
