/* LoRA's shrink and expand over the rows of one adapter (kernels/backend.h):
 * one thread per output element, each a dot product in a fixed order, so a
 * row's result depends on that row alone. Adapters are small (rank <= 1024):
 * these are memory-bound and simple on purpose. */
#include "cuda_internal.h"

/* Adapter weights: float32 or bf16 (the top half of a float32). */
__device__ __forceinline__ float lora_w(const void *w, int bf16, int64_t i) {
    if (!bf16) return ((const float *)w)[i];
    return __uint_as_float((unsigned)((const unsigned short *)w)[i] << 16);
}

/* Blocks for `total` threads of `threads` each, capped for a grid-stride loop. */
static unsigned lora_grid(const cv_cuda_ctx *c, int64_t total, int threads) {
    int64_t g = (total + threads - 1) / threads, cap = (int64_t)c->num_sms * 16;
    if (g > cap) g = cap;
    return (unsigned)(g < 1 ? 1 : g);
}

/* t[r][k] = sum_i x[r][i] * a[k][i] */
__global__ void lora_shrink_kernel(float *t, const float *x, int64_t x_stride, int64_t n, const void *a, int bf16,
                                   int64_t rank, int64_t in) {
    const int64_t total = n * rank;
    for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < total;
         e += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = e / rank, k = e - r * rank;
        const float *xr = x + r * x_stride;
        float s = 0.f;
        for (int64_t i = 0; i < in; i++) s = fmaf(xr[i], lora_w(a, bf16, k * in + i), s);
        t[e] = s;
    }
}

/* y[r][o] += scale * sum_j t[r][j] * bt[j][o] (bt in panels: CV_LORA_BT_AT) */
__global__ void lora_expand_kernel(float *y, int64_t y_stride, const float *t, int64_t n, const void *bt, int bf16,
                                   int64_t rank, int64_t out, float scale) {
    const int64_t total = n * out;
    for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < total;
         e += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = e / out, o = e - r * out;
        const float *tr = t + r * rank;
        float acc = 0.f;
        for (int64_t j = 0; j < rank; j++) acc = fmaf(tr[j], lora_w(bt, bf16, CV_LORA_BT_AT(rank, j, o)), acc);
        y[r * y_stride + o] = fmaf(scale, acc, y[r * y_stride + o]);
    }
}

void cvc_lora_sgmv(cv_backend *b, float *y, int64_t y_stride, const float *x, int64_t x_stride,
                   const cv_lora_segment *segs, int64_t n_segs, int64_t in, float *tmp) {
    cv_cuda_ctx *c = cvc_of(b);
    if (n_segs <= 0) return;
    if (cvc_enter(c) < 0) return;
    for (int64_t s = 0; s < n_segs; s++) { /* in stream order: tmp is reused */
        const cv_lora_segment *g = &segs[s];
        if (g->n_rows <= 0 || g->rank <= 0 || g->out <= 0) continue;
        const float *xs = x + g->row0 * x_stride;
        float *ys = y + g->row0 * y_stride + g->col0;
        lora_shrink_kernel<<<lora_grid(c, g->n_rows * g->rank, 128), 128, 0, c->stream>>>(tmp, xs, x_stride,
                                                                                          g->n_rows, g->a,
                                                                                          g->dtype == CV_BF16,
                                                                                          g->rank, in);
        lora_expand_kernel<<<lora_grid(c, g->n_rows * g->out, 256), 256, 0, c->stream>>>(ys, y_stride, tmp,
                                                                                         g->n_rows, g->bt,
                                                                                         g->dtype == CV_BF16, g->rank,
                                                                                         g->out, g->scale);
    }
    cvc_check_launch(c, "lora_sgmv");
}
