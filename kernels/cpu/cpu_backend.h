/* The CPU backend's public C API beyond the backend table (kernels/backend.h):
 * creation at a named SIMD level, the measurements the benchmarks take, and
 * what kernel_info reports. Code outside kernels/cpu includes this header and
 * cpu_features.h (self-contained, run-time CPU features) only; the others
 * here (cpu_internal.h, quant.h, threadpool.h, gemm_ukr.h) are private to
 * the backend and may change with its kernels. */
#ifndef CV_CPU_BACKEND_H
#define CV_CPU_BACKEND_H

#include <stddef.h>

#include "../backend.h"
#include "cpu_features.h"

/* ---- creation and state ------------------------------------------------- */

/* cv_cpu_backend_create (backend.h) at the level named by simd ("scalar",
 * "avx2", "avx512", "avx512_bf16"; NULL: from the environment). An unknown
 * name or a level the CPU lacks: NULL with CV_ERR_INVALID. */
cv_backend *cv_cpu_backend_create_simd(int num_threads, const char *simd, cv_err *err);
/* The SIMD level name a CPU backend runs at (NULL for other backends). */
const char *cv_cpu_backend_simd(const cv_backend *b);
/* Worker threads of a CPU backend (0 for other backends). */
int cv_cpu_backend_threads(const cv_backend *b);
/* Cores this process may run on (what num_threads <= 0 means). */
int cv_cpu_backend_cores(void);

/* ---- introspection ------------------------------------------------------ */

/* Kernel families ("gemm_f32", "rmsnorm", ...): how many, the name of the
 * i-th, and the path it runs at SIMD level `level` (the highest level it has
 * code for, at most `level`). i out of range: NULL / CV_SIMD_SCALAR. */
int cv_cpu_family_count(void);
const char *cv_cpu_family_name(int i);
cv_simd_level cv_cpu_family_path(int i, cv_simd_level level);

/* Fixed shapes of the kernels. */
typedef struct cv_cpu_shapes {
    int gemm_nr;                /* output rows per packed GEMM panel */
    int gemm_mr;                /* token rows per GEMM micro-kernel call */
    int attention_max_head_dim; /* largest head_dim paged_attention takes */
} cv_cpu_shapes;
cv_cpu_shapes cv_cpu_backend_shapes(void);

/* ---- measurements (benchmarks) ------------------------------------------ */

/* The compute peak, in GFLOP/s (int8: GOP/s; 2 per multiply-add), of the
 * instruction the backend's kernels use for kind, by register-only loops on
 * nth threads (<= 0: all) for about `seconds`; *instr names it. < 0 on bad
 * arguments. */
typedef enum cv_peak_kind { CV_PEAK_FP32_FMA = 0, CV_PEAK_BF16_DOT = 1, CV_PEAK_INT8_DOT = 2 } cv_peak_kind;
double cv_cpu_measure_peak(cv_backend *b, cv_peak_kind kind, int nth, double seconds, const char **instr);
/* STREAM-style triad a = b + s*c over n_bytes of arrays with the backend's
 * pool; returns GB/s (bytes moved: 3 arrays), or < 0 on error. */
double cv_cpu_triad(cv_backend *b, size_t n_bytes, int repeats);
/* GB/s of reading one array of n_bytes (the access pattern of a GEMV). */
double cv_cpu_read_bw(cv_backend *b, size_t n_bytes, int repeats);

/* ---- quantized kernels at a chosen level (tests compare the levels) ----- */

/* SIMD levels of the quantized kernels. */
typedef enum cv_qlevel { CV_QL_SCALAR = 0, CV_QL_AVX2 = 1, CV_QL_AVX512VNNI = 2, CV_QL_AVXVNNI = 3 } cv_qlevel;
/* The best quantized level this CPU runs within the backend's SIMD level
 * (a cv_simd_level: scalar -> plain C; avx2 -> AVX2 or AVX-VNNI; avx512 and
 * up -> AVX-512 VNNI where present), so CONVEYOR_SIMD bounds it too. */
cv_qlevel cv_qlevel_best(int simd);
/* Name of a level ("scalar", "avx2", "avx512vnni", "avxvnni"). */
const char *cv_qlevel_name(cv_qlevel l);
/* 1 when this CPU can run level l. */
int cv_qlevel_supported(cv_qlevel l);
/* The backend's gemm on a quantized matrix, at an explicit level. */
void cv_cpu_qgemm_level(cv_backend *b, float *out, const float *x, int64_t n, const cv_matrix *w,
                        const float *bias, int accumulate, cv_qlevel level);

#endif
