/* The memory of one CPU backend's prepared matrices: carved out of a few
 * large chunks, 2 MiB-aligned and advised for huge pages, so that a small
 * matrix (a small model's QKV, output and down projections are 0.7-1.8 MB
 * each) streams through huge pages like a large one instead of 4 KiB pages.
 * A buffer of its own gets huge pages only over its 2 MiB-aligned interior,
 * which such a matrix does not have.
 *
 * First fit over the chunks' free gaps, so that the space of a freed matrix
 * is used again (a backend that lives on while matrices come and go, as the
 * kernel test hooks' do); a chunk left empty goes back to the system.
 * Thread-safe. An arena made `separate` gives every allocation a buffer of
 * its own instead: the backend's is, under AddressSanitizer (so that a kernel
 * reading past a matrix is caught rather than reading its neighbour) and
 * with CONVEYOR_WEIGHT_ARENA=0. */
#ifndef CV_WEIGHT_ARENA_H
#define CV_WEIGHT_ARENA_H

#include <pthread.h>
#include <stddef.h>

/* 1 in a build with AddressSanitizer. */
#if defined(__SANITIZE_ADDRESS__)
#define CV_UNDER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define CV_UNDER_ASAN 1
#endif
#endif
#ifndef CV_UNDER_ASAN
#define CV_UNDER_ASAN 0
#endif

typedef struct cv_arena_span {
    size_t off, len; /* bytes [off, off + len) of its chunk are in use */
} cv_arena_span;

typedef struct cv_arena_chunk {
    char *base;
    size_t size;
    cv_arena_span *used; /* [n] in order of off */
    size_t n, cap;
} cv_arena_chunk;

typedef struct cv_weight_arena {
    pthread_mutex_t mu;
    cv_arena_chunk *chunks; /* [n] */
    size_t n, cap;
    int separate;           /* 1: a buffer of its own per allocation */
    int ready;              /* mu initialised */
} cv_weight_arena;

/* separate: 1 gives every allocation a buffer of its own. 0, or -1 when the
 * mutex cannot be made. */
int cv_weight_arena_init(cv_weight_arena *a, int separate);
/* Frees every chunk. Allocations still live go with them, except separate
 * buffers, which only cv_weight_arena_free frees (every matrix is freed
 * before its backend). Safe on a zeroed arena that was never initialised. */
void cv_weight_arena_destroy(cv_weight_arena *a);
/* 64-byte aligned, not zeroed, not yet touched where it is fresh: NULL when
 * out of memory. */
void *cv_weight_arena_alloc(cv_weight_arena *a, size_t bytes);
/* p from cv_weight_arena_alloc of this arena, or NULL. */
void cv_weight_arena_free(cv_weight_arena *a, void *p);
/* Bytes of chunks held (for tests and memory reports). */
size_t cv_weight_arena_reserved(cv_weight_arena *a);

#endif
