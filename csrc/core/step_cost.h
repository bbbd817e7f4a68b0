/* An online model of a step's time, t = A + B_d * decode tokens + B_p * prompt
 * tokens + B_c * context tokens the decodes attend to, fitted by least squares
 * with forgetting over the steps the engine ran, and the batch it implies (a
 * decode then costs B_d + B_c * its context; below, B_d stands for that sum): where a step's time grows with its rows (a
 * compute-bound CPU), decoding D sequences gives D / (A + B_d * D) tokens per
 * second, which approaches its limit 1 / B_d as D grows while every running
 * sequence's step time keeps growing. The knee batch k * A / B_d reaches
 * k / (k + 1) of that limit; admitting beyond it buys little throughput for a
 * proportional cost in latency. Where A dominates (a memory-bound GPU), the
 * knee lies beyond any batch the cache holds and changes nothing. */
#ifndef CV_STEP_COST_H
#define CV_STEP_COST_H

#include <stdint.h>

/* k: the knee reaches k / (k + 1) = 80% of the decode rate limit. Chosen by
 * measurement (docs/dev/admission.md). */
#define CV_STEP_COST_KNEE 4.0
/* Steps observed before the model is used. */
#define CV_STEP_COST_MIN_STEPS 16
/* The knee is used once its relative standard error, from the fit's
 * residuals, is below this. */
#define CV_STEP_COST_MAX_KNEE_ERROR 0.15
/* While the knee is not pinned down and requests wait, every this many steps the
 * engine holds back half of a step's decodes (cv_scheduler_limit_next_decodes): a step of another
 * batch size separates A from B_d. It costs about one step's fixed time A. */
#define CV_STEP_COST_PROBE_EVERY 8
/* Decodes a step needs before holding half of them back tells anything. */
#define CV_STEP_COST_PROBE_MIN_DECODES 8

#define CV_STEP_COST_TERMS 4

typedef struct cv_step_cost {
    /* Sums over the steps, each weighted by DECAY^age / t^2: a step's timing
     * noise is a fraction of its time, so a long prompt step says less about A
     * than a short decode step does. */
    double m[CV_STEP_COST_TERMS][CV_STEP_COST_TERMS]; /* x x^T, x = (1, decodes, prompt tokens,
                                                         kilo-tokens of the decodes' contexts) */
    double v[CV_STEP_COST_TERMS];                     /* x t */
    double tt;      /* t^2 */
    /* For the fit's standard errors: sums of DECAY^age, DECAY^(2 age), and
     * DECAY^(2 age) / t^2. */
    double age, age_sq, age_sq_w;
    int64_t n;          /* steps observed */
    double context_now; /* kilo-tokens of context per decode in the last step with decodes */
} cv_step_cost;

/* Adds one step: its decode and prompt tokens, the context tokens its decodes
 * attend to (the sum of their positions), and its time in seconds. */
void cv_step_cost_observe(cv_step_cost *c, int64_t decode_tokens, int64_t prompt_tokens, int64_t context_tokens,
                          double seconds);

/* The fitted (A, B_d, B_p, B_c per kilo-token of context) into out: 1, or 0
 * while the steps seen do not determine them (too few, or a decode count that
 * hardly varies). A term the steps give no spread to (no prompt work; contexts
 * that grow in step with the decode count) is fitted as 0. */
int cv_step_cost_fit(const cv_step_cost *c, double out[CV_STEP_COST_TERMS]);

/* The knee batch (at least 1, at most cap; cap where the model implies no knee
 * within it), or 0 while the steps seen do not pin it down: a fit that is not
 * determined, or a knee whose standard error is above CV_STEP_COST_MAX_KNEE_ERROR
 * (a batch that sits at one size, as while a long queue keeps it full, cannot
 * tell A from B_d; a step with a part of the decodes held back can). */
int64_t cv_step_cost_knee(const cv_step_cost *c, int64_t cap);

#endif
