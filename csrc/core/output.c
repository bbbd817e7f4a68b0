#include "output.h"

#include <stdlib.h>
#include <string.h>

int cv_detok_init(cv_detok *d, int64_t vocab, const cv_engine_config *cfg, const cv_model_config *mc,
                  cv_err *err) {
    memset(d, 0, sizeof *d);
    d->vocab = vocab;
    if (cfg->n_eos > CV_MAX_EOS)
        return cv_set_err(err, CV_ERR_INVALID, "eos_ids holds %d ids; at most %d are supported", cfg->n_eos,
                          CV_MAX_EOS);
    const int32_t *eos = cfg->n_eos > 0 ? cfg->eos_ids : mc->eos_ids;
    d->n_eos = cfg->n_eos > 0 ? cfg->n_eos : mc->n_eos;
    for (int i = 0; i < d->n_eos; i++) d->eos_ids[i] = eos[i];
    d->bos_id = cfg->bos_id >= 0 ? cfg->bos_id : mc->bos_id;
    d->strip_space_after_bos = cfg->strip_space_after_bos;
    d->off = calloc((size_t)vocab, sizeof *d->off);
    d->len = calloc((size_t)vocab, sizeof *d->len);
    d->special = calloc((size_t)vocab, 1);
    int64_t nb = cfg->n_token_bytes < vocab ? cfg->n_token_bytes : vocab;
    size_t total = 1;
    for (int64_t i = 0; i < nb; i++) total += cfg->token_lens[i];
    d->arena = malloc(total);
    if (!d->off || !d->len || !d->special || !d->arena) {
        cv_detok_free(d);
        return cv_set_err(err, CV_ERR_NOMEM, "out of memory for the token table");
    }
    size_t off = 0;
    for (int64_t i = 0; i < nb; i++) {
        d->off[i] = off;
        d->len[i] = (uint32_t)cfg->token_lens[i];
        if (cfg->token_lens[i]) memcpy(d->arena + off, cfg->token_bytes[i], cfg->token_lens[i]);
        off += cfg->token_lens[i];
        if (cfg->token_special) d->special[i] = cfg->token_special[i];
    }
    return CV_OK;
}

void cv_detok_free(cv_detok *d) {
    free(d->arena);
    free(d->off);
    free(d->len);
    free(d->special);
    memset(d, 0, sizeof *d);
}

int cv_detok_is_eos(const cv_detok *d, int32_t t) {
    for (int i = 0; i < d->n_eos; i++)
        if (d->eos_ids[i] == t) return 1;
    return 0;
}

void cv_detok_piece(const cv_detok *d, int32_t prev, int32_t t, int skip_special, const char **bytes,
                    size_t *n) {
    *bytes = "";
    *n = 0;
    if (t < 0 || t >= d->vocab || (skip_special && d->special[t])) return;
    const char *b = d->arena + d->off[t];
    size_t len = d->len[t];
    if (d->strip_space_after_bos && prev == d->bos_id && len > 0 && b[0] == ' ') { b++; len--; }
    *bytes = b;
    *n = len;
}

cv_event *cv_outbox_push(cv_outbox *o, int64_t request_id, int32_t seq_index, const char *text, size_t len) {
    if (!cv_grow((void **)&o->ev, &o->cap_ev, o->n_ev + 1, sizeof *o->ev)) return NULL;
    if (len && !cv_grow((void **)&o->text, &o->text_cap, o->text_len + len, 1)) return NULL;
    cv_event *ev = &o->ev[o->n_ev++];
    memset(ev, 0, sizeof *ev);
    ev->request_id = request_id;
    ev->seq_index = seq_index;
    ev->token = -1;
    ev->stop_value = -1;
    ev->text_off = o->text_len;
    ev->text_len = len;
    if (len) memcpy(o->text + o->text_len, text, len);
    o->text_len += len;
    return ev;
}

size_t cv_outbox_take(cv_outbox *o, cv_event **events, char **text) {
    size_t n = o->n_ev;
    *events = o->ev;
    *text = o->text;
    memset(o, 0, sizeof *o);
    return n;
}

void cv_outbox_free(cv_outbox *o) {
    free(o->ev);
    free(o->text);
    memset(o, 0, sizeof *o);
}

int cv_engine_outbox_init(cv_engine_outbox *o, cv_err *err) {
    memset(o, 0, sizeof *o);
    if (pthread_mutex_init(&o->lock, NULL) != 0) return cv_set_err(err, CV_ERR_NOMEM, "cannot make the outbox lock");
    o->ready = 1;
    return CV_OK;
}

void cv_engine_outbox_free(cv_engine_outbox *o) {
    cv_outbox_free(&o->events);
    free(o->trace);
    o->trace = NULL;
    o->n_trace = o->cap_trace = 0;
    if (o->ready) pthread_mutex_destroy(&o->lock);
    o->ready = 0;
}
