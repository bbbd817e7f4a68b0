/* Private declarations shared by the files of the CPU backend (kernels/cpu). */
#ifndef CV_CPU_INTERNAL_H
#define CV_CPU_INTERNAL_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/mman.h>

#include "../backend.h"
#include "cpu_backend.h"
#include "cpu_features.h"
#include "threadpool.h"
#include "weight_arena.h"

/* The SIMD paths (x86/) are compiled on every x86-64 build, each function
 * for its own target (CV_TARGET_*_BEGIN/END in cpu_features.h), and chosen at
 * run time: once per backend, from cv_cpu.simd, into its kernel table
 * (kernel_table.h); no -march is needed. */
#if defined(CV_EMULATE_AVX512) /* development: portable intrinsics (build_support/avx512_emu) */
#define CV_HAVE_AVX2 1
#define CV_HAVE_AVX512 1
#include "avx512_emu.h"
#elif defined(__x86_64__) || defined(__i386__)
#define CV_HAVE_AVX2 1
#define CV_HAVE_AVX512 1
#include <immintrin.h>
#else
#define CV_HAVE_AVX2 0
#define CV_HAVE_AVX512 0
#endif

#define CV_ALWAYS_INLINE inline __attribute__((always_inline))

/* GEMM packing: W is stored as panels of CV_NR output rows, interleaved
 * along cols: panel p holds rows [CV_NR*p, CV_NR*p + CV_NR) as [cols][CV_NR]
 * (rows past the end are zero), so the micro-kernel reads one contiguous
 * stream. bf16 panels put output j at slot 2j (j < 8) or 2(j-8)+1 so that
 * a 32-bit lane holds outputs (j, j+8): a shift and a mask widen them. */
#define CV_NR 16
/* Token rows per micro-kernel call (6 x 16 fp32 accumulators = 12 ymm). */
#define CV_MR 6
/* Default GEMM blocking: about KC cols per block (a 288 x 16 f32 panel chunk
 * is 18 KiB, in L1) and token blocks of about XBLOCK floats of x (256 KiB,
 * in L2). CONVEYOR_GEMM_KC / CONVEYOR_GEMM_XBLOCK override them and
 * CONVEYOR_GEMM_PACK=0 turns the packing of x off and CONVEYOR_GEMM_ORDER=0|1
 * forces the loop order (for measurements). */
#define CV_GEMM_KC 288
#define CV_GEMM_XBLOCK 65536

/* Attention limits and per-thread scratch. */
#define CV_ATT_MAX_HD 256  /* largest head_dim */
#define CV_ATT_TILE 16     /* query vectors (token x head) per tile */
#define CV_ATT_KCHUNK 32   /* keys per online-softmax step */

/* The most valid keys of vectors [v0, v0 + nvg) of a chunk (nval[v] each). */
static inline int cv_att_max_valid(const int *nval, int v0, int nvg) {
    int nk = 0;
    for (int v = v0; v < v0 + nvg; v++) nk = nval[v] > nk ? nval[v] : nk;
    return nk;
}

#include "kernel_table.h"

/* cos and sin of every (token, frequency) of one call's positions, kept for
 * the next calls with the same positions and frequencies: the layers of one
 * step (elementwise.c). Keyed by the contents, not the pointers: the engine
 * refills the same arrays every step. */
typedef struct cv_rope_table {
    float *cs;       /* [n][2 * nf]: nf cosines, then nf sines */
    int32_t *pos;    /* [n] the key: positions */
    float *freq;     /* [nf] and frequencies */
    int64_t n, nf;   /* n == 0: empty */
    size_t cap_cs, cap_pos, cap_freq;
} cv_rope_table;

typedef struct cv_cpu {
    cv_pool *pool;
    int nthreads;
    int simd;                /* a cv_simd_level: CV_SIMD_SCALAR is plain C */
    cv_cpu_kernels kern;     /* the kernels of that level (a kernel without a version at
                              * this level runs the best one below it) */
    float *att_scratch;      /* [nthreads][att_scratch_floats] */
    size_t att_scratch_floats;
    float *att_partials;     /* [att_partial_units][att_partial_floats] (m, l, acc) of split segments */
    size_t att_partial_floats;
    size_t att_partial_units; /* grows to the units of a split step (cv_cpu_att_partials_reserve) */
    atomic_int *att_counters; /* [2*nthreads] parts still running per split item */
    size_t l2_bytes, l3_bytes; /* cache sizes (per core L2, shared L3) */
    int64_t gemm_kc;         /* GEMM blocking: about this many cols per block */
    int64_t gemm_xblock;     /* floats of x per token block */
    int gemm_pack;           /* pack x blocks (1) or read x in place (0) */
    int gemm_order;          /* -1: choose; 0: token blocks outermost; 1: panels outermost */
    float *gemm_xpack;       /* [nthreads][gemm_xpack_floats] packed x blocks */
    float *gemm_xrows;       /* [nthreads][gemm_xpack_floats] input rows made by a prologue */
    size_t gemm_xpack_floats; /* >= max(xblock, CV_MR * cols) for every prepared matrix */
    void *qx;                /* quantized activations of a token block (quant.c) */
    size_t qx_bytes;
    int qlevel;              /* cv_qlevel of the quantized kernels */
    int exact_activations;   /* 1: no bf16 rounding of GEMM inputs (no vdpbf16ps path) */
    cv_rope_table rope_tables[2]; /* a step's RoPE angles, for the layers after the first */
    int rope_next;           /* the table to replace next */
    cv_weight_arena weights; /* the prepared matrices' memory */
} cv_cpu;

static inline cv_cpu *cv_cpu_of(cv_backend *b) { return (cv_cpu *)b->ctx; }

/* Threads worth using for `work` units when one thread should get at least
 * `grain` of them. */
static inline int cv_threads_for(const cv_cpu *c, double work, double grain) {
    double t = work / grain;
    if (t < 1) return 1;
    if (t >= c->nthreads) return c->nthreads;
    return (int)t;
}

/* Rows [0, n) handed out in chunks from a shared counter, for the row
 * kernels' dynamic pool regions: a thread that starts late (asleep, or
 * descheduled on a busy machine) only takes fewer rows. */
typedef struct cv_rows {
    _Alignas(64) atomic_llong next;
    int64_t n, chunk;
} cv_rows;

/* Next chunk [*t0, *t1); 0 when none is left. */
static inline int cv_rows_claim(cv_rows *r, int64_t *t0, int64_t *t1) {
    const int64_t s = atomic_fetch_add_explicit(&r->next, r->chunk, memory_order_relaxed);
    if (s >= r->n) return 0;
    *t0 = s;
    *t1 = s + r->chunk < r->n ? s + r->chunk : r->n;
    return 1;
}

/* Asks for huge pages over the 2 MiB-aligned interior of a large buffer not
 * yet written (the weights, the KV pool, activations): streaming hundreds of
 * MB through 4 KiB pages costs a TLB walk every 64 lines and stops the
 * hardware prefetchers at each page. Advice only: no THP is fine. */
static inline void cv_cpu_advise_huge(void *p, size_t bytes) {
#ifdef MADV_HUGEPAGE
    const uintptr_t huge = (uintptr_t)2 << 20;
    const uintptr_t lo = ((uintptr_t)p + huge - 1) & ~(huge - 1), hi = ((uintptr_t)p + bytes) & ~(huge - 1);
    if (p && hi > lo) (void)madvise((void *)lo, hi - lo, MADV_HUGEPAGE);
#else
    (void)p;
    (void)bytes;
#endif
}
/* Every cache line of [p, p + bytes) asked for at once (bytes > 0), the last
 * byte's too: a span that starts mid-line ends in one more line. */
static inline void cv_prefetch_bytes(const void *p, size_t bytes) {
    const char *c = (const char *)p;
    for (size_t o = 0; o < bytes; o += 64) __builtin_prefetch(c + o);
    __builtin_prefetch(c + bytes - 1);
}

/* A byte range asked for (prefetch into L2) in even slices of whole lines,
 * one slice per cv_prefetch_slice call, so that it arrives over `calls` units
 * of other work instead of all at once. A zero span asks for nothing. */
typedef struct cv_prefetch_span {
    const char *p, *end;
    size_t step;
} cv_prefetch_span;

static inline cv_prefetch_span cv_prefetch_span_of(const void *start, size_t bytes, size_t calls) {
    const cv_prefetch_span s = {(const char *)start, (const char *)start + bytes, (bytes / calls + 64) & ~(size_t)63};
    return s;
}

static inline void cv_prefetch_slice(cv_prefetch_span *s) {
    if (!s->p) return;
    const char *e = s->end - s->p > (ptrdiff_t)s->step ? s->p + s->step : s->end;
    for (; s->p < e; s->p += 64) __builtin_prefetch(s->p, 0, 2);
}

/* Most lines a kernel asks for per step of its loop (cv_prefetch_spread):
 * a slice larger than one line a step (few tiles share a group of weights)
 * is spread at up to this many a step instead of its excess asked for at
 * once, which stalled the thread on full miss buffers. */
#define CV_PREFETCH_LINES_PER_STEP 4

/* A span's next slice, for a kernel that asks for its lines itself over the
 * `steps` steps of its own loop (cv_prefetch_spread): *lines of them from the
 * returned start (at most CV_PREFETCH_LINES_PER_STEP a step; the rest is
 * asked for at once), or NULL when the span is done. */
static inline const char *cv_prefetch_take(cv_prefetch_span *s, int64_t steps, int64_t *lines) {
    *lines = 0;
    if (!s->p || s->p >= s->end) return NULL;
    const char *start = s->p;
    const size_t left = (size_t)(s->end - s->p), take = left < s->step ? left : s->step;
    const int64_t n = (int64_t)((take + 63) / 64), most = CV_PREFETCH_LINES_PER_STEP * steps;
    *lines = n < most ? n : most;
    for (const char *q = start + (size_t)*lines * 64; q < start + take; q += 64) __builtin_prefetch(q, 0, 2);
    s->p = start + take;
    return *lines > 0 ? start : NULL;
}

/* Lines pf .. pf + 64 (lines - 1) asked for at even spacing over a loop of
 * `steps` steps, one cv_prefetch_step per step, so that the out-of-order core
 * runs the loop's work past a prefetch that waits for a miss buffer. Each
 * step asks for `per` lines together (per = lines / steps rounded up, at most
 * CV_PREFETCH_LINES_PER_STEP; lines beyond that are not asked for), the
 * groups of `per` spread in 16.16 fixed point. A step always asks for the
 * same number (a group may be asked for twice): a count that changed from
 * step to step cost branch mispredictions in the kernels' inner loops. */
typedef struct cv_prefetch_spread {
    const char *p;
    uint64_t acc, inc, last_group, last_line;
    int per;
} cv_prefetch_spread;

static inline cv_prefetch_spread cv_prefetch_spread_of(const char *pf, int64_t lines, int64_t steps) {
    cv_prefetch_spread s = {NULL, 0, 0, 0, 0, 0};
    if (pf && lines > 0 && steps > 0) {
        const int64_t most = CV_PREFETCH_LINES_PER_STEP * steps, n = lines < most ? lines : most;
        const int64_t per = (n + steps - 1) / steps, groups = (n + per - 1) / per;
        s.p = pf;
        s.per = (int)per;
        s.last_line = (uint64_t)n - 1;
        s.last_group = (uint64_t)groups - 1;
        s.inc = ((uint64_t)groups << 16) / (uint64_t)steps + 1; /* rounded up: the last group is reached */
    }
    return s;
}

static inline void cv_prefetch_step(cv_prefetch_spread *s) {
    if (!s->p) return;
    const uint64_t g = s->acc >> 16, first = (g < s->last_group ? g : s->last_group) * (uint64_t)s->per;
    for (int i = 0; i < s->per; i++) {
        const uint64_t line = first + (uint64_t)i;
        __builtin_prefetch(s->p + ((line < s->last_line ? line : s->last_line) << 6), 0, 2);
    }
    s->acc += s->inc;
}

/* Runs fn(job) on nth threads of a dynamic region over n rows in chunks of
 * `chunk`; fn takes its rows with cv_rows_claim(rows, ...). cv_cpu_run_rows:
 * about four chunks per thread, so that one descheduled thread holds little. */
static inline void cv_cpu_run_chunks(cv_cpu *c, int nth, cv_rows *rows, int64_t n, int64_t chunk, cv_pool_fn fn,
                                     void *job) {
    rows->n = n;
    rows->chunk = chunk > 0 ? chunk : 1;
    atomic_init(&rows->next, 0);
    cv_pool_run_dynamic(c->pool, nth, fn, job, 1);
}
static inline void cv_cpu_run_rows(cv_cpu *c, int nth, cv_rows *rows, int64_t n, cv_pool_fn fn, void *job) {
    cv_cpu_run_chunks(c, nth, rows, n, n / (4 * (int64_t)(nth > 0 ? nth : 1)), fn, job);
}

/* The files of the CPU backend call in one direction:
 *   backend_cpu.c (function table, lifetime, buffers, tables), kernel_table.c
 *   (each level's kernels, chosen once per backend)
 *     -> operations: gemm.c -> quant.c; attention.c; elementwise.c; measure.c
 *     -> shared pieces: kv_write.c, row_kernels.c, convert.c, threadpool.c,
 *        cpu_features.c, weight_arena.c, and base/common.c below them all;
 *     -> the SIMD kernels under x86/ (one file per level and family), which
 *        the drivers reach through the kernel table, never by name (the
 *        quantized tiles by their own level, quant.h).
 * An operation never calls the backend or a sideways operation; a shared piece
 * never calls an operation. tools/check_layers.py checks it on the objects. */

/* ---- Operations */

/* The rows a GEMM multiplies, made on the fly by a prologue where the
 * fused kernels need them (rmsnorm_gemm, swiglu_gemm): each thread makes the
 * rows of the token block it works on, in its own L2-resident buffer, so they
 * never go through memory; with panels outermost (every thread reads all of
 * x) the region first makes them once into the caller's scratch. */
typedef enum cv_gemm_in_kind {
    CV_IN_X = 0,       /* src [n][cols] as it is */
    CV_IN_RMSNORM = 1, /* rmsnorm(src [n][cols]) * gain */
    CV_IN_SWIGLU = 2   /* silu(gate) * up of src [n][2*cols] (gate, up) */
} cv_gemm_in_kind;

typedef struct cv_gemm_in {
    cv_gemm_in_kind kind;
    const float *src;
    const float *gain; /* CV_IN_RMSNORM: [cols] */
    float eps;         /* CV_IN_RMSNORM */
} cv_gemm_in;

/* gemm.c */
int cv_cpu_matrix_prepare(cv_backend *b, cv_matrix *out, const void *src, cv_dtype src_dtype,
                          int64_t rows, int64_t cols, cv_dtype dtype, cv_err *err);
void cv_cpu_matrix_free(cv_backend *b, cv_matrix *m);
int cv_cpu_matrix_rows(cv_backend *b, float *out, const int32_t *rows, int64_t n, const cv_matrix *m);
/* Grows the GEMM pack buffers for matrices of `cols` columns (called by
 * matrix_prepare, never during a step). */
int cv_cpu_gemm_reserve(cv_cpu *c, int64_t cols);
void cv_cpu_gemm(cv_backend *b, float *out, const float *x, int64_t n, const cv_matrix *w,
                 const float *bias, int accumulate);
/* The GEMM of the rows `in` makes; scratch [n][w.cols] is used only when
 * the rows cannot be made per thread (backend.h: rmsnorm_gemm). */
void cv_cpu_gemm_in(cv_backend *b, float *out, const cv_gemm_in *in, int64_t n, const cv_matrix *w,
                    const float *bias, int accumulate, float *scratch);
void cv_cpu_rmsnorm_gemm(cv_backend *b, float *out, const float *x, const float *norm_weight, float eps,
                         int64_t n, const cv_matrix *w, const float *bias, int accumulate, float *scratch);
void cv_cpu_swiglu_gemm(cv_backend *b, float *out, const float *gu, int64_t n, const cv_matrix *w,
                        const float *bias, int accumulate, float *scratch);
/* A thread's buffer for the rows of a token block (cv_gemm_in), or NULL
 * when the backend has none of `floats` floats (matrix prepared elsewhere). */
static inline float *cv_cpu_gemm_rows_buf(const cv_cpu *c, int tid, size_t floats) {
    if (!c->gemm_xrows || floats > c->gemm_xpack_floats) return NULL;
    return c->gemm_xrows + (size_t)tid * c->gemm_xpack_floats;
}

/* elementwise.c */
void cv_cpu_rmsnorm(cv_backend *b, float *out, const float *x, const float *weight, int64_t n,
                    int64_t dim, float eps);
void cv_cpu_rope(cv_backend *b, float *q, int64_t q_stride, int64_t n_heads, float *k,
                 int64_t k_stride, int64_t n_kv_heads, const int32_t *pos, int64_t n,
                 const cv_rope *rope);
void cv_cpu_swiglu(cv_backend *b, float *out, const float *gu, int64_t n, int64_t dim);
void cv_cpu_head_rmsnorm(cv_backend *b, float *x, int64_t x_stride, int64_t n_heads, int64_t n, int64_t head_dim,
                         const float *weight, float eps);
void cv_cpu_add_rmsnorm(cv_backend *b, float *x, float *y, const float *weight, int64_t n, int64_t dim,
                        float eps);
void cv_cpu_geglu(cv_backend *b, float *out, const float *gu, int64_t n, int64_t dim);
void cv_cpu_scale(cv_backend *b, float *x, int64_t n, float s);
void cv_cpu_rope_kv_write(cv_backend *b, float *q, int64_t q_stride, int64_t n_heads, float *k,
                          int64_t k_stride, int64_t n_kv_heads, const float *v, int64_t v_stride,
                          const int32_t *pos, int64_t n, const cv_rope *rope, cv_kv_layer *cache,
                          const int64_t *slot_mapping);
void cv_cpu_embedding(cv_backend *b, float *out, const int32_t *tokens, int64_t n,
                      const cv_table *table);

/* attention.c */
void cv_cpu_paged_attention(cv_backend *b, float *out, const float *q, int64_t q_stride,
                            const cv_kv_layer *cache, const cv_attn_batch *batch);
/* Floats of attention scratch each thread needs, and of one split part's
 * partial result (both multiples of 16). */
size_t cv_cpu_att_scratch_floats(void);
size_t cv_cpu_att_partial_floats(void);
/* Room for `units` partial results; 0, or CV_ERR_NOMEM (the buffer unchanged). */
int cv_cpu_att_partials_reserve(cv_cpu *c, size_t units);

/* ---- Shared pieces: they call nothing above them (operations, backend). */

/* row_kernels.c: one row with the backend's kernels, the code every RMSNorm,
 * SwiGLU and GeGLU runs, fused or not. */
void cv_cpu_rms_row(float *out, const float *x, const float *w, int64_t dim, float eps, const cv_cpu_kernels *k);
void cv_cpu_swiglu_row(float *o, const float *g, const float *u, int64_t dim, const cv_cpu_kernels *k);
void cv_cpu_geglu_row(float *o, const float *g, const float *u, int64_t dim, const cv_cpu_kernels *k);
/* Rows [t0, t0 + m) of the GEMM input `in` into dst[m][cols], by those rows
 * (so bit for bit the unfused kernels' results). */
void cv_cpu_gemm_in_rows(const cv_gemm_in *in, float *dst, int64_t t0, int64_t m, int64_t cols,
                         const cv_cpu_kernels *k);

/* convert.c: widens n values of dtype dt at src to float32 with the kernels k
 * (NULL: plain C). */
void cv_cpu_widen(float *dst, const void *src, cv_dtype dt, int64_t n, const cv_cpu_kernels *k);
/* Narrows n float32 values into dtype dt (round to nearest even). */
void cv_cpu_narrow(void *dst, cv_dtype dt, const float *src, int64_t n, const cv_cpu_kernels *k);
/* Checks the arguments common to matrix_prepare and table_prepare (src
 * [rows][cols] of a float src_dtype, stored as float32, float16 or bfloat16);
 * `what` names the caller and `noun` the stored dtype in the message. CV_OK or
 * the error code, with err set. */
int cv_cpu_check_prepare(const char *what, const char *noun, const void *src, cv_dtype src_dtype,
                         int64_t rows, int64_t cols, cv_dtype dtype, cv_err *err);

/* kv_write.c: the backend's kv_write (n tokens, threaded), and one token's k and
 * v (n_kv_heads x head_dim each) at slot (< 0: skipped), narrowed or quantized
 * to the cache's dtype. */
void cv_cpu_kv_write(cv_backend *b, cv_kv_layer *cache, const float *k, int64_t k_stride,
                     const float *v, int64_t v_stride, const int64_t *slot_mapping, int64_t n);
void cv_cpu_kv_write_token(const cv_kv_layer *cache, const float *k, const float *v, int64_t slot,
                           const cv_cpu_kernels *kern);

/* x86/vec_math.h: lane masks, horizontal sums, exp. threadpool.h,
 * cpu_features.h: the pool and the CPU's features. weight_arena.h: the
 * prepared matrices' memory. */

/* measure.c: cv_cpu_measure_peak, cv_cpu_triad, cv_cpu_read_bw (declared in
 * cpu_backend.h). */

#endif
