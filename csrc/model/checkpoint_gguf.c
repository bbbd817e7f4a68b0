/* GGUF checkpoints (llama.cpp): the model config from "<arch>.*" metadata and
 * views of llama.cpp's tensor names, each checked for type and shape.
 *
 * Architectures: "llama" (LLaMA, SmolLM2, and Mistral files, which llama.cpp
 * writes as llama), "mistral", and "qwen2" (q/k/v biases). llama.cpp's
 * converter permutes the q/k rows of llama models so that rotating adjacent
 * pairs gives HF's rotate-half result: those files use CV_ROPE_PAIRS; qwen2
 * files keep HF's row order (CV_ROPE_HALVES). */
#include "checkpoint.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../kernels/quant_format.h"
#include "gguf.h"

#define CV_MAX_LAYERS 65536

typedef struct gguf_loader {
    const cv_gguf_file *f;
    const char *path;
    char arch[32];
    cv_err *err;
} gguf_loader;

/* "<arch>.<name>" into buf. */
static const char *arch_key(const gguf_loader *g, const char *name, char *buf, size_t n) {
    snprintf(buf, n, "%s.%s", g->arch, name);
    return buf;
}

/* A size from an integer metadata value in [1, max]; absent gives def, or an error when required. */
static int get_size(const gguf_loader *g, const char *name, int required, int64_t def, int64_t max, int64_t *out) {
    char key[160];
    arch_key(g, name, key, sizeof key);
    const cv_gguf_kv *kv = cv_gguf_find_kv(g->f, key);
    if (!kv) {
        if (required) return cv_set_err(g->err, CV_ERR_FORMAT, "%s: missing required metadata '%s'", g->path, key);
        *out = def;
        return 0;
    }
    int64_t v;
    if (!cv_gguf_kv_int(kv, &v))
        return cv_set_err(g->err, CV_ERR_FORMAT, "%s: metadata '%s' must be an integer", g->path, key);
    if (v <= 0 || v > max)
        return cv_set_err(g->err, CV_ERR_FORMAT, "%s: metadata '%s' is %lld, must be in [1, %lld]", g->path, key,
                          (long long)v, (long long)max);
    *out = v;
    return 0;
}

static int get_float(const gguf_loader *g, const char *name, double def, double *out) {
    char key[160];
    arch_key(g, name, key, sizeof key);
    const cv_gguf_kv *kv = cv_gguf_find_kv(g->f, key);
    if (!kv) { *out = def; return 0; }
    int64_t i;
    if (cv_gguf_kv_float(kv, out)) return 0;
    if (cv_gguf_kv_int(kv, &i)) { *out = (double)i; return 0; }
    return cv_set_err(g->err, CV_ERR_FORMAT, "%s: metadata '%s' must be a number", g->path, key);
}

/* A token id from tokenizer.ggml.<name>_token_id, or -1 when absent. */
static int get_token_id(const gguf_loader *g, const char *key, int64_t vocab, int32_t *out) {
    const cv_gguf_kv *kv = cv_gguf_find_kv(g->f, key);
    *out = -1;
    if (!kv) return 0;
    int64_t v;
    if (!cv_gguf_kv_int(kv, &v) || v < 0 || v >= vocab)
        return cv_set_err(g->err, CV_ERR_FORMAT, "%s: metadata '%s' must be a token id below the vocabulary size %lld",
                          g->path, key, (long long)vocab);
    *out = (int32_t)v;
    return 0;
}

static int parse_config(gguf_loader *g, cv_model_config *c) {
    int rc;
    const int64_t big = INT32_MAX;
    cv_gguf_str a;
    const cv_gguf_kv *kv = cv_gguf_find_kv(g->f, "general.architecture");
    if (!kv) return cv_set_err(g->err, CV_ERR_FORMAT, "%s: missing required metadata 'general.architecture'", g->path);
    if (!cv_gguf_kv_string(kv, &a))
        return cv_set_err(g->err, CV_ERR_FORMAT, "%s: metadata 'general.architecture' must be a string", g->path);
    if (a.len >= sizeof g->arch) a.len = sizeof g->arch - 1;
    memcpy(g->arch, a.p, a.len);
    g->arch[a.len] = 0;
    if (strlen(g->arch) != a.len) g->arch[0] = 0; /* an embedded NUL names nothing we know */
    if (strcmp(g->arch, "llama") == 0) c->arch = CV_ARCH_LLAMA;
    else if (strcmp(g->arch, "mistral") == 0) c->arch = CV_ARCH_MISTRAL;
    else if (strcmp(g->arch, "qwen2") == 0) c->arch = CV_ARCH_QWEN2;
    else
        return cv_set_err(g->err, CV_ERR_UNSUPPORTED,
                          "%s: GGUF architecture '%.*s' is not supported (llama, mistral, qwen2)", g->path,
                          (int)(a.len > 60 ? 60 : a.len), a.p);
    if ((rc = get_size(g, "embedding_length", 1, 0, big, &c->dim)) < 0 ||
        (rc = get_size(g, "feed_forward_length", 1, 0, big, &c->hidden_dim)) < 0 ||
        (rc = get_size(g, "block_count", 1, 0, CV_MAX_LAYERS, &c->n_layers)) < 0 ||
        (rc = get_size(g, "attention.head_count", 1, 0, big, &c->n_heads)) < 0 ||
        (rc = get_size(g, "attention.head_count_kv", 0, c->n_heads, big, &c->n_kv_heads)) < 0 ||
        (rc = get_size(g, "context_length", 0, 2048, big, &c->max_pos)) < 0)
        return rc;
    if (c->n_kv_heads > c->n_heads || c->n_heads % c->n_kv_heads != 0)
        return cv_set_err(g->err, CV_ERR_FORMAT,
                          "%s: %s.attention.head_count (%lld) is not a multiple of %s.attention.head_count_kv (%lld)",
                          g->path, g->arch, (long long)c->n_heads, g->arch, (long long)c->n_kv_heads);
    char key[160];
    if (!cv_gguf_find_kv(g->f, arch_key(g, "attention.key_length", key, sizeof key)) && c->dim % c->n_heads != 0)
        return cv_set_err(g->err, CV_ERR_FORMAT, "%s: %s.embedding_length (%lld) is not a multiple of the head count",
                          g->path, g->arch, (long long)c->dim);
    if ((rc = get_size(g, "attention.key_length", 0, c->dim / c->n_heads, 256, &c->head_dim)) < 0) return rc;
    int64_t vlen, rope_dim;
    if ((rc = get_size(g, "attention.value_length", 0, c->head_dim, 256, &vlen)) < 0 ||
        (rc = get_size(g, "rope.dimension_count", 0, c->head_dim, 256, &rope_dim)) < 0)
        return rc;
    if (vlen != c->head_dim)
        return cv_set_err(g->err, CV_ERR_UNSUPPORTED, "%s: key_length %lld != value_length %lld is not supported",
                          g->path, (long long)c->head_dim, (long long)vlen);
    if (rope_dim != c->head_dim)
        return cv_set_err(g->err, CV_ERR_UNSUPPORTED,
                          "%s: %s.rope.dimension_count %lld (partial RoPE over a %lld-wide head) is not supported",
                          g->path, g->arch, (long long)rope_dim, (long long)c->head_dim);
    if (c->head_dim % 2 != 0)
        return cv_set_err(g->err, CV_ERR_FORMAT, "%s: head dimension %lld must be even for RoPE", g->path,
                          (long long)c->head_dim);
    double eps, theta;
    if ((rc = get_float(g, "attention.layer_norm_rms_epsilon", 1e-5, &eps)) < 0 ||
        (rc = get_float(g, "rope.freq_base", 10000.0, &theta)) < 0)
        return rc;
    if (!(eps > 0) || eps >= 1 || !((float)eps > 0))
        return cv_set_err(g->err, CV_ERR_FORMAT, "%s: %s.attention.layer_norm_rms_epsilon (%g) must be in (0, 1)",
                          g->path, g->arch, eps);
    if (!(theta > 0) || theta > 1e30)
        return cv_set_err(g->err, CV_ERR_FORMAT, "%s: %s.rope.freq_base (%g) must be a positive number", g->path,
                          g->arch, theta);
    c->rms_eps = (float)eps;
    c->rope_theta = (float)theta;
    c->rope_layout = c->arch == CV_ARCH_QWEN2 ? CV_ROPE_HALVES : CV_ROPE_PAIRS;
    const cv_gguf_kv *st = cv_gguf_find_kv(g->f, arch_key(g, "rope.scaling.type", key, sizeof key));
    cv_gguf_str stype = {"none", 4};
    if (st && !cv_gguf_kv_string(st, &stype))
        return cv_set_err(g->err, CV_ERR_FORMAT, "%s: metadata '%s' must be a string", g->path, key);
    if (stype.len == 6 && memcmp(stype.p, "linear", 6) == 0) {
        double factor;
        if ((rc = get_float(g, "rope.scaling.factor", 0, &factor)) < 0) return rc;
        if (!(factor > 0) || factor > 1e6)
            return cv_set_err(g->err, CV_ERR_FORMAT, "%s: %s.rope.scaling.factor (%g) must be positive", g->path,
                              g->arch, factor);
        c->rope_linear = (float)factor;
    } else if (!(stype.len == 4 && memcmp(stype.p, "none", 4) == 0)) {
        return cv_set_err(g->err, CV_ERR_UNSUPPORTED, "%s: rope scaling '%.*s' is not supported (none, linear)",
                          g->path, (int)(stype.len > 40 ? 40 : stype.len), stype.p);
    }
    if (cv_gguf_find_tensor(g->f, "rope_freqs.weight"))
        return cv_set_err(g->err, CV_ERR_UNSUPPORTED,
                          "%s: tensor 'rope_freqs.weight' (per-frequency RoPE scaling, llama3) is not supported",
                          g->path);

    /* vocabulary: <arch>.vocab_size, else the embedding's rows */
    const cv_gguf_tensor *emb = cv_gguf_find_tensor(g->f, "token_embd.weight");
    if (!emb) return cv_set_err(g->err, CV_ERR_FORMAT, "%s: tensor 'token_embd.weight' is missing", g->path);
    int64_t emb_rows = emb->n_dims == 2 ? emb->ne[1] : 0;
    if ((rc = get_size(g, "vocab_size", 0, emb_rows > 0 ? emb_rows : 1, big, &c->vocab_size)) < 0) return rc;
    c->tie_embeddings = cv_gguf_find_tensor(g->f, "output.weight") == NULL;
    c->qkv_bias = c->arch == CV_ARCH_QWEN2;
    if ((rc = get_token_id(g, "tokenizer.ggml.bos_token_id", c->vocab_size, &c->bos_id)) < 0) return rc;
    int32_t eos;
    if ((rc = get_token_id(g, "tokenizer.ggml.eos_token_id", c->vocab_size, &eos)) < 0) return rc;
    c->n_eos = 0;
    if (eos >= 0) c->eos_ids[c->n_eos++] = eos;
    c->torch_dtype = cv_dtype_is_quant(emb->dtype) ? CV_F32 : emb->dtype;
    return 0;
}

/* Views tensor `name` after checking that it is [rows][cols] (cols < 0: a
 * vector [rows]); missing is an error only when required. */
static int bind(gguf_loader *g, cv_tensor_view *out, const char *name, int64_t rows, int64_t cols, int required) {
    const cv_gguf_tensor *t = cv_gguf_find_tensor(g->f, name);
    if (!t) {
        if (!required) return 0;
        return cv_set_err(g->err, CV_ERR_FORMAT, "%s: tensor '%s' is missing", g->path, name);
    }
    const int ndim = cols < 0 ? 1 : 2;
    if (t->n_dims != ndim || t->ne[0] != (ndim == 2 ? cols : rows) || (ndim == 2 && t->ne[1] != rows)) {
        char got[128];
        int n = snprintf(got, sizeof got, "[");
        for (int i = t->n_dims - 1; i >= 0 && n < (int)sizeof got; i--)
            n += snprintf(got + n, sizeof got - (size_t)n, "%s%lld", i == t->n_dims - 1 ? "" : ", ", (long long)t->ne[i]);
        if (n < (int)sizeof got) snprintf(got + n, sizeof got - (size_t)n, "]");
        if (ndim == 2)
            return cv_set_err(g->err, CV_ERR_FORMAT, "%s: tensor '%s' has shape %s, the metadata implies [%lld, %lld]",
                              g->path, name, got, (long long)rows, (long long)cols);
        return cv_set_err(g->err, CV_ERR_FORMAT, "%s: tensor '%s' has shape %s, the metadata implies [%lld]", g->path,
                          name, got, (long long)rows);
    }
    if (ndim == 1 && t->dtype != CV_F32 && t->dtype != CV_F16 && t->dtype != CV_BF16)
        return cv_set_err(g->err, CV_ERR_UNSUPPORTED, "%s: vector '%s' has type %s; norms and biases must be floats",
                          g->path, name, cv_gguf_ggml_type_name(t->ggml_type));
    if (!cv_dtype_is_quant(t->dtype) && (uintptr_t)t->data % cv_dtype_size(t->dtype) != 0)
        return cv_set_err(g->err, CV_ERR_FORMAT, "%s: tensor '%s' data is misaligned", g->path, name);
    out->data = t->data;
    out->dtype = t->dtype;
    out->ndim = ndim;
    out->shape[0] = rows;
    out->shape[1] = ndim == 2 ? cols : 0;
    return 0;
}

/* Layer tensor names in cv_layer_slot_at's order. */
static const char *const LAYER_NAMES[CV_LAYER_TENSORS] = {
    "attn_norm.weight",
    "attn_q.weight",
    "attn_k.weight",
    "attn_v.weight",
    "attn_output.weight",
    "attn_q.bias",
    "attn_k.bias",
    "attn_v.bias",
    "ffn_norm.weight",
    "ffn_gate.weight",
    "ffn_up.weight",
    "ffn_down.weight",
};

static int bind_cb(void *loader, cv_tensor_view *out, const char *name, int64_t rows, int64_t cols, int required) {
    return bind((gguf_loader *)loader, out, name, rows, cols, required);
}

static int bind_all(gguf_loader *g, cv_checkpoint *ck) {
    const cv_model_config *c = &ck->cfg;
    int rc;
    if ((rc = bind(g, &ck->embed, "token_embd.weight", c->vocab_size, c->dim, 1)) < 0 ||
        (rc = bind(g, &ck->final_norm, "output_norm.weight", c->dim, -1, 1)) < 0 ||
        (rc = bind(g, &ck->lm_head, "output.weight", c->vocab_size, c->dim, 0)) < 0)
        return rc;
    return cv_checkpoint_bind_layers(ck, "blk.", LAYER_NAMES, bind_cb, g);
}

/* Config and views over an already parsed file f; on success ck->gguf takes f. */
static int build(cv_checkpoint *ck, cv_gguf_file *f, const char *path, cv_err *err) {
    gguf_loader g = {.f = f, .path = path, .err = err};
    int rc = parse_config(&g, &ck->cfg);
    if (rc < 0) return rc;
    if (ck->cfg.n_heads > INT32_MAX / ck->cfg.head_dim)
        return cv_set_err(err, CV_ERR_FORMAT, "%s: head_count * key_length is too large", path);
    ck->layers = calloc((size_t)ck->cfg.n_layers, sizeof *ck->layers);
    if (!ck->layers) return cv_set_err(err, CV_ERR_NOMEM, "%s: out of memory", path);
    if ((rc = bind_all(&g, ck)) < 0) return rc;
    ck->gguf = malloc(sizeof *ck->gguf);
    if (!ck->gguf) return cv_set_err(err, CV_ERR_NOMEM, "%s: out of memory", path);
    *ck->gguf = *f;
    memset(f, 0, sizeof *f);
    return 0;
}

int cv_gguf_checkpoint_parse(cv_checkpoint *ck, const void *buf, size_t len, const char *path, cv_err *err) {
    cv_gguf_file f;
    memset(ck, 0, sizeof *ck);
    ck->format = CV_FMT_GGUF;
    int rc = cv_gguf_parse(&f, buf, len, path, err);
    if (rc < 0) return rc;
    rc = build(ck, &f, path, err);
    cv_gguf_close(&f);
    if (rc < 0) cv_checkpoint_close(ck);
    return rc;
}

int cv_checkpoint_open_gguf(cv_checkpoint *ck, const char *path, cv_err *err) {
    cv_gguf_file f;
    memset(ck, 0, sizeof *ck);
    ck->format = CV_FMT_GGUF;
    int rc = cv_gguf_open(&f, path, path, err);
    if (rc < 0) return rc;
    cv_gguf_release_map(&f, &ck->maps[0], &ck->map_lens[0]);
    ck->n_maps = 1;
    rc = build(ck, &f, path, err);
    cv_gguf_close(&f);
    if (rc < 0) cv_checkpoint_close(ck);
    else ck->gguf->label = NULL; /* path belongs to the caller */
    return rc;
}
