/* The engine's configuration: one struct, its defaults and its range checks.
 * The binding fills it from a Python EngineArgs by attribute name; this file
 * is the one place that decides which values are in range, and every error
 * names the field at fault by its EngineArgs name. */
#ifndef CV_ENGINE_CONFIG_H
#define CV_ENGINE_CONFIG_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include "../../base/common.h"
#include "scheduler.h"
#include "speculative.h"

/* An optional integer field left unset (None in EngineArgs): its default
 * applies. No caller can mean it as a value: the binding refuses it. */
#define CV_CONFIG_AUTO INT64_MIN

/* max_prefill_tokens_while_decoding when unset, by device. On the CPU a
 * step's time grows with every token: 96 keeps median TTFT within 10% of no
 * cap while the p99 time between tokens drops 1.8x (the sweep in
 * docs/benchmarks.md, Workload L at 0.9x saturation, 25M model, 2 cores). */
#define CV_DEFAULT_PREFILL_CAP_CPU 96
#define CV_DEFAULT_PREFILL_CAP_CUDA 512

/* The ranges cv_engine_config_check accepts. */
#define CV_CONFIG_MAX_THREADS 1024
#define CV_CONFIG_MAX_MODEL_LEN ((int64_t)1 << 24)
#define CV_CONFIG_MAX_NUM_SEQS ((int64_t)1 << 16)
#define CV_CONFIG_MAX_BATCHED_TOKENS ((int64_t)1 << 24)
#define CV_CONFIG_MAX_BLOCK_SIZE 1024
#define CV_CONFIG_MAX_PREFILL_CAP ((int64_t)1 << 24)
#define CV_CONFIG_MAX_QUEUED ((int64_t)1 << 30)

typedef struct cv_engine_config {
    const char *model_path;
    cv_dtype dtype;                 /* CV_DTYPE_INVALID: the checkpoint's */
    cv_dtype quantization;          /* CV_Q8_0/Q4_0/Q4_1: quantize at load; CV_DTYPE_INVALID: none */
    int use_cuda;                   /* 0: CPU */
    int64_t num_threads;            /* [1, 1024]; AUTO: all cores */
    int exact_activations;          /* CPU: 1: float32 GEMM inputs over bf16 weights (no vdpbf16ps rounding) */
    int64_t max_model_len;          /* AUTO: the model's */
    int64_t max_num_seqs;
    int64_t max_num_batched_tokens; /* AUTO: 2048, at least max_num_seqs (max_model_len without chunking) */
    int64_t block_size;
    int64_t kv_cache_bytes;         /* AUTO: cv_engine_config_kv_sequences full-length sequences, capped by a
                                     * share of free memory */
    int64_t kv_cache_sequences;     /* [1, CV_CONFIG_MAX_NUM_SEQS]: how many max_model_len-long sequences the
                                     * default pool holds (never more than max_num_seqs); AUTO: max_num_seqs */
    double gpu_memory_utilization;  /* CUDA only */
    cv_dtype kv_dtype;              /* CV_DTYPE_INVALID: the weights' dtype */
    int enable_prefix_caching;
    int enable_chunked_prefill;
    cv_sched_policy policy;
    int64_t max_prefill_tokens_while_decoding; /* see cv_scheduler_config; 0: no cap; AUTO: by device */
    int64_t max_queued_requests;    /* refuse a request that would make more wait unscheduled; 0 or AUTO: no limit */
    int enable_lora;                /* adapters per request (cv_engine_lora_load) */
    int64_t max_loras;              /* adapter slots, [1, CV_LORA_MAX_SLOTS] (enable_lora) */
    int64_t max_lora_rank;          /* largest adapter rank, [1, CV_LORA_MAX_RANK] (enable_lora) */
    cv_dtype lora_dtype;            /* adapter weights: CV_F32, CV_BF16 or CV_DTYPE_INVALID ("auto":
                                     * cv_lora_auto_dtype) */
    int64_t admission_reserve;      /* percent of the expected remaining output a waiting sequence's admission
                                     * keeps free for the running sequences' growth (cv_scheduler_config);
                                     * AUTO: the scheduler's default; 0: no margin */
    int adaptive_batch_limit;       /* admissions stop at the knee batch of the step-time model (step_cost.h) */
    cv_spec_config spec;            /* speculative decoding; method CV_SPEC_NONE: off */
    uint64_t seed;
    /* Tokenizer facts the engine needs to stop and detokenize on bytes. */
    const int32_t *eos_ids; int n_eos;
    int32_t bos_id;                 /* -1 if none */
    int strip_space_after_bos;      /* llama2.c: the piece after BOS loses its leading space */
    int64_t n_token_bytes;          /* entries in token_bytes (ids beyond have no bytes) */
    const char *const *token_bytes; /* [n_token_bytes] raw bytes of each token */
    const size_t *token_lens;       /* [n_token_bytes] */
    const uint8_t *token_special;   /* [n_token_bytes] 1 for special tokens, or NULL */
    /* Polled while creating (between layers of weights and KV cache); nonzero
     * makes cv_engine_create stop with CV_ERR_CANCELLED. NULL: never. */
    const atomic_int *cancel;
} cv_engine_config;

/* EngineArgs' defaults: every optional field AUTO, 256 sequences, blocks of
 * 16, prefix caching and chunked prefill on, continuous scheduling, no
 * speculation, no tokenizer facts. */
void cv_engine_config_defaults(cv_engine_config *cfg);

/* Every range that needs no model (the speculative config's included).
 * CV_ERR_INVALID with err->field naming the field at fault. */
int cv_engine_config_check(const cv_engine_config *cfg, cv_err *err);

/* How many full-length sequences the default KV pool (kv_cache_bytes AUTO)
 * is sized for: kv_cache_sequences, at most max_num_seqs. */
int64_t cv_engine_config_kv_sequences(const cv_engine_config *cfg);

/* max_prefill_tokens_while_decoding with AUTO resolved for the device. */
int64_t cv_engine_config_prefill_cap(const cv_engine_config *cfg);

#endif
