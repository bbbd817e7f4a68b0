/* Prompt logprobs' part of the engine: see prompt_logprobs.h. */
#include "prompt_logprobs.h"

#include <stdlib.h>

int cv_prompt_lp_rows_init(cv_prompt_lp_rows *p, int64_t group, cv_err *err) {
    p->rows = malloc((size_t)group * sizeof *p->rows);
    p->req = malloc((size_t)group * sizeof *p->req);
    p->pos = malloc((size_t)group * sizeof *p->pos);
    if (!p->rows || !p->req || !p->pos)
        return cv_set_err(err, CV_ERR_NOMEM, "out of memory for the prompt-logprob rows");
    return CV_OK;
}

void cv_prompt_lp_rows_free(cv_prompt_lp_rows *p) {
    free(p->rows);
    free(p->req);
    free(p->pos);
    p->rows = NULL;
    p->req = NULL;
    p->pos = NULL;
}
