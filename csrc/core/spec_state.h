/* Speculative decoding's part of the engine: the config, the draft model
 * (method CV_SPEC_DRAFT) and the buffers one step's proposals pass through. */
#ifndef CV_SPEC_STATE_H
#define CV_SPEC_STATE_H

#include <stdatomic.h>
#include <stdint.h>
#include "../../kernels/backend.h"
#include "../../base/common.h"
#include "draft.h"
#include "sequence.h"
#include "speculative.h"

typedef struct cv_spec_state {
    cv_spec_config cfg;           /* method CV_SPEC_NONE: off; draft_model NULL once loaded */
    int32_t *proposals;           /* [draft_max_seqs or 1][cfg.num_tokens] */
    cv_draft *draft;              /* CV_SPEC_DRAFT: the draft model, else NULL */
    int64_t draft_max_seqs;       /* sequences the draft proposes for in one step */
    cv_sequence **draft_seqs;     /* [draft_max_seqs] this step's */
    int64_t *draft_want, *draft_got; /* [draft_max_seqs] */
    int32_t *plan_spec;           /* [max_num_seqs] proposals each plan entry verifies (trace) */
} cv_spec_state;

/* From a checked config (cv_spec_config_check), for steps of max_num_seqs
 * sequences. A draft model is loaded from dc (its max_seqs set here: at most
 * disable_by_batch_size) on backend b. Errors as cv_draft_create's, or
 * CV_ERR_NOMEM; free with cv_spec_state_free either way. */
int cv_spec_state_init(cv_spec_state *s, const cv_spec_config *cfg, int64_t max_num_seqs, cv_draft_config dc,
                       cv_backend *b, const atomic_int *cancel, cv_err *err);
void cv_spec_state_free(cv_spec_state *s);

#endif
