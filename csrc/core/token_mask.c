#include "token_mask.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../../base/common.h"

int cv_mask_box_init(cv_mask_box *b, int64_t vocab) {
    memset(b, 0, sizeof *b);
    b->words = (vocab + 31) / 32;
    if (pthread_mutex_init(&b->lock, NULL)) return CV_ERR_NOMEM;
    if (pthread_cond_init(&b->cond, NULL)) {
        pthread_mutex_destroy(&b->lock);
        return CV_ERR_NOMEM;
    }
    return CV_OK;
}

void cv_mask_box_free(cv_mask_box *b) {
    for (size_t i = 0; i < b->n; i++) free(b->slots[i].mask);
    free(b->slots);
    pthread_mutex_destroy(&b->lock);
    pthread_cond_destroy(&b->cond);
    memset(b, 0, sizeof *b);
}

/* Caller holds the lock. */
static cv_mask_slot *find(cv_mask_box *b, int64_t request_id, int32_t seq_index) {
    for (size_t i = 0; i < b->n; i++)
        if (b->slots[i].request_id == request_id && b->slots[i].seq_index == seq_index) return &b->slots[i];
    return NULL;
}

int cv_mask_box_open(cv_mask_box *b, int64_t request_id, int32_t n_seqs) {
    int rc = CV_OK;
    pthread_mutex_lock(&b->lock);
    if (!cv_grow((void **)&b->slots, &b->cap, b->n + (size_t)n_seqs, sizeof *b->slots)) {
        rc = CV_ERR_NOMEM;
        goto done;
    }
    size_t first = b->n;
    for (int32_t i = 0; i < n_seqs; i++) {
        uint32_t *m = malloc((size_t)b->words * sizeof *m);
        if (!m) {
            for (size_t k = first; k < b->n; k++) free(b->slots[k].mask);
            b->n = first;
            rc = CV_ERR_NOMEM;
            goto done;
        }
        b->slots[b->n++] = (cv_mask_slot){.request_id = request_id, .seq_index = i, .mask = m, .pos = -1};
    }
done:
    pthread_mutex_unlock(&b->lock);
    return rc;
}

void cv_mask_box_close(cv_mask_box *b, int64_t request_id) {
    pthread_mutex_lock(&b->lock);
    size_t k = 0;
    for (size_t i = 0; i < b->n; i++) {
        if (b->slots[i].request_id == request_id) free(b->slots[i].mask);
        else b->slots[k++] = b->slots[i];
    }
    b->n = k;
    pthread_mutex_unlock(&b->lock);
}

void cv_mask_box_cancel(cv_mask_box *b, int64_t request_id) {
    pthread_mutex_lock(&b->lock);
    for (size_t i = 0; i < b->n; i++)
        if (b->slots[i].request_id == request_id) b->slots[i].state = CV_MASK_CANCELLED;
    pthread_cond_broadcast(&b->cond);
    pthread_mutex_unlock(&b->lock);
}

int cv_mask_box_put(cv_mask_box *b, int64_t request_id, int32_t seq_index, int64_t pos,
                    const uint32_t *mask) {
    pthread_mutex_lock(&b->lock);
    cv_mask_slot *s = find(b, request_id, seq_index);
    if (s && s->state != CV_MASK_CANCELLED) {
        if (mask) {
            memcpy(s->mask, mask, (size_t)b->words * sizeof *mask);
            s->pos = pos;
            s->state = CV_MASK_READY;
        } else {
            s->state = CV_MASK_CANCELLED;
        }
        pthread_cond_broadcast(&b->cond);
    }
    pthread_mutex_unlock(&b->lock);
    return s ? 0 : 1;
}

int cv_mask_box_take(cv_mask_box *b, int64_t request_id, int32_t seq_index, int64_t pos, int wait,
                     uint32_t *out) {
    int rc = -1;
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_sec += CV_MASK_WAIT_SECONDS;
    pthread_mutex_lock(&b->lock);
    for (;;) {
        cv_mask_slot *s = find(b, request_id, seq_index); /* slots move when others close: look again */
        if (!s || s->state == CV_MASK_CANCELLED) break;
        if (s->state == CV_MASK_READY && s->pos == pos) {
            memcpy(out, s->mask, (size_t)b->words * sizeof *out);
            s->state = CV_MASK_EMPTY;
            rc = 0;
            break;
        }
        if (!wait || b->stop) break;
        if (pthread_cond_timedwait(&b->cond, &b->lock, &deadline) == ETIMEDOUT) wait = 0; /* one last look */
    }
    pthread_mutex_unlock(&b->lock);
    return rc;
}

void cv_mask_box_set_stop(cv_mask_box *b, int stop) {
    pthread_mutex_lock(&b->lock);
    b->stop = stop;
    pthread_cond_broadcast(&b->cond);
    pthread_mutex_unlock(&b->lock);
}
