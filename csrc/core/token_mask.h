/* Token masks for constrained (guided) decoding: a mailbox between the thread
 * that runs the grammar (the caller's) and the thread that samples (the
 * engine's). The engine stays the owner of sequences; the caller only posts,
 * for each constrained completion, the bitmask of the tokens its grammar
 * allows at the next output position (bit t of word t/32 set: token t allowed).
 *
 * A slot exists per completion of a constrained request from add_request until
 * the request retires, so a mask posted for a request that already finished is
 * refused instead of kept. The caller computes the mask for position k+1 once
 * token k is out, while the engine already runs the next forward pass; the
 * sampler waits for it only when the background loop steps. */
#ifndef CV_TOKEN_MASK_H
#define CV_TOKEN_MASK_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

enum { CV_MASK_EMPTY = 0, CV_MASK_READY = 1, CV_MASK_CANCELLED = 2 };

typedef struct cv_mask_slot {
    int64_t request_id;
    int32_t seq_index;
    int state;            /* CV_MASK_* */
    int64_t pos;          /* the output position the mask is for */
    uint32_t *mask;       /* [words] */
} cv_mask_slot;

typedef struct cv_mask_box {
    pthread_mutex_t lock;
    pthread_cond_t cond;
    cv_mask_slot *slots;
    size_t n, cap;
    int64_t words;        /* (vocab + 31) / 32 */
    int stop;             /* wakes waiters for good (the loop is stopping) */
} cv_mask_box;

int cv_mask_box_init(cv_mask_box *b, int64_t vocab);
void cv_mask_box_free(cv_mask_box *b);
/* Slots for completions 0..n_seqs-1 of a constrained request; CV_ERR_NOMEM. */
int cv_mask_box_open(cv_mask_box *b, int64_t request_id, int32_t n_seqs);
/* Drops the request's slots (it retired). */
void cv_mask_box_close(cv_mask_box *b, int64_t request_id);
/* Marks the request's slots cancelled (an abort) and wakes a waiting sampler. */
void cv_mask_box_cancel(cv_mask_box *b, int64_t request_id);
/* Stores mask (b->words words) for position pos; mask NULL cancels the
 * completion (the grammar failed). Returns 0 when stored, 1 when no such
 * constrained completion is live. */
int cv_mask_box_put(cv_mask_box *b, int64_t request_id, int32_t seq_index, int64_t pos,
                    const uint32_t *mask);
/* A waiting sampler gives up after this long: a mask that never comes ends
 * its completion instead of hanging the engine. */
#define CV_MASK_WAIT_SECONDS 30

/* Copies the mask for position pos into out[words]; waits for it (at most
 * CV_MASK_WAIT_SECONDS) when wait is set. Returns 0, or -1 when the completion
 * is cancelled, has no slot, the box is stopping, or the mask is not there
 * (yet, without wait; in time, with it). */
int cv_mask_box_take(cv_mask_box *b, int64_t request_id, int32_t seq_index, int64_t pos, int wait,
                     uint32_t *out);
void cv_mask_box_set_stop(cv_mask_box *b, int stop);

#endif
