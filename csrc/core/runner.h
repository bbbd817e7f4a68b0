/* Turns a scheduler plan into the flat batch the model runs (struct of arrays).
 * Reads the sequences' block tables; never writes them. */
#ifndef CV_RUNNER_H
#define CV_RUNNER_H

#include <stdint.h>
#include "../../base/common.h"
#include "../model/model.h"
#include "scheduler.h"

typedef struct cv_runner {
    cv_batch batch;               /* host arrays sized for the limits below */
    int32_t *sample_plan_index;   /* [max_rows] plan index of each logits row */
    int64_t max_tokens, max_seqs, max_rows, max_blocks_per_seq, block_size;
} cv_runner;

/* max_rows: logits rows a step may want (max_seqs, or more under
 * speculative decoding: a sequence with proposals wants one per proposal + 1). */
int cv_runner_init(cv_runner *r, int64_t max_tokens, int64_t max_seqs, int64_t max_rows,
                   int64_t max_blocks_per_seq, int64_t block_size, cv_err *err);
void cv_runner_free(cv_runner *r);

/* Flattens plan into r->batch. A sequence gets a logits row when this step
 * computes its last held token (its prompt is done, or it is decoding), and
 * one more for each of its proposals (seq->n_spec): the rows that verify them,
 * consecutive and in position order. */
int cv_runner_build(cv_runner *r, const cv_sched_output *plan, cv_err *err);

#endif
