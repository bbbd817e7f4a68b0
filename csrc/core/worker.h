/* A model worker: one model with everything needed to run a plan on it —
 * its forward workspace, its paged KV cache with the KV manager over that
 * cache's blocks, and the runner that flattens a plan into a batch. The
 * engine holds one for the target model; a draft model holds one of its own.
 *
 * Built in three steps, because the caller sizes the later ones from what
 * the earlier ones tell it (the model's shape; the memory the workspace left):
 * load, init_compute, init_cache. cv_worker_free undoes any prefix of them. */
#ifndef CV_WORKER_H
#define CV_WORKER_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include "../../kernels/backend.h"
#include "../../base/common.h"
#include "../model/model.h"
#include "kv_cache.h"
#include "kv_manager.h"
#include "runner.h"
#include "scheduler.h"

typedef struct cv_worker {
    cv_backend *backend;   /* borrowed */
    cv_model *model;
    cv_forward_ws ws;      /* ws.logits_host: the last run's logits rows */
    int ws_ready;
    cv_runner runner;      /* runner.batch: the last run's batch */
    cv_kv_cache kv;
    cv_kv_manager *blocks; /* the KV cache's blocks */
    int64_t max_blocks_per_seq;
    cv_lora_pool lora;     /* adapter slots (n_slots 0: LoRA off) */
    int32_t *lora_slots;   /* [max_seqs] the last run's adapter slot per sequence */
} cv_worker;

/* Loads the model at path on backend b (quantization: a quantized dtype to
 * quantize to, else CV_DTYPE_INVALID). Polls *cancel while loading. */
int cv_worker_load(cv_worker *w, cv_backend *b, const char *path, cv_dtype dtype, cv_dtype quantization,
                   const atomic_int *cancel, cv_err *err);

/* The forward workspace and the runner, for plans of at most max_tokens
 * tokens over max_seqs sequences wanting at most max_rows logits rows, each
 * sequence at most max_len tokens in blocks of block_size. */
int cv_worker_init_compute(cv_worker *w, int64_t max_tokens, int64_t max_seqs, int64_t max_rows,
                           int64_t max_len, int64_t block_size, cv_err *err);

/* The KV cache (as many blocks as bytes holds, keys and values of kv_dtype)
 * and its KV manager. Polls *cancel between allocations. */
int cv_worker_init_cache(cv_worker *w, cv_dtype kv_dtype, int64_t block_size, size_t bytes,
                         int enable_prefix_caching, const atomic_int *cancel, cv_err *err);

/* LoRA: n_slots adapter slots of rank up to max_rank, weights held in dtype
 * (CV_F32 or CV_BF16), for steps of max_tokens tokens over max_seqs
 * sequences (after init_compute). */
int cv_worker_init_lora(cv_worker *w, int64_t n_slots, int64_t max_rank, int64_t max_tokens, int64_t max_seqs,
                        cv_dtype dtype, cv_err *err);

/* Frees everything the worker built (a zeroed or partly built one too). */
void cv_worker_free(cv_worker *w);

/* The dtype of the model's big matrices (quantized ones included). */
cv_dtype cv_worker_matrix_dtype(const cv_worker *w);
/* The KV dtype "auto" stands for: the activation dtype, except bf16 under
 * quantized weights (their activations are fp32; bf16 keys and values halve
 * the cache at a rounding error far below the weights' own). */
cv_dtype cv_worker_auto_kv_dtype(const cv_worker *w);

/* Runs a plan whose sequences hold their blocks: prepare flattens it into
 * runner.batch, forward runs the model on that batch (KV written, logits of
 * the batch's logits rows in ws.logits_host, row i for the sequence at plan
 * index runner.sample_plan_index[i]). execute does both. */
int cv_worker_prepare(cv_worker *w, const cv_sched_output *plan, cv_err *err);
int cv_worker_forward(cv_worker *w, cv_err *err);
int cv_worker_execute(cv_worker *w, const cv_sched_output *plan, cv_err *err);

#endif
