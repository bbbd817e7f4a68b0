/* Model hyper-parameters, read from a HF config.json or a llama2.c header. */
#ifndef CV_MODEL_CONFIG_H
#define CV_MODEL_CONFIG_H

#include <stdint.h>
#include "../../base/common.h"
#include "../../kernels/backend.h"

typedef enum cv_arch {
    CV_ARCH_LLAMA = 0,   /* LlamaForCausalLM (and llama2.c checkpoints) */
    CV_ARCH_MISTRAL = 1, /* MistralForCausalLM */
    CV_ARCH_QWEN2 = 2,   /* Qwen2ForCausalLM: q/k/v biases */
    CV_ARCH_QWEN3 = 3,   /* GGUF qwen3: q/k RMSNorm per head, no biases */
    CV_ARCH_GEMMA3 = 4   /* GGUF gemma3: see the gemma fields below */
} cv_arch;

#define CV_MAX_EOS 8

typedef struct cv_model_config {
    cv_arch arch;
    int64_t dim;            /* hidden_size */
    int64_t hidden_dim;     /* intermediate_size */
    int64_t n_layers;
    int64_t n_heads;
    int64_t n_kv_heads;
    int64_t head_dim;       /* head_dim when given, else dim / n_heads */
    int64_t vocab_size;
    int64_t max_pos;        /* max_position_embeddings (llama2.c: seq_len) */
    float rms_eps;
    float rope_theta;
    cv_rope_layout rope_layout; /* HF: halves; llama2.c: pairs */
    /* rope_scaling {"rope_type"/"type": "llama3", ...} */
    int rope_llama3;
    float rope_factor;
    float rope_low_freq_factor;
    float rope_high_freq_factor;
    int64_t rope_original_max_pos;
    float rope_linear;      /* GGUF rope.scaling.type "linear": frequencies / factor (0: none) */
    int tie_embeddings;     /* lm_head shares the token embedding */
    int qkv_bias;           /* Qwen2 */
    int qk_norm;            /* Qwen3, Gemma 3: RMSNorm of each q and k head before RoPE */
    /* Gemma 3: embeddings times sqrt(dim), norms after attention and after the
     * FFN too, GELU-tanh gating; local layers with their own RoPE base and a
     * sliding window (every swa_period-th layer is global) */
    int gemma;
    float embed_scale;      /* 0: none */
    float attn_scale;       /* 0: 1/sqrt(head_dim) */
    int64_t sliding_window; /* 0: none */
    int64_t swa_period;     /* layer l is local when (l + 1) % swa_period != 0 */
    float rope_local_theta; /* RoPE base of the local layers */
    int32_t bos_id;         /* -1 if none */
    int32_t eos_ids[CV_MAX_EOS];
    int n_eos;
    cv_dtype torch_dtype;   /* dtype named by config (torch_dtype), or of the file */
} cv_model_config;

#endif
