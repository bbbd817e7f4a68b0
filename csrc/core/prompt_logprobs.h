/* Prompt logprobs' part of the engine: the rows of one step whose logits
 * give a prompt token its logprob (engine_sample.c runs them through the LM
 * head), with the request and prompt position each row stands for. */
#ifndef CV_PROMPT_LOGPROBS_H
#define CV_PROMPT_LOGPROBS_H

#include <stdint.h>
#include "../../base/common.h"

struct cv_request;

typedef struct cv_prompt_lp_rows {
    int32_t *rows;              /* [group] hidden-state rows of one LM-head group */
    struct cv_request **req;    /* [group] their requests */
    int64_t *pos;               /* [group] the prompt position each row predicts */
} cv_prompt_lp_rows;

/* Room for groups of `group` rows. CV_ERR_NOMEM. */
int cv_prompt_lp_rows_init(cv_prompt_lp_rows *p, int64_t group, cv_err *err);
void cv_prompt_lp_rows_free(cv_prompt_lp_rows *p);

#endif
