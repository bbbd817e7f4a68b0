/* The CPU backend's LoRA kernel (kernels/backend.h: lora_sgmv). */
#ifndef CV_CPU_LORA_H
#define CV_CPU_LORA_H

#include "../backend.h"

/* The largest rank the kernel takes (a row's rank vector is on the stack). */
#define CV_CPU_LORA_MAX_RANK 1024

void cv_cpu_lora_sgmv(cv_backend *b, float *y, int64_t y_stride, const float *x, int64_t x_stride,
                      const cv_lora_segment *segs, int64_t n_segs, int64_t in, int64_t out, float *tmp);

#endif
