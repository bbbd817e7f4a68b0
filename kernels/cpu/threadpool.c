/* Persistent thread pool: one parallel region per kernel call.
 *
 * A region is published by storing a new state word (generation, thread
 * count, open). Workers spin on it for a short while after each region
 * (kernels of one forward pass follow each other within microseconds) and
 * then sleep on a condition variable. A worker enters a region by counting
 * itself active in the state word (compare-and-swap), and only then reads the
 * job fields; the caller rewrites them only once no worker is active, so a
 * late worker never reads a half-written job.
 *
 * Every spin yields the core between its short bursts of pauses: with more
 * runnable threads than cores (another process, two engines, Ray replicas on
 * one machine) the thread being waited for may be queued on this very core,
 * and a pure spin would hold it off for the whole spin budget. With the cores
 * to spare, sched_yield returns at once.
 *
 * Static regions (cv_pool_run) wait for every worker with tid < nth. Dynamic
 * regions (cv_pool_run_dynamic) are closed by the caller as soon as its own
 * call returns: it then waits only for workers already inside. */
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

/* State word: bits 0-15 nth, 16-30 active workers, 31 closed, 32-63 generation. */
#define ST_NTH(s) ((int)((s) & 0xffffu))
#define ST_ACTIVE_ONE ((uint64_t)1 << 16)
#define ST_ACTIVE(s) ((int)(((s) >> 16) & 0x7fffu))
#define ST_CLOSED ((uint64_t)1 << 31)
#define ST_GEN(s) ((uint32_t)((s) >> 32))

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
    uint32_t gen;           /* generation of the last region (caller side, under run_lock) */
    /* hot counters on their own cache lines */
    _Alignas(64) _Atomic uint64_t state; /* see ST_* */
    _Alignas(64) atomic_int pending;     /* static region: workers that have not finished */
    _Alignas(64) atomic_int n_sleeping;  /* workers blocked (or about to block) on wake */
    atomic_int caller_sleeping;          /* the caller waits on done */
    atomic_int stop;
    double spin_s;          /* how long to spin before sleeping */
    /* the current region, written while no worker is active */
    cv_pool_fn fn;
    void *arg;
    int dynamic;
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

/* Spins until the generation differs from seen or the spin budget is spent;
 * returns the last state read. */
static uint64_t spin_for_gen(cv_pool *p, uint32_t seen) {
    uint64_t s = atomic_load_explicit(&p->state, memory_order_acquire);
    if (ST_GEN(s) != seen || p->spin_s <= 0) return s;
    double t0 = now_s();
    for (;;) {
        for (int i = 0; i < 64; i++) {
            CV_RELAX();
            s = atomic_load_explicit(&p->state, memory_order_acquire);
            if (ST_GEN(s) != seen) return s;
        }
        if (now_s() - t0 > p->spin_s) return s;
        sched_yield(); /* a thread waiting for this core (more threads than cores) runs now */
    }
}

/* Wakes the caller if it sleeps on done. */
static void signal_caller(cv_pool *p) {
    if (!atomic_load(&p->caller_sleeping)) return;
    pthread_mutex_lock(&p->mu);
    pthread_cond_signal(&p->done);
    pthread_mutex_unlock(&p->mu);
}

static void *worker_main(void *varg) {
    cv_worker *w = varg;
    cv_pool *p = w->pool;
    const int tid = w->tid;
    uint32_t seen = 0;
    cv_set_thread_name("cv-worker");
    for (;;) {
        uint64_t s = spin_for_gen(p, seen);
        if (ST_GEN(s) == seen) {
            /* Announce the sleep before re-checking (seq_cst on both sides):
             * the caller either sees us and broadcasts, or we see its region. */
            pthread_mutex_lock(&p->mu);
            atomic_fetch_add(&p->n_sleeping, 1);
            while (ST_GEN(s = atomic_load(&p->state)) == seen && !atomic_load(&p->stop))
                pthread_cond_wait(&p->wake, &p->mu);
            atomic_fetch_sub(&p->n_sleeping, 1);
            pthread_mutex_unlock(&p->mu);
        }
        if (atomic_load(&p->stop)) break;
        seen = ST_GEN(s);
        /* Enter the region unless it is closed or does not need us. */
        int entered = 0;
        while (ST_GEN(s) == seen && !(s & ST_CLOSED) && tid < ST_NTH(s)) {
            if (atomic_compare_exchange_weak(&p->state, &s, s + ST_ACTIVE_ONE)) {
                entered = 1;
                break;
            }
        }
        if (!entered) continue; /* a newer region is picked up by the next spin */
        const int dynamic = p->dynamic;
        p->fn(p->arg, tid, ST_NTH(s));
        const uint64_t prev = atomic_fetch_sub(&p->state, ST_ACTIVE_ONE);
        if (dynamic) {
            if ((prev & ST_CLOSED) && ST_ACTIVE(prev) == 1) signal_caller(p);
        } else if (atomic_fetch_sub(&p->pending, 1) == 1) {
            signal_caller(p);
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
    atomic_init(&p->state, ST_CLOSED);
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
    p->gen++;
    atomic_store(&p->state, ((uint64_t)p->gen << 32) | ST_CLOSED);
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

/* Spins up to spin_s, then sleeps on done, until cond(p) holds. */
static void wait_until(cv_pool *p, int (*cond)(cv_pool *)) {
    if (cond(p)) return;
    double t0 = now_s();
    for (;;) {
        for (int i = 0; i < 64; i++) {
            CV_RELAX();
            if (cond(p)) return;
        }
        if (now_s() - t0 > p->spin_s) break;
        sched_yield(); /* as in spin_for_gen: the thread we wait for may want this core */
    }
    /* Dekker with the last worker: flag first, then re-check. */
    pthread_mutex_lock(&p->mu);
    atomic_store(&p->caller_sleeping, 1);
    while (!cond(p)) pthread_cond_wait(&p->done, &p->mu);
    atomic_store(&p->caller_sleeping, 0);
    pthread_mutex_unlock(&p->mu);
}

static int static_done(cv_pool *p) { return atomic_load(&p->pending) == 0; }
static int dynamic_done(cv_pool *p) { return ST_ACTIVE(atomic_load(&p->state)) == 0; }

/* Publishes a region of nth threads (run_lock held, no worker active). */
static void publish(cv_pool *p, int nth, cv_pool_fn fn, void *arg, int dynamic, int wake) {
    p->fn = fn;
    p->arg = arg;
    p->dynamic = dynamic;
    atomic_store_explicit(&p->pending, nth - 1, memory_order_relaxed);
    p->gen++;
    atomic_store(&p->state, ((uint64_t)p->gen << 32) | (uint64_t)nth); /* publishes the fields */
    if (wake && atomic_load(&p->n_sleeping) > 0) {
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->wake);
        pthread_mutex_unlock(&p->mu);
    }
}

void cv_pool_run(cv_pool *p, int nth, cv_pool_fn fn, void *arg) {
    if (!p || nth == 1 || p->n == 1) {
        fn(arg, 0, 1);
        return;
    }
    if (nth <= 0 || nth > p->n) nth = p->n;
    pthread_mutex_lock(&p->run_lock);
    publish(p, nth, fn, arg, 0, 1);
    fn(arg, 0, nth);
    wait_until(p, static_done);
    atomic_fetch_or(&p->state, ST_CLOSED);
    pthread_mutex_unlock(&p->run_lock);
}

void cv_pool_run_dynamic(cv_pool *p, int nth, cv_pool_fn fn, void *arg, int wake) {
    if (!p || nth == 1 || p->n == 1) {
        fn(arg, 0, 1);
        return;
    }
    if (nth <= 0 || nth > p->n) nth = p->n;
    pthread_mutex_lock(&p->run_lock);
    publish(p, nth, fn, arg, 1, wake);
    fn(arg, 0, nth);
    /* No worker may enter from now on; wait for those inside. */
    atomic_fetch_or(&p->state, ST_CLOSED);
    wait_until(p, dynamic_done);
    pthread_mutex_unlock(&p->run_lock);
}
