/* Writing tokens' keys and values into the paged KV cache (a shared piece: the
 * backend's kv_write and the fused rope + KV write of elementwise.c both call
 * it, and it calls only the conversions and the pool). A float cache stores
 * each head's row narrowed to its dtype; an int8 cache stores the row quantized
 * symmetrically with one float32 scale per (token, KV head). */
#include <math.h>

#include "cpu_internal.h"

typedef struct kvw_job {
    cv_kv_layer *cache;
    const float *k, *v;        /* [n][k_stride], [n][v_stride] */
    int64_t k_stride, v_stride, n;
    const int64_t *slots;      /* [n] */
    const cv_cpu_kernels *kern;
    cv_rows *rows;             /* claimed in chunks (dynamic region) */
} kvw_job;

/* One row into the int8 cache: q = round(x * (127 / max|x|)) (to nearest,
 * ties to even) clamped to +-127 (a NaN becomes 0), its scale max|x| / 127
 * (0 for a zero row). The plain reference (every level gives its bits):
 * adding and subtracting 1.5 * 2^23 rounds |v| < 2^22 to an integer in the
 * default rounding mode, as nearbyintf does, without a libm call per value. */
void cv_kv_quantize_i8_plain(int8_t *dst, float *scale, const float *x, int64_t hd) {
    float amax = 0.0f;
    for (int64_t d = 0; d < hd; d++) {
        const float a = fabsf(x[d]);
        amax = a > amax ? a : amax;
    }
    const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
    *scale = amax / 127.0f;
    const float magic = 12582912.0f; /* 1.5 * 2^23 */
    for (int64_t d = 0; d < hd; d++) {
        float r = x[d] * id;
        r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r); /* also keeps |r| < 2^22 */
        r = (r + magic) - magic;
        dst[d] = r == r ? (int8_t)r : 0;
    }
}

void cv_cpu_kv_write_token(const cv_kv_layer *c, const float *k, const float *v, int64_t slot,
                           const cv_cpu_kernels *kern) {
    const int64_t hd = c->head_dim, bs = c->block_size, nkv = c->n_kv_heads;
    const size_t esz = cv_dtype_size(c->dtype);
    if (slot < 0) return;
    void (*quantize)(int8_t *, float *, const float *, int64_t) = kern->kv_quantize_i8;
    const int64_t blk = slot / bs, off = slot % bs;
    for (int64_t h = 0; h < nkv; h++) {
        const size_t row = ((size_t)blk * (size_t)nkv + (size_t)h) * (size_t)bs + (size_t)off;
        const size_t dst = row * (size_t)hd * esz;
        if (c->dtype == CV_I8) {
            quantize((int8_t *)c->k + dst, c->k_scale + row, k + (size_t)(h * hd), hd);
            quantize((int8_t *)c->v + dst, c->v_scale + row, v + (size_t)(h * hd), hd);
            continue;
        }
        cv_cpu_narrow((char *)c->k + dst, c->dtype, k + (size_t)(h * hd), hd, kern);
        cv_cpu_narrow((char *)c->v + dst, c->dtype, v + (size_t)(h * hd), hd, kern);
    }
}

static void kvw_fn(void *arg, int tid, int nth) {
    const kvw_job *j = arg;
    (void)tid;
    (void)nth;
    for (int64_t t0, t1; cv_rows_claim(j->rows, &t0, &t1);)
        for (int64_t t = t0; t < t1; t++)
            cv_cpu_kv_write_token(j->cache, j->k + (size_t)t * (size_t)j->k_stride,
                                  j->v + (size_t)t * (size_t)j->v_stride, j->slots[t], j->kern);
}

void cv_cpu_kv_write(cv_backend *b, cv_kv_layer *cache, const float *k, int64_t k_stride,
                     const float *v, int64_t v_stride, const int64_t *slot_mapping, int64_t n) {
    cv_cpu *c = cv_cpu_of(b);
    if (n <= 0) return;
    kvw_job j = {.cache = cache, .k = k, .v = v, .k_stride = k_stride, .v_stride = v_stride,
                 .n = n, .slots = slot_mapping, .kern = &c->kern};
    int nth = cv_threads_for(c, (double)n * (double)(cache->n_kv_heads * cache->head_dim) * 2.0, 65536.0);
    if (nth > n) nth = (int)n;
    cv_rows rows;
    j.rows = &rows;
    cv_cpu_run_rows(c, nth, &rows, n, kvw_fn, &j);
}
