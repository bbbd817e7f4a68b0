/* The engine's inbox: requests and aborts that any thread queues under its
 * lock, for the stepping thread to take at the start of a step, and the
 * count of requests waiting to be scheduled that max_queued_requests bounds. */
#ifndef CV_INBOX_H
#define CV_INBOX_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include "../../base/common.h"

struct cv_request;

typedef struct cv_inbox {
    pthread_mutex_t lock;
    pthread_cond_t cond;             /* signalled on each arrival: the background loop waits on it */
    struct cv_request *head, *tail;  /* added, not yet taken by a step */
    int64_t n_requests;              /* in that list */
    int64_t *aborts; size_t n_aborts, cap_aborts; /* request ids to abort at the next step */
    int64_t arrival_counter;
    int64_t max_queued;              /* 0: no limit */
    int64_t n_queued;                /* requests added and not yet scheduled (the list included) */
    int64_t n_rejected;
    int ready;                       /* lock and cond made */
} cv_inbox;

/* An empty inbox; max_queued 0: no limit. CV_ERR_NOMEM when the lock cannot be made. */
int cv_inbox_init(cv_inbox *in, int64_t max_queued, cv_err *err);
/* Frees the abort list and the lock; the requests still queued are the
 * caller's to free first (they are the engine's type). */
void cv_inbox_free(cv_inbox *in);

#endif
