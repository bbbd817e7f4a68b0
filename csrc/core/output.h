/* Request output, apart from the engine's step: the detokenizer (each token's
 * bytes, EOS ids, the llama2.c space rule) and the outbox of events the step
 * emits for the caller to take. */
#ifndef CV_OUTPUT_H
#define CV_OUTPUT_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include "../../base/common.h"
#include "../model/config.h"
#include "engine.h"

typedef struct cv_detok {
    int64_t vocab;
    char *arena;            /* every token's bytes, back to back */
    size_t *off;            /* [vocab] */
    uint32_t *len;          /* [vocab] */
    uint8_t *special;       /* [vocab] 1 for special tokens */
    int32_t eos_ids[CV_MAX_EOS];
    int n_eos;
    int32_t bos_id;         /* -1 if none */
    int strip_space_after_bos;
} cv_detok;

/* From the engine config's tokenizer facts; EOS and BOS default to the model's.
 * CV_ERR_INVALID when cfg has more than CV_MAX_EOS eos ids. */
int cv_detok_init(cv_detok *d, int64_t vocab, const cv_engine_config *cfg, const cv_model_config *mc,
                  cv_err *err);
void cv_detok_free(cv_detok *d);
int cv_detok_is_eos(const cv_detok *d, int32_t t);
/* The bytes token t adds after token prev: none for ids without bytes, nor for
 * special tokens when skip_special; the llama2.c rule drops the leading space
 * of the piece after BOS. */
void cv_detok_piece(const cv_detok *d, int32_t prev, int32_t t, int skip_special, const char **bytes,
                    size_t *n);

/* Events and the text arena they index into. Not locked: the engine holds
 * its outbox lock around every call. */
typedef struct cv_outbox {
    cv_event *ev;
    size_t n_ev, cap_ev;
    char *text;
    size_t text_len, text_cap;
} cv_outbox;

/* A zeroed event for (request_id, seq_index) carrying text[len]; NULL when out of memory. */
cv_event *cv_outbox_push(cv_outbox *o, int64_t request_id, int32_t seq_index, const char *text, size_t len);
/* Moves the events and their text out (the caller frees both with free()). */
size_t cv_outbox_take(cv_outbox *o, cv_event **events, char **text);
void cv_outbox_free(cv_outbox *o);

/* What the stepping thread hands to other threads, under one lock: the
 * events, the stats as of the last step and the step trace. */
typedef struct cv_engine_outbox {
    pthread_mutex_t lock;
    int ready;                /* lock made */
    cv_outbox events;
    cv_engine_stats stats;
    int tracing;              /* steps record their scheduled sequences in trace */
    cv_trace_entry *trace; size_t n_trace, cap_trace;
} cv_engine_outbox;

/* CV_ERR_NOMEM when the lock cannot be made. */
int cv_engine_outbox_init(cv_engine_outbox *o, cv_err *err);
void cv_engine_outbox_free(cv_engine_outbox *o);

#endif
