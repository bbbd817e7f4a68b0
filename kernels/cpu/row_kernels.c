/* The per-row code of RMSNorm, SwiGLU and GeGLU, through the kernel table
 * (plain C here; SIMD versions under x86/), a shared piece: it calls nothing
 * above it. The unfused kernels (elementwise.c) and
 * the prologues of the fused GEMMs (gemm.c, quant.c) run these same rows, so
 * fused and unfused results agree bit for bit. */
#include <math.h>
#include <string.h>

#include "cpu_internal.h"

/* ------------------------------------------------------------------------ */
/* RMSNorm                                                                   */

/* out[dim] = x * rsqrt(mean(x^2) + eps) * w; out may alias x. */
void cv_rms_row_plain(float *out, const float *x, const float *w, int64_t dim, float eps) {
    double ss = 0.0;
    for (int64_t i = 0; i < dim; i++) ss += (double)x[i] * (double)x[i];
    const float inv = (float)(1.0 / sqrt(ss / (double)dim + (double)eps));
    for (int64_t i = 0; i < dim; i++) out[i] = x[i] * inv * w[i];
}

/* One row with the backend's kernels: the row code every RMSNorm runs, fused or not. */
void cv_cpu_rms_row(float *out, const float *x, const float *w, int64_t dim, float eps, const cv_cpu_kernels *k) {
    k->rms_row(out, x, w, dim, eps);
}

/* One row with the backend's kernels: the row code every SwiGLU runs, fused or not. */
void cv_cpu_swiglu_row(float *o, const float *g, const float *u, int64_t dim, const cv_cpu_kernels *k) {
    int64_t i = k->swiglu_part ? k->swiglu_part(o, g, u, dim) : 0;
    for (; i < dim; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

/* GELU (tanh form) gated by up (kernel_table.h: CV_GELU_K). */
void cv_cpu_geglu_row(float *o, const float *g, const float *u, int64_t dim, const cv_cpu_kernels *k) {
    int64_t i = k->geglu_part ? k->geglu_part(o, g, u, dim) : 0;
    for (; i < dim; i++) {
        const float x = g[i];
        o[i] = x / (1.0f + expf(-2.0f * CV_GELU_K * (x + CV_GELU_C * x * x * x))) * u[i];
    }
}

/* ------------------------------------------------------------------------ */
/* GEMM input rows made on the fly (the prologue of the fused GEMMs)         */

void cv_cpu_gemm_in_rows(const cv_gemm_in *in, float *dst, int64_t t0, int64_t m, int64_t cols,
                         const cv_cpu_kernels *k) {
    for (int64_t t = t0; t < t0 + m; t++, dst += cols) {
        if (in->kind == CV_IN_RMSNORM)
            cv_cpu_rms_row(dst, in->src + (size_t)t * (size_t)cols, in->gain, cols, in->eps, k);
        else if (in->kind == CV_IN_SWIGLU)
            cv_cpu_swiglu_row(dst, in->src + (size_t)t * 2 * (size_t)cols, in->src + ((size_t)t * 2 + 1) * (size_t)cols,
                       cols, k);
        else
            memcpy(dst, in->src + (size_t)t * (size_t)cols, (size_t)cols * sizeof(float));
    }
}
