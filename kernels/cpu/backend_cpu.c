/* The CPU backend: its function table, lifetime, buffers and tables, and
 * what cpu_backend.h reports about it. */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "cpu_internal.h"
#include "quant.h"
#include "lora.h"

/* ------------------------------------------------------------------------ */
/* Introspection (cpu_backend.h)                                             */

/* Kernel families: the entries of the kernel table (kernel_table.h) that an
 * operation runs. A family's path at a level is the lowest level whose table
 * holds the same entries, so it follows the kernels without a list to keep. */
#define ENTRY(field) offsetof(cv_cpu_kernels, field), sizeof(((cv_cpu_kernels *)0)->field)
#define MAX_ENTRIES 7
static const struct {
    const char *name;
    struct {
        size_t off, size;
    } entries[MAX_ENTRIES];
} families[] = {
    {"gemm_f32", {{ENTRY(gemm[0])}, {ENTRY(gemm_np)}}},
    {"gemm_f16", {{ENTRY(gemm[2])}, {ENTRY(gemm_np)}}},
    {"gemm_bf16", {{ENTRY(gemm[1])}, {ENTRY(gemm_np)}, {ENTRY(gemm_pairs)}, {ENTRY(gemm_pairs_pf)}}},
    {"rmsnorm", {{ENTRY(rms_row)}}},
    {"rope", {{ENTRY(rope_head)}}},
    {"swiglu", {{ENTRY(swiglu_part)}}},
    {"attention", {{ENTRY(att_scores)}, {ENTRY(att_scale)}, {ENTRY(att_softmax)}, {ENTRY(att_pv)}}},
    {"convert", {{ENTRY(widen_part)}, {ENTRY(narrow_part)}}},
    /* over a bf16 cache: the bf16 entries where the level has them */
    {"attention_bf16",
     {{ENTRY(att_scores)}, {ENTRY(att_scale)}, {ENTRY(att_softmax)}, {ENTRY(att_pv)}, {ENTRY(att_round_q_bf16)},
      {ENTRY(att_scores_bf16)}, {ENTRY(att_pv_bf16)}}},
    /* over an int8 cache: the integer-dot entries where the level and CPU have them */
    {"attention_int8",
     {{ENTRY(att_scores)}, {ENTRY(att_scale)}, {ENTRY(att_softmax)}, {ENTRY(att_pv)}, {ENTRY(att_quantize_q_i8)},
      {ENTRY(att_scores_i8)}, {ENTRY(att_pv_i8)}}},
};
#define N_FAMILIES ((int)(sizeof families / sizeof families[0]))

int cv_cpu_family_count(void) { return N_FAMILIES; }

const char *cv_cpu_family_name(int i) { return i >= 0 && i < N_FAMILIES ? families[i].name : NULL; }

static int same_entries(int i, const cv_cpu_kernels *a, const cv_cpu_kernels *b) {
    for (int e = 0; e < MAX_ENTRIES && families[i].entries[e].size; e++)
        if (memcmp((const char *)a + families[i].entries[e].off, (const char *)b + families[i].entries[e].off,
                   families[i].entries[e].size) != 0)
            return 0;
    return 1;
}

cv_simd_level cv_cpu_family_path(int i, cv_simd_level level) {
    if (i < 0 || i >= N_FAMILIES || level <= CV_SIMD_SCALAR || level >= CV_SIMD_LEVELS) return CV_SIMD_SCALAR;
    cv_cpu_kernels at, below;
    cv_cpu_kernels_fill(level, &at);
    for (int l = CV_SIMD_SCALAR; l < (int)level; l++) {
        cv_cpu_kernels_fill((cv_simd_level)l, &below);
        if (same_entries(i, &at, &below)) return (cv_simd_level)l;
    }
    return level;
}

cv_cpu_shapes cv_cpu_backend_shapes(void) {
    /* a head_dim over CV_ATT_MAX_HD runs with fewer vectors per tile */
    return (cv_cpu_shapes){
        .gemm_nr = CV_NR, .gemm_mr = CV_MR, .attention_max_head_dim = CV_ATT_TILE * CV_ATT_MAX_HD};
}

int cv_cpu_backend_cores(void) { return cv_cpu_count(); }

static int is_cpu(const cv_backend *b) { return b && b->name && strcmp(b->name, "cpu") == 0; }

const char *cv_cpu_backend_simd(const cv_backend *b) {
    return is_cpu(b) ? cv_simd_name((cv_simd_level)cv_cpu_of((cv_backend *)b)->simd) : NULL;
}

int cv_cpu_backend_threads(const cv_backend *b) {
    return is_cpu(b) ? cv_cpu_of((cv_backend *)b)->nthreads : 0;
}

/* ------------------------------------------------------------------------ */
/* Buffers                                                                   */

/* Zeroed, 64-byte aligned memory, committed as it is used. Buffers of
 * CPU_MAP_MIN bytes or more (the KV cache above all) are anonymous mappings:
 * the kernel hands out zeroed pages on first touch, so nothing is written
 * now, engine start does not grow with kv_cache_memory and the resident
 * memory is what the blocks in use touched (a block is written by the KV
 * write of the step that first holds it before attention reads it). A
 * caller that wants its buffer resident writes it (forward.c: a step's
 * scratch).
 * Huge pages are advised (fewer TLB misses over a pool of GiBs) over all of
 * such a buffer: it starts on a 2 MiB boundary and spans whole 2 MiB pages,
 * its header on a small page of its own just below. Advice over only the
 * aligned interior of an unaligned mapping would leave strips of small pages
 * at its ends, which fill slowly as steps first reach a buffer's far end: a
 * rise of resident memory over thousands of requests that a leak check
 * cannot tell from a leak. A mapping larger than the kernel will ever back
 * (its overcommit rules) fails here.
 * A header just below the returned pointer says how to free it. */
#define CPU_MAP_MIN ((size_t)1 << 20)
#define CPU_HUGE_PAGE ((size_t)2 << 20)

typedef struct cpu_alloc_hdr {
    void *raw;        /* malloc'd block, or NULL for a mapping */
    void *map_base;   /* start of the mapping (raw == NULL) */
    size_t map_bytes; /* its length */
} cpu_alloc_hdr;
#define CPU_HDR_ROOM 64 /* >= sizeof(cpu_alloc_hdr), keeps the pointer 64-byte aligned */
_Static_assert(sizeof(cpu_alloc_hdr) <= CPU_HDR_ROOM, "the header fits below the pointer");

static size_t page_bytes(void) {
    const long pg = sysconf(_SC_PAGESIZE);
    return pg >= CPU_HDR_ROOM && (size_t)pg <= CPU_HUGE_PAGE ? (size_t)pg : 4096;
}

/* A mapping of whole 2 MiB pages starting on a 2 MiB boundary, with one
 * small page below it for the header; NULL when the kernel refuses it. */
static void *map_huge_aligned(size_t bytes) {
    const size_t head = page_bytes();
    if (bytes > SIZE_MAX - 3 * CPU_HUGE_PAGE) return NULL;
    const size_t body = (bytes + CPU_HUGE_PAGE - 1) & ~(CPU_HUGE_PAGE - 1), span = head + body;
    /* room to slide the body onto a boundary, the rest handed back */
    char *raw = mmap(NULL, span + CPU_HUGE_PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) return NULL;
    char *p = (char *)(((uintptr_t)raw + head + CPU_HUGE_PAGE - 1) & ~(uintptr_t)(CPU_HUGE_PAGE - 1));
    char *start = p - head, *end = start + span;
    if (start > raw) munmap(raw, (size_t)(start - raw));
    if (raw + span + CPU_HUGE_PAGE > end) munmap(end, (size_t)(raw + span + CPU_HUGE_PAGE - end));
    cv_cpu_advise_huge(p, body);
    cpu_alloc_hdr *h = (cpu_alloc_hdr *)(void *)p - 1;
    h->raw = NULL;
    h->map_base = start;
    h->map_bytes = span;
    return p;
}

static void *cpu_alloc(cv_backend *b, size_t bytes) {
    (void)b;
    if (bytes > SIZE_MAX - 2 * CPU_HDR_ROOM) return NULL;
    if (bytes >= CPU_MAP_MIN) return map_huge_aligned(bytes);
    char *raw = malloc(bytes + 2 * CPU_HDR_ROOM);
    if (!raw) return NULL;
    uintptr_t aligned = ((uintptr_t)raw + CPU_HDR_ROOM + 63) & ~(uintptr_t)63;
    cpu_alloc_hdr *h = (cpu_alloc_hdr *)aligned - 1;
    h->raw = raw;
    h->map_base = NULL;
    h->map_bytes = 0;
    memset((void *)aligned, 0, bytes);
    return (void *)aligned;
}

static void cpu_free(cv_backend *b, void *p) {
    (void)b;
    if (!p) return;
    const cpu_alloc_hdr *h = (const cpu_alloc_hdr *)p - 1;
    if (h->raw) {
        free(h->raw);
        return;
    }
    munmap(h->map_base, h->map_bytes);
}

static void cpu_copy(cv_backend *b, void *dst, const void *src, size_t bytes) {
    (void)b;
    if (bytes) memmove(dst, src, bytes);
}

static void cpu_sync(cv_backend *b) { (void)b; }

/* host_parallel: items claimed one at a time from a shared counter. */
typedef struct host_job {
    _Alignas(64) atomic_llong next;
    int64_t n;
    void (*fn)(void *arg, int64_t i, int worker);
    void *arg;
} host_job;

static void host_items(void *p, int tid, int nth) {
    (void)nth;
    host_job *j = p;
    for (;;) {
        const int64_t i = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);
        if (i >= j->n) return;
        j->fn(j->arg, i, tid);
    }
}

static void cpu_host_parallel(cv_backend *b, int64_t n, void (*fn)(void *arg, int64_t i, int worker),
                              void *arg) {
    if (n <= 0) return;
    host_job j = {.n = n, .fn = fn, .arg = arg};
    atomic_init(&j.next, 0);
    cv_pool_run_dynamic(cv_cpu_of(b)->pool, n < INT32_MAX ? (int)n : 0, host_items, &j, 1);
}

/* A copy split evenly across the pool's threads: a large table's fresh pages
 * are faulted in (and zeroed by the kernel) by all of them, not one. */
typedef struct copy_job {
    char *dst;
    const char *src;
    size_t bytes;
} copy_job;

static void copy_part(void *arg, int tid, int nth) {
    const copy_job *j = arg;
    const size_t a = j->bytes / (size_t)nth * (size_t)tid;
    const size_t z = tid == nth - 1 ? j->bytes : j->bytes / (size_t)nth * (size_t)(tid + 1);
    memcpy(j->dst + a, j->src + a, z - a);
}

static int cpu_table_prepare(cv_backend *b, cv_table *out, const void *src, cv_dtype src_dtype,
                             int64_t rows, int64_t cols, cv_dtype dtype, cv_err *err) {
    cv_cpu *c = cv_cpu_of(b);
    int rc = CV_OK;
    void *data = NULL;
    float *row = NULL;
    memset(out, 0, sizeof *out);
    /* a quantized table is kept as it is stored; rows are dequantized on lookup */
    const int quant = cv_dtype_is_quant(dtype) && src_dtype == dtype && src && rows > 0 && cols > 0 &&
                      cols % (int64_t)cv_quant_block_elems(dtype) == 0;
    if (!quant) rc = cv_cpu_check_prepare("table_prepare", "dtype", src, src_dtype, rows, cols, dtype, err);
    if (rc) goto done;
    size_t elems, bytes;
    if (!cv_mul_size((size_t)rows, (size_t)cols, &elems) ||
        (bytes = cv_dtype_bytes(dtype, elems)) == 0) {
        rc = cv_set_err(err, CV_ERR_NOMEM, "table_prepare: [%lld][%lld] is too large",
                        (long long)rows, (long long)cols);
        goto done;
    }
    data = cpu_alloc(b, bytes);
    row = malloc((size_t)cols * sizeof(float));
    if (!data || !row) {
        rc = cv_set_err(err, CV_ERR_NOMEM, "table_prepare: out of memory for [%lld][%lld] %s",
                        (long long)rows, (long long)cols, cv_dtype_name(dtype));
        goto done;
    }
    const size_t ssz = cv_dtype_size(src_dtype), dsz = cv_dtype_size(dtype);
    if (quant) {
        copy_job j = {.dst = data, .src = src, .bytes = bytes};
        cv_pool_run(c->pool, cv_threads_for(c, (double)bytes, (double)(1 << 22)), copy_part, &j);
    }
    for (int64_t r = 0; r < rows && !quant; r++) {
        const char *s = (const char *)src + (size_t)r * (size_t)cols * ssz;
        char *d = (char *)data + (size_t)r * (size_t)cols * dsz;
        if (src_dtype == dtype) {
            memcpy(d, s, (size_t)cols * dsz);
            continue;
        }
        cv_convert_to_f32(row, s, src_dtype, (size_t)cols);
        cv_cpu_narrow(d, dtype, row, cols, &c->kern);
    }
    out->data = data;
    out->dtype = dtype;
    out->rows = rows;
    out->cols = cols;
    out->bytes = bytes;
    data = NULL;
done:
    cpu_free(b, data);
    free(row);
    return rc;
}

static void cpu_table_free(cv_backend *b, cv_table *t) {
    (void)b;
    if (!t) return;
    cpu_free(b, t->data);
    memset(t, 0, sizeof *t);
}

/* ------------------------------------------------------------------------ */
/* Lifetime                                                                  */

/* Cache size from the C library (level 3: L2, 4: L3), or def when unknown. */
static size_t cache_size(int which, size_t def) {
    long v = -1;
#if defined(_SC_LEVEL2_CACHE_SIZE) && defined(_SC_LEVEL3_CACHE_SIZE)
    v = sysconf(which == 3 ? _SC_LEVEL2_CACHE_SIZE : _SC_LEVEL3_CACHE_SIZE);
#else
    (void)which;
#endif
    return v > 0 ? (size_t)v : def;
}

/* Integer from the environment, clamped to [lo, hi]; def when unset. */
static int64_t env_int(const char *name, int64_t def, int64_t lo, int64_t hi) {
    const char *s = getenv(name);
    if (!s || !*s) return def;
    char *end;
    long long v = strtoll(s, &end, 10);
    if (end == s) return def;
    return v < lo ? lo : (v > hi ? hi : v);
}

/* A quantized table is dequantized row by row (quant.c), a float one widened (elementwise.c). */
static void cpu_embedding(cv_backend *b, float *out, const int32_t *tokens, int64_t n, const cv_table *table) {
    if (cv_dtype_is_quant(table->dtype))
        cv_cpu_qembedding(b, out, tokens, n, table);
    else
        cv_cpu_embedding(b, out, tokens, n, table);
}

static void cpu_destroy(cv_backend *b) {
    if (!b) return;
    cv_cpu *c = b->ctx;
    if (c) {
        cv_pool_destroy(c->pool);
        free(c->att_scratch);
        free(c->att_partials);
        free(c->att_counters);
        free(c->gemm_xpack);
        free(c->gemm_xrows);
        free(c->qx);
        cv_weight_arena_destroy(&c->weights);
        for (int i = 0; i < 2; i++) {
            free(c->rope_tables[i].cs);
            free(c->rope_tables[i].pos);
            free(c->rope_tables[i].freq);
        }
        free(c);
    }
    free(b);
}

/* exact != 0: GEMMs over bf16 weights read float32 activations on every level
 * (on AVX512_BF16 the vdpbf16ps path, which rounds them to bf16, is not used). */
static void cpu_set_exact_activations(cv_backend *b, int exact) {
    if (is_cpu(b)) cv_cpu_of(b)->exact_activations = exact != 0;
}

cv_backend *cv_cpu_backend_create(int num_threads, int force_scalar, cv_err *err) {
    return cv_cpu_backend_create_simd(num_threads, force_scalar ? "scalar" : NULL, err);
}

cv_backend *cv_cpu_backend_create_simd(int num_threads, const char *simd, cv_err *err) {
    cv_simd_level level;
    const char *asked = simd;
    const int rc = simd ? cv_simd_resolve(simd, &level) : cv_simd_from_env(&level, &asked);
    if (rc != CV_SIMD_OK) {
        const char *src = simd ? "simd" : "CONVEYOR_SIMD";
        if (rc == CV_SIMD_UNKNOWN)
            cv_set_err(err, CV_ERR_INVALID,
                       "%s='%s' is not a SIMD level (scalar, avx2, avx512 or avx512_bf16)", src, asked);
        else
            cv_set_err(err, CV_ERR_INVALID, "%s='%s': this CPU does not support it (best: %s)", src,
                       asked, cv_simd_name(cv_simd_best()));
        return NULL;
    }
    cv_backend *b = calloc(1, sizeof *b); /* fields this file does not know stay NULL */
    cv_cpu *c = calloc(1, sizeof *c);
    if (!b || !c) {
        free(b);
        free(c);
        cv_set_err(err, CV_ERR_NOMEM, "out of memory for the CPU backend");
        return NULL;
    }
    b->name = "cpu";
    b->ctx = c;
    c->simd = (int)level;
    cv_cpu_kernels_fill(level, &c->kern);
    c->qlevel = cv_qlevel_best((int)level);
    if (cv_pool_create(&c->pool, num_threads, err) < 0) {
        cpu_destroy(b);
        return NULL;
    }
    c->nthreads = cv_pool_size(c->pool);
    const size_t nt = (size_t)c->nthreads;
    c->att_scratch_floats = cv_cpu_att_scratch_floats();
    c->att_partial_floats = cv_cpu_att_partial_floats();
    c->att_scratch = aligned_alloc(64, nt * c->att_scratch_floats * sizeof(float));
    c->att_partial_units = 4 * nt;
    c->att_partials = aligned_alloc(64, c->att_partial_units * c->att_partial_floats * sizeof(float));
    c->att_counters = calloc(2 * nt, sizeof *c->att_counters);
    c->l2_bytes = cache_size(3, 1 << 20);
    c->l3_bytes = cache_size(4, 8 << 20);
    if (c->l3_bytes > ((size_t)64 << 20)) c->l3_bytes = (size_t)64 << 20; /* VMs report odd sizes */
    c->gemm_order = (int)env_int("CONVEYOR_GEMM_ORDER", -1, -1, 1);
    c->gemm_kc = env_int("CONVEYOR_GEMM_KC", CV_GEMM_KC, 16, 1 << 20);
    c->gemm_xblock = env_int("CONVEYOR_GEMM_XBLOCK", CV_GEMM_XBLOCK, 1024, 1 << 26);
    c->gemm_pack = (int)env_int("CONVEYOR_GEMM_PACK", 1, 0, 1);
    const int reserved = cv_cpu_gemm_reserve(c, 0) == CV_OK;
    /* a buffer per matrix under ASan, and with CONVEYOR_WEIGHT_ARENA=0 (for measurements) */
    const int separate = CV_UNDER_ASAN || env_int("CONVEYOR_WEIGHT_ARENA", 1, 0, 1) == 0;
    const int arena = cv_weight_arena_init(&c->weights, separate) == 0;
    if (!c->att_scratch || !c->att_partials || !c->att_counters || !reserved || !arena) {
        cpu_destroy(b);
        cv_set_err(err, CV_ERR_NOMEM, "out of memory for the scratch buffers of %d threads",
                   c->nthreads);
        return NULL;
    }
    b->matrix_prepare = cv_cpu_matrix_prepare;
    b->matrix_free = cv_cpu_matrix_free;
    b->matrix_rows = cv_cpu_matrix_rows;
    b->table_prepare = cpu_table_prepare;
    b->table_free = cpu_table_free;
    b->alloc = cpu_alloc;
    b->free = cpu_free;
    b->to_device = cpu_copy;
    b->to_host = cpu_copy;
    b->gemm = cv_cpu_gemm;
    b->rmsnorm = cv_cpu_rmsnorm;
    b->rope = cv_cpu_rope;
    b->swiglu = cv_cpu_swiglu;
    b->head_rmsnorm = cv_cpu_head_rmsnorm;
    b->add_rmsnorm = cv_cpu_add_rmsnorm;
    b->geglu = cv_cpu_geglu;
    b->scale = cv_cpu_scale;
    b->embedding = cpu_embedding;
    b->kv_write = cv_cpu_kv_write;
    b->paged_attention = cv_cpu_paged_attention;
    b->rope_kv_write = cv_cpu_rope_kv_write;
    b->rmsnorm_gemm = cv_cpu_rmsnorm_gemm;
    b->swiglu_gemm = cv_cpu_swiglu_gemm;
    b->lora_sgmv = cv_cpu_lora_sgmv;
    b->host_parallel = cpu_host_parallel;
    b->host_workers = c->nthreads;
    b->sync = cpu_sync;
    b->set_exact_activations = cpu_set_exact_activations;
    b->destroy = cpu_destroy;
    return b;
}
