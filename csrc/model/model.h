/* A LLaMA-family model living on a backend: weights prepared in the backend's
 * layout, and the forward pass over one ragged batch with a paged KV cache. */
#ifndef CV_MODEL_H
#define CV_MODEL_H

#include <stdatomic.h>
#include <stdint.h>
#include "../../base/common.h"
#include "../../kernels/backend.h"
#include "config.h"
#include "lora.h"

typedef struct cv_layer {
    float *attn_norm;     /* [dim] (device) */
    cv_matrix wqkv;       /* [q_dim + 2*kv_dim][dim]: q rows, then k rows, then v rows */
    float *bqkv;          /* [q_dim + 2*kv_dim] (device) or NULL (Qwen2 biases) */
    cv_matrix wo;         /* [dim][q_dim] */
    float *ffn_norm;      /* [dim] (device) */
    cv_matrix w_gate_up;  /* [2*hidden][dim]: gate rows, then up rows */
    cv_matrix w_down;     /* [dim][hidden] */
    float *q_norm, *k_norm;           /* qk_norm: [head_dim] (device), else NULL */
    float *post_attn_norm, *post_ffn_norm; /* gemma: [dim] (device), else NULL */
} cv_layer;

typedef struct cv_model {
    cv_model_config cfg;
    cv_backend *backend;  /* not owned */
    cv_dtype dtype;       /* weight dtype */
    int64_t q_dim;        /* n_heads * head_dim */
    int64_t kv_dim;       /* n_kv_heads * head_dim */
    cv_table embed;       /* [vocab][dim]; empty when embed_in_head */
    int embed_in_head;    /* tied: the embedding's rows are read from lm_head (stored once) */
    cv_layer *layers;     /* [n_layers] */
    float *final_norm;    /* [dim] (device) */
    cv_matrix lm_head;    /* [vocab][dim] */
    float *inv_freq;      /* [head_dim/2] (device) */
    float *inv_freq_local;/* gemma: [head_dim/2] of the sliding-window layers (device), else NULL */
    size_t weight_bytes;  /* bytes of all prepared weights */
    int64_t n_params;     /* parameters in the checkpoint */
} cv_model;

/* Loads the checkpoint at path (HF directory or llama2.c .bin) onto backend b.
 * dtype: CV_F32, CV_BF16, CV_F16, or CV_DTYPE_INVALID for "auto" (the
 * checkpoint's own dtype). */
int cv_model_load(cv_model **out, const char *path, cv_backend *b, cv_dtype dtype, cv_err *err);
/* As cv_model_load; quant CV_Q8_0, CV_Q4_0 or CV_Q4_1 quantizes every matrix
 * and the token embedding when their rows are a multiple of 32, at load
 * (deterministic, ggml's rounding: llama.cpp's pure quantization);
 * CV_DTYPE_INVALID keeps the file's types (a GGUF file's quantized matrices
 * stay quantized either way). Polls *cancel (when not NULL) between layers:
 * nonzero stops the load with CV_ERR_CANCELLED, so a caller can interrupt it. */
int cv_model_load_quantized(cv_model **out, const char *path, cv_backend *b, cv_dtype dtype, cv_dtype quant,
                            const atomic_int *cancel, cv_err *err);
void cv_model_free(cv_model *m);

/* RoPE frequencies for head_dim/2 pairs, with llama3 scaling when configured. */
void cv_rope_inv_freq(float *out, const cv_model_config *cfg);
/* Whether layer l attends over a sliding window (Gemma 3's local layers). */
int cv_layer_is_local(const cv_model_config *cfg, int64_t l);

/* One step's batch, in host memory (filled by the runner). */
typedef struct cv_batch {
    int64_t n_tokens;
    int64_t n_seqs;
    int32_t *tokens;        /* [n_tokens] */
    int32_t *positions;     /* [n_tokens] */
    int64_t *slot_mapping;  /* [n_tokens] cache slot of each new token */
    int32_t *query_start;   /* [n_seqs + 1] */
    int32_t *context_lens;  /* [n_seqs] */
    int32_t *block_tables;  /* [n_seqs][max_blocks_per_seq] */
    int64_t max_blocks_per_seq;
    int64_t max_context_len;
    int32_t *logits_rows;   /* [n_logits] token rows whose logits are wanted */
    int64_t n_logits;
    const int32_t *lora_slots;  /* [n_seqs] adapter slot of each sequence (-1: none), or NULL: no adapters */
    const cv_lora_pool *lora;   /* the slots lora_slots names */
} cv_batch;

/* Activations and device copies of the batch, sized once for the engine's
 * limits; a step never allocates. */
typedef struct cv_forward_ws {
    int64_t max_tokens, max_seqs, max_blocks_per_seq;
    float *x;      /* [max_tokens][dim] residual stream */
    float *xn;     /* [max_tokens][dim] normed */
    float *qkv;    /* [max_tokens][q_dim + 2*kv_dim] */
    float *attn;   /* [max_tokens][q_dim] */
    float *gu;     /* [max_tokens][2*hidden] */
    float *h;      /* [max_tokens][hidden] */
    float *xlast;  /* [max_seqs][dim] rows to sample */
    float *xlast_n;/* [max_seqs][dim] */
    float *logits; /* [max_seqs][vocab] (device) */
    float *logits_host; /* [max_seqs][vocab] host view of the logits (== logits on the CPU) */
    int32_t *d_tokens, *d_positions, *d_query_start, *d_context_lens, *d_block_tables, *d_logits_rows;
    int64_t *d_slots;
    int device_copies; /* 0 on the CPU: kernels read the host batch directly */
} cv_forward_ws;

int cv_forward_ws_init(cv_forward_ws *ws, const cv_model *m, int64_t max_tokens, int64_t max_seqs,
                       int64_t max_blocks_per_seq, cv_err *err);
void cv_forward_ws_free(cv_forward_ws *ws, const cv_model *m);

/* Runs the model over batch, writing keys/values into caches[n_layers] and the
 * logits of batch->logits_rows into ws->logits_host[n_logits][vocab]. */
int cv_model_forward(const cv_model *m, cv_forward_ws *ws, cv_kv_layer *caches,
                     const cv_batch *batch, cv_err *err);

/* The LM head alone, after a forward: the logits of rows[n_rows] (token rows of
 * that forward's batch of n_tokens, n_rows <= max_seqs) into
 * ws->logits_host[n_rows][vocab], overwriting the forward's. Prompt logprobs
 * use it to get every prompt row's logits without rerunning the layers. */
int cv_model_logits(const cv_model *m, cv_forward_ws *ws, const int32_t *rows, int64_t n_rows,
                    int64_t n_tokens, cv_err *err);

#endif
