/* A checkpoint opened for reading: its config and views of every tensor.
 *
 * Tensor data stays in the memory-mapped file(s); views point into them and
 * live as long as the checkpoint. Every offset, length, dtype and shape has
 * been checked against the file header and the config when open returns 0. */
#ifndef CV_MODEL_CHECKPOINT_H
#define CV_MODEL_CHECKPOINT_H

#include <stddef.h>
#include <stdint.h>
#include "config.h"

typedef struct cv_tensor_view {
    const void *data;   /* NULL when absent */
    cv_dtype dtype;     /* CV_F32, CV_F16 or CV_BF16 */
    int ndim;           /* 1 or 2 */
    int64_t shape[2];   /* [rows][cols] for matrices, [n] for vectors */
} cv_tensor_view;

typedef struct cv_layer_views {
    cv_tensor_view attn_norm; /* [dim] */
    cv_tensor_view wq;        /* [n_heads*head_dim][dim] */
    cv_tensor_view wk;        /* [n_kv_heads*head_dim][dim] */
    cv_tensor_view wv;        /* [n_kv_heads*head_dim][dim] */
    cv_tensor_view wo;        /* [dim][n_heads*head_dim] */
    cv_tensor_view bq, bk, bv;/* Qwen2 only: [n_heads*head_dim], [kv_dim], [kv_dim] */
    cv_tensor_view ffn_norm;  /* [dim] */
    cv_tensor_view w_gate;    /* [hidden_dim][dim]  (HF gate_proj, llama2.c w1) */
    cv_tensor_view w_up;      /* [hidden_dim][dim]  (HF up_proj,   llama2.c w3) */
    cv_tensor_view w_down;    /* [dim][hidden_dim]  (HF down_proj, llama2.c w2) */
} cv_layer_views;

typedef enum cv_ckpt_format { CV_FMT_HF = 0, CV_FMT_LLAMA2C = 1 } cv_ckpt_format;

#define CV_MAX_MAPS 256

typedef struct cv_checkpoint {
    cv_ckpt_format format;
    cv_model_config cfg;
    cv_tensor_view embed;      /* [vocab][dim] */
    cv_tensor_view final_norm; /* [dim] */
    cv_tensor_view lm_head;    /* [vocab][dim]; data NULL when tied to embed */
    cv_layer_views *layers;    /* [n_layers] */
    /* owned resources */
    void *maps[CV_MAX_MAPS];
    size_t map_lens[CV_MAX_MAPS];
    int n_maps;
} cv_checkpoint;

/* Opens a HF checkpoint directory (config.json + model.safetensors or
 * model.safetensors.index.json shards). */
int cv_checkpoint_open_hf(cv_checkpoint *ck, const char *dir, cv_err *err);
/* Opens a llama2.c .bin checkpoint (version 0 format). */
int cv_checkpoint_open_llama2c(cv_checkpoint *ck, const char *path, cv_err *err);
/* Picks the format from the path: a directory is HF, a file is llama2.c. */
int cv_checkpoint_open(cv_checkpoint *ck, const char *path, cv_err *err);
/* Releases everything; safe on a zeroed or failed checkpoint. */
void cv_checkpoint_close(cv_checkpoint *ck);

#endif
