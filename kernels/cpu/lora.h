/* The CPU backend's LoRA kernels (kernels/backend.h: lora_shrink, lora_expand). */
#ifndef CV_CPU_LORA_H
#define CV_CPU_LORA_H

#include "../backend.h"

void cv_cpu_lora_shrink(cv_backend *b, float *t, const float *x, int64_t x_stride, int64_t n, const float *a,
                        int64_t rank, int64_t in);
void cv_cpu_lora_expand(cv_backend *b, float *y, int64_t y_stride, const float *t, int64_t n, const float *bt,
                        int64_t rank, int64_t out, float scale);

#endif
