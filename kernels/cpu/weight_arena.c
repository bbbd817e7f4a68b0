/* Prepared matrices carved out of huge-page chunks (weight_arena.h). */
#include "weight_arena.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_internal.h"

#define HUGE_PAGE ((size_t)2 << 20)
/* A chunk holds a small model whole and a large one in a few pieces; only the
 * pages written count against memory. */
#define CHUNK_BYTES ((size_t)64 << 20)
#define ALIGN 64

int cv_weight_arena_init(cv_weight_arena *a, int separate) {
    memset(a, 0, sizeof *a);
    a->separate = separate;
    if (pthread_mutex_init(&a->mu, NULL) != 0) return -1;
    a->ready = 1;
    return 0;
}

void cv_weight_arena_destroy(cv_weight_arena *a) {
    if (!a) return;
    for (size_t i = 0; i < a->n; i++) {
        free(a->chunks[i].base);
        free(a->chunks[i].used);
    }
    free(a->chunks);
    if (a->ready) pthread_mutex_destroy(&a->mu);
    memset(a, 0, sizeof *a);
}

/* The first gap of at least len bytes: its offset, and the index its span
 * takes in used[]; 0 when the chunk has none. */
static int chunk_fit(const cv_arena_chunk *c, size_t len, size_t *off, size_t *idx) {
    size_t end = 0;
    for (size_t i = 0; i <= c->n; i++) {
        const size_t next = i < c->n ? c->used[i].off : c->size;
        if (next - end >= len) {
            *off = end;
            *idx = i;
            return 1;
        }
        if (i < c->n) end = c->used[i].off + c->used[i].len;
    }
    return 0;
}

static int chunk_insert(cv_arena_chunk *c, size_t idx, size_t off, size_t len) {
    if (!cv_grow((void **)&c->used, &c->cap, c->n + 1, sizeof *c->used)) return -1;
    memmove(c->used + idx + 1, c->used + idx, (c->n - idx) * sizeof *c->used);
    c->used[idx] = (cv_arena_span){off, len};
    c->n++;
    return 0;
}

/* A new empty chunk of at least len bytes at the end of the list: its index,
 * or -1 when out of memory. */
static long chunk_add(cv_weight_arena *a, size_t len) {
    if (len > SIZE_MAX - HUGE_PAGE) return -1;
    size_t size = (len + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1);
    if (size < CHUNK_BYTES) size = CHUNK_BYTES;
    if (!cv_grow((void **)&a->chunks, &a->cap, a->n + 1, sizeof *a->chunks)) return -1;
    char *base = aligned_alloc(HUGE_PAGE, size);
    if (!base) return -1;
    cv_cpu_advise_huge(base, size);
    a->chunks[a->n] = (cv_arena_chunk){.base = base, .size = size};
    return (long)a->n++;
}

/* Chunk ci, left empty, back to the system. */
static void chunk_drop(cv_weight_arena *a, size_t ci) {
    free(a->chunks[ci].base);
    free(a->chunks[ci].used);
    memmove(a->chunks + ci, a->chunks + ci + 1, (a->n - ci - 1) * sizeof *a->chunks);
    a->n--;
}

void *cv_weight_arena_alloc(cv_weight_arena *a, size_t bytes) {
    if (bytes > SIZE_MAX - ALIGN) return NULL;
    const size_t len = bytes ? (bytes + ALIGN - 1) & ~(size_t)(ALIGN - 1) : ALIGN;
    if (a->separate) {
        void *p = aligned_alloc(ALIGN, len);
        cv_cpu_advise_huge(p, len);
        return p;
    }
    void *p = NULL;
    pthread_mutex_lock(&a->mu);
    size_t off = 0, idx = 0, ci = 0;
    while (ci < a->n && !chunk_fit(&a->chunks[ci], len, &off, &idx)) ci++;
    if (ci == a->n) {
        const long added = chunk_add(a, len);
        if (added < 0) goto done;
        ci = (size_t)added;
        off = idx = 0;
    }
    cv_arena_chunk *c = &a->chunks[ci];
    if (chunk_insert(c, idx, off, len) < 0) {
        if (c->n == 0) chunk_drop(a, ci); /* the chunk just made */
        goto done;
    }
    p = c->base + off;
done:
    pthread_mutex_unlock(&a->mu);
    return p;
}

void cv_weight_arena_free(cv_weight_arena *a, void *p) {
    if (!p) return;
    if (a->separate) {
        free(p);
        return;
    }
    const uintptr_t q = (uintptr_t)p;
    pthread_mutex_lock(&a->mu);
    for (size_t ci = 0; ci < a->n; ci++) {
        cv_arena_chunk *c = &a->chunks[ci];
        if (q < (uintptr_t)c->base || q >= (uintptr_t)c->base + c->size) continue;
        const size_t off = (size_t)(q - (uintptr_t)c->base);
        size_t lo = 0, hi = c->n; /* binary search for the span that starts at off */
        while (lo < hi) {
            const size_t mid = lo + (hi - lo) / 2;
            if (c->used[mid].off < off)
                lo = mid + 1;
            else
                hi = mid;
        }
        if (lo < c->n && c->used[lo].off == off) {
            memmove(c->used + lo, c->used + lo + 1, (c->n - lo - 1) * sizeof *c->used);
            if (--c->n == 0) chunk_drop(a, ci);
        }
        break;
    }
    pthread_mutex_unlock(&a->mu);
}

size_t cv_weight_arena_reserved(cv_weight_arena *a) {
    size_t total = 0;
    if (a->separate) return 0;
    pthread_mutex_lock(&a->mu);
    for (size_t i = 0; i < a->n; i++) total += a->chunks[i].size;
    pthread_mutex_unlock(&a->mu);
    return total;
}
