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
#include "mapped_file.h"

typedef struct cv_tensor_view {
    const void *data;   /* NULL when absent */
    cv_dtype dtype;     /* CV_F32, CV_F16, CV_BF16, or (GGUF) a block-quantized type (quant_format.h) */
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
    cv_tensor_view q_norm, k_norm;  /* qk_norm: [head_dim] each */
    cv_tensor_view post_attn_norm;  /* gemma: [dim], on the attention output */
    cv_tensor_view post_ffn_norm;   /* gemma: [dim], on the FFN output */
} cv_layer_views;

typedef enum cv_ckpt_format { CV_FMT_HF = 0, CV_FMT_LLAMA2C = 1, CV_FMT_GGUF = 2 } cv_ckpt_format;

struct cv_gguf_file;

#define CV_MAX_MAPS 256

typedef struct cv_checkpoint {
    cv_ckpt_format format;
    cv_model_config cfg;
    cv_tensor_view embed;      /* [vocab][dim] */
    cv_tensor_view final_norm; /* [dim] */
    cv_tensor_view lm_head;    /* [vocab][dim]; data NULL when tied to embed */
    cv_tensor_view rope_freqs; /* GGUF llama 3.x: [head_dim/2] divisors of the RoPE frequencies, or absent */
    cv_layer_views *layers;    /* [n_layers] */
    struct cv_gguf_file *gguf; /* GGUF: the metadata directory (owned), else NULL */
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
/* Opens a GGUF file (llama, qwen2 and mistral-style llama architectures). */
int cv_checkpoint_open_gguf(cv_checkpoint *ck, const char *path, cv_err *err);
/* Builds a GGUF checkpoint over buf[len], owned by the caller (fuzzing). */
int cv_gguf_checkpoint_parse(cv_checkpoint *ck, const void *buf, size_t len, const char *path, cv_err *err);
/* Picks the format from the path: a directory is HF, a file starting with
 * "GGUF" is GGUF, another file is llama2.c. */
int cv_checkpoint_open(cv_checkpoint *ck, const char *path, cv_err *err);
/* Releases everything; safe on a zeroed or failed checkpoint. */
void cv_checkpoint_close(cv_checkpoint *ck);

/* ---- helpers shared by the loaders, the binding and the fuzz targets ---- */

/* Parses the text of a HF config.json (path names it in errors). */
int cv_hf_config_parse(cv_model_config *cfg, const char *text, size_t len, const char *path, cv_err *err);
/* Builds a llama2.c checkpoint over buf[len], which stays owned by the caller
 * and must outlive ck (ck->n_maps is 0). */
int cv_llama2c_parse(cv_checkpoint *ck, const void *buf, size_t len, const char *path, cv_err *err);
/* The tensors of a layer, one table for every format: CV_LAYER_TENSORS of
 * them in cv_layer_views' order (attn_norm, wq, wk, wv, wo, bq, bk, bv,
 * ffn_norm, w_gate, w_up, w_down, q_norm, k_norm, post_attn_norm,
 * post_ffn_norm); a format names them in the same order (NULL past the
 * ones it has). */
#define CV_LAYER_TENSORS 16
typedef struct cv_layer_slot {
    cv_tensor_view *view;
    const char *name;   /* canonical name ("wq") */
    int64_t rows, cols; /* the shape the config implies; cols -1: a vector */
    int present;        /* 0: the model has no such tensor (biases without qkv_bias, ...) */
} cv_layer_slot;
/* Tensor k (< CV_LAYER_TENSORS) of the layer views l under config c. */
cv_layer_slot cv_layer_slot_at(const cv_model_config *c, cv_layer_views *l, int k);
/* Binds tensor k of every layer to "<prefix><layer>.<names[k]>" with bind(loader,
 * view, name, rows, cols, required=1); names in the table's order. */
typedef int (*cv_bind_fn)(void *loader, cv_tensor_view *out, const char *name, int64_t rows, int64_t cols,
                          int required);
int cv_checkpoint_bind_layers(cv_checkpoint *ck, const char *prefix, const char *const names[CV_LAYER_TENSORS],
                              cv_bind_fn bind, void *loader);
/* The view with canonical name "embed", "final_norm", "lm_head" or
 * "layers.{i}.{attn_norm,wq,wk,wv,wo,bq,bk,bv,ffn_norm,w_gate,w_up,w_down,q_norm,k_norm,
 * post_attn_norm,post_ffn_norm}";
 * NULL when the name is unknown or the tensor absent (a tied lm_head,
 * biases of a model without them). */
const cv_tensor_view *cv_checkpoint_find(const cv_checkpoint *ck, const char *name);
/* Number of elements of a view (0 when absent). */
int64_t cv_tensor_numel(const cv_tensor_view *v);

#endif
