/* The CPU backend's LoRA kernel (kernels/backend.h: lora_sgmv). */
#ifndef CV_CPU_LORA_H
#define CV_CPU_LORA_H

#include <stdint.h>
#include <string.h>

#include "../backend.h"

/* The largest rank the kernel takes (a row's rank vector is on the stack). */
#define CV_CPU_LORA_MAX_RANK 1024

/* Rows of one adapter the shrink and expand kernels take at a time (each
 * pass over the adapter's matrices serves them all). */
#define CV_LORA_ROWS 4

/* Adapter weights are float32 or bf16 (the top half of a float32): element i. */
static inline float cv_lora_w_at(const void *w, int bf16, size_t i) {
    if (!bf16) return ((const float *)w)[i];
    uint32_t u = (uint32_t)((const uint16_t *)w)[i] << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

void cv_cpu_lora_sgmv(cv_backend *b, float *y, int64_t y_stride, const float *x, int64_t x_stride,
                      const cv_lora_segment *segs, int64_t n_segs, int64_t in, float *tmp);

#endif
