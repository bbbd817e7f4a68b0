/* The engine's inbox: see inbox.h. */
#include "inbox.h"

#include <stdlib.h>
#include <string.h>

int cv_inbox_init(cv_inbox *in, int64_t max_queued, cv_err *err) {
    memset(in, 0, sizeof *in);
    in->max_queued = max_queued;
    if (pthread_mutex_init(&in->lock, NULL) != 0) return cv_set_err(err, CV_ERR_NOMEM, "cannot make the inbox lock");
    if (pthread_cond_init(&in->cond, NULL) != 0) {
        pthread_mutex_destroy(&in->lock);
        return cv_set_err(err, CV_ERR_NOMEM, "cannot make the inbox condition");
    }
    in->ready = 1;
    return CV_OK;
}

void cv_inbox_free(cv_inbox *in) {
    free(in->aborts);
    in->aborts = NULL;
    in->n_aborts = in->cap_aborts = 0;
    if (in->ready) {
        pthread_mutex_destroy(&in->lock);
        pthread_cond_destroy(&in->cond);
        in->ready = 0;
    }
}
