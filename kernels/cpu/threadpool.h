/* A persistent pool of worker threads for the CPU kernels.
 *
 * Created once with the backend; each operation is one parallel region:
 * cv_pool_run calls fn(arg, tid, nth) on nth threads (the caller is tid 0)
 * and returns when all have finished. Between regions the workers spin
 * briefly and then sleep on a condition variable. Regions from several
 * calling threads are serialized by a lock, so a pool may be shared. */
#ifndef CV_CPU_THREADPOOL_H
#define CV_CPU_THREADPOOL_H

#include "../../base/common.h"

typedef struct cv_pool cv_pool;

/* tid in [0, nth); nth is the number of threads running this region. */
typedef void (*cv_pool_fn)(void *arg, int tid, int nth);

/* Pool of nthreads threads in all (nthreads - 1 workers plus the caller);
 * nthreads <= 0 means one per online core. */
int cv_pool_create(cv_pool **out, int nthreads, cv_err *err);
/* Joins the workers and frees the pool (NULL is fine). */
void cv_pool_destroy(cv_pool *p);
/* Threads in the pool, the caller included. */
int cv_pool_size(const cv_pool *p);
/* Runs fn on min(nth, size) threads (nth <= 0: all); nth == 1 runs inline. */
void cv_pool_run(cv_pool *p, int nth, cv_pool_fn fn, void *arg);
/* A region whose work is claimed dynamically (fn takes items from a shared
 * counter until none are left, so it must not depend on which tids take
 * part). The caller always runs fn; a worker joins only if it arrives before
 * the caller has finished its own call, so a worker that is asleep or
 * descheduled never delays the caller. wake != 0 wakes sleeping workers
 * (worth it only for work well above a wake-up latency, ~50 us). */
void cv_pool_run_dynamic(cv_pool *p, int nth, cv_pool_fn fn, void *arg, int wake);

/* Number of online cores (at least 1). */
int cv_cpu_count(void);

#endif
