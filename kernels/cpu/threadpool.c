/* Persistent thread pool: one parallel region per kernel call.
 *
 * A region is published by bumping a generation counter. Workers spin on it
 * for a short while after each region (kernels of one forward pass follow
 * each other within microseconds) and then sleep on a condition variable.
 * Every worker acknowledges every region (even one it sits out), so the job
 * fields are never rewritten while a late worker may still read them. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "threadpool.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CV_RELAX() _mm_pause()
#else
#define CV_RELAX() ((void)0)
#endif

typedef struct cv_worker {
    cv_pool *pool;
    int tid;
} cv_worker;

struct cv_pool {
    int n;                  /* threads in all, the caller included */
    int n_started;          /* workers created (n - 1 when complete) */
    pthread_t *threads;     /* [n - 1] */
    cv_worker *workers;     /* [n - 1] */
    pthread_mutex_t mu;     /* guards sleeping on wake / done */
    pthread_cond_t wake;    /* a new region (or stop) was published */
    pthread_cond_t done;    /* the last worker finished a region */
    pthread_mutex_t run_lock; /* serializes regions from several callers */
    /* hot counters on their own cache lines */
    _Alignas(64) _Atomic uint64_t gen; /* region counter */
    _Alignas(64) atomic_int pending;   /* workers that have not finished the current region */
    _Alignas(64) atomic_int n_sleeping; /* workers blocked (or about to block) on wake */
    atomic_int caller_sleeping;         /* the caller waits on done */
    atomic_int stop;
    double spin_s;          /* how long to spin before sleeping */
    /* the current region, written before gen is bumped */
    cv_pool_fn fn;
    void *arg;
    int nth;
};

int cv_cpu_count(void) {
#ifdef CPU_COUNT
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) {
        int c = CPU_COUNT(&set);
        if (c > 0) return c;
    }
#endif
    long c = sysconf(_SC_NPROCESSORS_ONLN);
    return c > 0 ? (int)c : 1;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Spins until gen differs from seen or the spin budget is spent; returns the
 * last value read. */
static uint64_t spin_for_gen(cv_pool *p, uint64_t seen) {
    uint64_t g = atomic_load_explicit(&p->gen, memory_order_acquire);
    if (g != seen || p->spin_s <= 0) return g;
    double t0 = now_s();
    for (;;) {
        for (int i = 0; i < 64; i++) {
            CV_RELAX();
            g = atomic_load_explicit(&p->gen, memory_order_acquire);
            if (g != seen) return g;
        }
        if (now_s() - t0 > p->spin_s) return g;
    }
}

static void *worker_main(void *varg) {
    cv_worker *w = varg;
    cv_pool *p = w->pool;
    uint64_t seen = 0;
    for (;;) {
        uint64_t g = spin_for_gen(p, seen);
        if (g == seen) {
            /* Announce the sleep before re-checking gen (seq_cst on both sides):
             * the caller either sees us and broadcasts, or we see its region. */
            pthread_mutex_lock(&p->mu);
            atomic_fetch_add(&p->n_sleeping, 1);
            while ((g = atomic_load(&p->gen)) == seen && !atomic_load(&p->stop))
                pthread_cond_wait(&p->wake, &p->mu);
            atomic_fetch_sub(&p->n_sleeping, 1);
            pthread_mutex_unlock(&p->mu);
        }
        if (atomic_load(&p->stop)) break;
        seen = g;
        if (w->tid < p->nth) p->fn(p->arg, w->tid, p->nth);
        if (atomic_fetch_sub(&p->pending, 1) == 1 && atomic_load(&p->caller_sleeping)) {
            pthread_mutex_lock(&p->mu);
            pthread_cond_signal(&p->done);
            pthread_mutex_unlock(&p->mu);
        }
    }
    return NULL;
}

int cv_pool_create(cv_pool **out, int nthreads, cv_err *err) {
    *out = NULL;
    if (nthreads <= 0) nthreads = cv_cpu_count();
    if (nthreads > 1024) return cv_set_err(err, CV_ERR_INVALID, "num_threads %d is more than 1024", nthreads);
    const size_t psize = (sizeof(cv_pool) + 63) & ~(size_t)63;
    cv_pool *p = aligned_alloc(64, psize); /* the struct has cache-line aligned members */
    if (p) memset(p, 0, psize);
    if (!p) return cv_set_err(err, CV_ERR_NOMEM, "out of memory for the thread pool");
    p->n = nthreads;
    p->spin_s = 50e-6;
    const char *s = getenv("CONVEYOR_SPIN_US");
    if (s && *s) p->spin_s = atof(s) * 1e-6;
    atomic_init(&p->gen, 0);
    atomic_init(&p->pending, 0);
    atomic_init(&p->stop, 0);
    atomic_init(&p->n_sleeping, 0);
    atomic_init(&p->caller_sleeping, 0);
    int mu_ok = 0, wake_ok = 0, done_ok = 0, run_ok = 0;
    if (pthread_mutex_init(&p->mu, NULL) == 0) mu_ok = 1;
    if (pthread_cond_init(&p->wake, NULL) == 0) wake_ok = 1;
    if (pthread_cond_init(&p->done, NULL) == 0) done_ok = 1;
    if (pthread_mutex_init(&p->run_lock, NULL) == 0) run_ok = 1;
    if (!mu_ok || !wake_ok || !done_ok || !run_ok) {
        if (mu_ok) pthread_mutex_destroy(&p->mu);
        if (wake_ok) pthread_cond_destroy(&p->wake);
        if (done_ok) pthread_cond_destroy(&p->done);
        if (run_ok) pthread_mutex_destroy(&p->run_lock);
        free(p);
        return cv_set_err(err, CV_ERR_NOMEM, "cannot create the thread pool's locks");
    }
    if (nthreads > 1) {
        p->threads = calloc((size_t)(nthreads - 1), sizeof *p->threads);
        p->workers = calloc((size_t)(nthreads - 1), sizeof *p->workers);
        if (!p->threads || !p->workers) {
            cv_pool_destroy(p);
            return cv_set_err(err, CV_ERR_NOMEM, "out of memory for %d worker threads", nthreads - 1);
        }
        for (int i = 0; i < nthreads - 1; i++) {
            p->workers[i].pool = p;
            p->workers[i].tid = i + 1;
            if (pthread_create(&p->threads[i], NULL, worker_main, &p->workers[i]) != 0) {
                cv_pool_destroy(p);
                return cv_set_err(err, CV_ERR_NOMEM, "cannot start worker thread %d of %d", i + 1,
                                  nthreads - 1);
            }
            p->n_started++;
        }
    }
    *out = p;
    return CV_OK;
}

void cv_pool_destroy(cv_pool *p) {
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    atomic_store(&p->stop, 1);
    atomic_fetch_add(&p->gen, 1);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->n_started; i++) pthread_join(p->threads[i], NULL);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->wake);
    pthread_cond_destroy(&p->done);
    pthread_mutex_destroy(&p->run_lock);
    free(p->threads);
    free(p->workers);
    free(p);
}

int cv_pool_size(const cv_pool *p) { return p ? p->n : 1; }

void cv_pool_run(cv_pool *p, int nth, cv_pool_fn fn, void *arg) {
    if (!p || nth == 1 || p->n == 1) {
        fn(arg, 0, 1);
        return;
    }
    if (nth <= 0 || nth > p->n) nth = p->n;
    pthread_mutex_lock(&p->run_lock);
    p->fn = fn;
    p->arg = arg;
    p->nth = nth;
    atomic_store_explicit(&p->pending, p->n - 1, memory_order_relaxed);
    atomic_fetch_add(&p->gen, 1); /* publishes the job fields */
    if (atomic_load(&p->n_sleeping) > 0) {
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->wake);
        pthread_mutex_unlock(&p->mu);
    }

    fn(arg, 0, nth);

    /* Wait for the workers: spin first, then sleep. */
    if (atomic_load_explicit(&p->pending, memory_order_acquire) != 0) {
        double t0 = now_s();
        int done = 0;
        while (!done) {
            for (int i = 0; i < 64; i++) {
                CV_RELAX();
                if (atomic_load_explicit(&p->pending, memory_order_acquire) == 0) {
                    done = 1;
                    break;
                }
            }
            if (!done && now_s() - t0 > p->spin_s) break;
        }
        if (!done) {
            /* Dekker with the last worker: flag first, then re-check pending. */
            pthread_mutex_lock(&p->mu);
            atomic_store(&p->caller_sleeping, 1);
            while (atomic_load(&p->pending) != 0) pthread_cond_wait(&p->done, &p->mu);
            atomic_store(&p->caller_sleeping, 0);
            pthread_mutex_unlock(&p->mu);
        }
    }
    pthread_mutex_unlock(&p->run_lock);
}
