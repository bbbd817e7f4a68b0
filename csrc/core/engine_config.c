/* The engine config's defaults and range checks: see engine_config.h. */
#include "engine_config.h"
#include "../model/lora.h"

#include <string.h>

void cv_engine_config_defaults(cv_engine_config *cfg) {
    memset(cfg, 0, sizeof *cfg);
    cfg->dtype = CV_DTYPE_INVALID;
    cfg->quantization = CV_DTYPE_INVALID;
    cfg->kv_dtype = CV_DTYPE_INVALID;
    cfg->num_threads = CV_CONFIG_AUTO;
    cfg->max_model_len = CV_CONFIG_AUTO;
    cfg->max_num_seqs = 256;
    cfg->max_num_batched_tokens = CV_CONFIG_AUTO;
    cfg->block_size = 16;
    cfg->kv_cache_bytes = CV_CONFIG_AUTO;
    cfg->kv_cache_sequences = CV_CONFIG_AUTO;
    cfg->gpu_memory_utilization = 0.9;
    cfg->enable_prefix_caching = 1;
    cfg->enable_chunked_prefill = 1;
    cfg->policy = CV_SCHED_CONTINUOUS;
    cfg->max_prefill_tokens_while_decoding = CV_CONFIG_AUTO;
    cfg->max_queued_requests = CV_CONFIG_AUTO;
    cfg->admission_reserve = CV_CONFIG_AUTO;
    cfg->adaptive_batch_limit = 0;
    cfg->max_loras = 1;
    cfg->max_lora_rank = 16;
    cfg->spec.method = CV_SPEC_NONE;
    cfg->bos_id = -1;
}

/* field in [lo, hi], or AUTO where the field may be left unset. */
static int check_range(cv_err *err, const char *field, int64_t v, int64_t lo, int64_t hi, int optional) {
    if (optional && v == CV_CONFIG_AUTO) return CV_OK;
    if (v >= lo && v <= hi) return CV_OK;
    return cv_set_field_err(err, CV_ERR_INVALID, field, "%s must be in [%lld, %lld], got %lld", field,
                            (long long)lo, (long long)hi, (long long)v);
}

static int is_float_dtype(cv_dtype t) { return t == CV_F32 || t == CV_BF16 || t == CV_F16; }

int cv_engine_config_check(const cv_engine_config *cfg, cv_err *err) {
    int rc;
    if (!cfg->model_path || !cfg->model_path[0])
        return cv_set_field_err(err, CV_ERR_INVALID, "model", "model must name a checkpoint");
    if (cfg->dtype != CV_DTYPE_INVALID && !is_float_dtype(cfg->dtype))
        return cv_set_field_err(err, CV_ERR_INVALID, "dtype", "dtype must be float32, bfloat16 or float16");
    if (cfg->kv_dtype != CV_DTYPE_INVALID && !is_float_dtype(cfg->kv_dtype) && cfg->kv_dtype != CV_I8)
        return cv_set_field_err(err, CV_ERR_INVALID, "kv_cache_dtype",
                                "kv_cache_dtype must be float32, bfloat16, float16 or int8");
    if (cfg->quantization != CV_DTYPE_INVALID && cfg->quantization != CV_Q8_0 && cfg->quantization != CV_Q4_0 &&
        cfg->quantization != CV_Q4_1)
        return cv_set_field_err(err, CV_ERR_INVALID, "quantization", "quantization must be q8_0, q4_0 or q4_1");
    if (cfg->policy != CV_SCHED_CONTINUOUS && cfg->policy != CV_SCHED_PRIORITY && cfg->policy != CV_SCHED_STATIC &&
        cfg->policy != CV_SCHED_FCFS)
        return cv_set_field_err(err, CV_ERR_INVALID, "scheduling", "scheduling must be continuous, fcfs, priority or static");
    if ((rc = check_range(err, "num_threads", cfg->num_threads, 1, CV_CONFIG_MAX_THREADS, 1)) ||
        (rc = check_range(err, "max_model_len", cfg->max_model_len, 1, CV_CONFIG_MAX_MODEL_LEN, 1)) ||
        (rc = check_range(err, "max_num_seqs", cfg->max_num_seqs, 1, CV_CONFIG_MAX_NUM_SEQS, 0)) ||
        (rc = check_range(err, "max_num_batched_tokens", cfg->max_num_batched_tokens, 1,
                          CV_CONFIG_MAX_BATCHED_TOKENS, 1)) ||
        (rc = check_range(err, "block_size", cfg->block_size, 1, CV_CONFIG_MAX_BLOCK_SIZE, 0)) ||
        (rc = check_range(err, "kv_cache_sequences", cfg->kv_cache_sequences, 1, CV_CONFIG_MAX_NUM_SEQS, 1)) ||
        (rc = check_range(err, "max_prefill_tokens_while_decoding", cfg->max_prefill_tokens_while_decoding, 0,
                          CV_CONFIG_MAX_PREFILL_CAP, 1)) ||
        (rc = check_range(err, "max_queued_requests", cfg->max_queued_requests, 0, CV_CONFIG_MAX_QUEUED, 1)) ||
        (rc = check_range(err, "admission_reserve", cfg->admission_reserve, 0, CV_SCHED_MAX_RESERVE, 1)) ||
        (rc = check_range(err, "max_loras", cfg->max_loras, 1, CV_LORA_MAX_SLOTS, 0)) ||
        (rc = check_range(err, "max_lora_rank", cfg->max_lora_rank, 1, CV_LORA_MAX_RANK, 0)))
        return rc;
    if (cfg->kv_cache_bytes != CV_CONFIG_AUTO && cfg->kv_cache_bytes < 1)
        return cv_set_field_err(err, CV_ERR_INVALID, "kv_cache_memory",
                                "kv_cache_memory must be positive (bytes) or None, got %lld",
                                (long long)cfg->kv_cache_bytes);
    double g = cfg->gpu_memory_utilization;
    if (!(g > 0.0 && g <= 1.0)) /* NaN fails too */
        return cv_set_field_err(err, CV_ERR_INVALID, "gpu_memory_utilization",
                                "gpu_memory_utilization must be in (0, 1], got %g", g);
    return cv_spec_config_check(&cfg->spec, err);
}

int64_t cv_engine_config_prefill_cap(const cv_engine_config *cfg) {
    if (cfg->max_prefill_tokens_while_decoding != CV_CONFIG_AUTO) return cfg->max_prefill_tokens_while_decoding;
    return cfg->use_cuda ? CV_DEFAULT_PREFILL_CAP_CUDA : CV_DEFAULT_PREFILL_CAP_CPU;
}

int64_t cv_engine_config_kv_sequences(const cv_engine_config *cfg) {
    if (cfg->kv_cache_sequences == CV_CONFIG_AUTO || cfg->kv_cache_sequences > cfg->max_num_seqs)
        return cfg->max_num_seqs;
    return cfg->kv_cache_sequences;
}
