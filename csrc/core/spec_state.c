/* Speculative decoding's part of the engine: see spec_state.h. */
#include "spec_state.h"

#include <stdlib.h>
#include <string.h>

int cv_spec_state_init(cv_spec_state *s, const cv_spec_config *cfg, int64_t max_num_seqs, cv_draft_config dc,
                       cv_backend *b, const atomic_int *cancel, cv_err *err) {
    memset(s, 0, sizeof *s);
    s->cfg = *cfg;
    s->cfg.draft_model = NULL; /* the caller's string: the draft is loaded below */
    if (cfg->method == CV_SPEC_DRAFT) {
        s->draft_max_seqs = max_num_seqs;
        if (cfg->disable_by_batch_size > 0 && cfg->disable_by_batch_size < s->draft_max_seqs)
            s->draft_max_seqs = cfg->disable_by_batch_size;
        dc.path = cfg->draft_model;
        dc.max_seqs = s->draft_max_seqs;
        dc.max_k = cfg->num_tokens;
        int rc = cv_draft_create(&s->draft, &dc, b, cancel, err);
        if (rc) return rc;
    }
    int64_t seqs = s->draft_max_seqs > 0 ? s->draft_max_seqs : 1;
    int64_t k = cfg->num_tokens > 0 ? cfg->num_tokens : 1;
    s->proposals = malloc((size_t)(seqs * k) * sizeof *s->proposals);
    s->draft_seqs = malloc((size_t)seqs * sizeof *s->draft_seqs);
    s->draft_want = malloc((size_t)seqs * sizeof *s->draft_want);
    s->draft_got = malloc((size_t)seqs * sizeof *s->draft_got);
    s->plan_spec = calloc((size_t)max_num_seqs, sizeof *s->plan_spec);
    if (!s->proposals || !s->draft_seqs || !s->draft_want || !s->draft_got || !s->plan_spec)
        return cv_set_err(err, CV_ERR_NOMEM, "out of memory for speculative decoding");
    return CV_OK;
}

void cv_spec_state_free(cv_spec_state *s) {
    cv_draft_destroy(s->draft);
    free(s->proposals);
    free(s->draft_seqs);
    free(s->draft_want);
    free(s->draft_got);
    free(s->plan_spec);
    memset(s, 0, sizeof *s);
}
