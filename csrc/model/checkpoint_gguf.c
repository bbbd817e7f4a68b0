/* GGUF checkpoints (llama.cpp): the model config from "<arch>.*" metadata and
 * views of llama.cpp's tensor names, each checked for type and shape.
 *
 * Architectures: "llama" (LLaMA, SmolLM2, and Mistral files, which llama.cpp
 * writes as llama; Llama 3.x's RoPE scaling comes as the rope_freqs.weight
 * tensor of frequency divisors), "mistral", "qwen2" (q/k/v biases), "qwen3"
 * (q/k RMSNorm per head) and "gemma3". llama.cpp's converter permutes the q/k
 * rows of llama models so that rotating adjacent pairs gives HF's
 * rotate-half result: those files use CV_ROPE_PAIRS; qwen and gemma files
 * keep HF's row order (CV_ROPE_HALVES).
 *
 * Gemma 3 as llama.cpp writes it: every "*norm.weight" already holds HF's
 * (1 + w) (its converter adds the 1), so the norms multiply by the stored
 * weight like any other; no metadata names the local layers' RoPE base
 * (10000) or the layer pattern (every 6th layer global), which llama.cpp also
 * hard-codes; "attention.sliding_window_pattern", when present, sets the
 * period. Every "<arch>." key a file carries is read or refused by name. */
#include "checkpoint.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../base/quant_format.h"
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

/* The "<arch>." keys this loader reads (every architecture), and those of
 * gemma3 only. rope.scaling.original_context_length and .finetuned describe
 * a linear scaling, whose frequencies do not depend on them. */
static const char *const ARCH_KEYS[] = {
    "context_length", "embedding_length", "block_count", "feed_forward_length", "vocab_size",
    "attention.head_count", "attention.head_count_kv", "attention.layer_norm_rms_epsilon",
    "attention.key_length", "attention.value_length", "rope.freq_base", "rope.dimension_count",
    "rope.scaling.type", "rope.scaling.factor", "rope.scaling.original_context_length", "rope.scaling.finetuned",
};
static const char *const GEMMA3_KEYS[] = {"attention.sliding_window", "attention.sliding_window_pattern"};

static int key_in(const cv_gguf_str *k, size_t prefix, const char *const *list, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (k->len - prefix == strlen(list[i]) && memcmp(k->p + prefix, list[i], k->len - prefix) == 0) return 1;
    return 0;
}

/* Refuses, by name, a "<arch>." key this loader does not read: a file that
 * needs a feature we lack (softcapping, experts, ...) fails loudly. */
static int check_arch_keys(const gguf_loader *g) {
    const size_t pl = strlen(g->arch);
    for (size_t i = 0; i < g->f->n_kvs; i++) {
        const cv_gguf_str *k = &g->f->kvs[i].key;
        if (k->len <= pl + 1 || memcmp(k->p, g->arch, pl) != 0 || k->p[pl] != '.') continue;
        if (key_in(k, pl + 1, ARCH_KEYS, sizeof ARCH_KEYS / sizeof ARCH_KEYS[0])) continue;
        if (strcmp(g->arch, "gemma3") == 0 && key_in(k, pl + 1, GEMMA3_KEYS, sizeof GEMMA3_KEYS / sizeof GEMMA3_KEYS[0]))
            continue;
        return cv_set_err(g->err, CV_ERR_UNSUPPORTED, "%s: metadata '%.*s' is not supported for %s models", g->path,
                          (int)(k->len > 100 ? 100 : k->len), k->p, g->arch);
    }
    return 0;
}

/* Gemma 3's own settings (see the top of the file). */
static int parse_gemma3(gguf_loader *g, cv_model_config *c) {
    int rc;
    c->gemma = 1;
    c->embed_scale = sqrtf((float)c->dim);
    /* HF's query_pre_attn_scalar: head_dim, except the 27B model (62 layers),
     * which uses dim / n_heads; no GGUF key carries it (llama.cpp decides the same way) */
    c->attn_scale = c->n_layers == 62 ? 1.0f / sqrtf((float)(c->dim / c->n_heads)) : 0.0f;
    c->rope_local_theta = 10000.0f;
    if ((rc = get_size(g, "attention.sliding_window", 0, 0, INT32_MAX, &c->sliding_window)) < 0 ||
        (rc = get_size(g, "attention.sliding_window_pattern", 0, 6, CV_MAX_LAYERS, &c->swa_period)) < 0)
        return rc;
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
    else if (strcmp(g->arch, "qwen3") == 0) c->arch = CV_ARCH_QWEN3;
    else if (strcmp(g->arch, "gemma3") == 0) c->arch = CV_ARCH_GEMMA3;
    else
        return cv_set_err(g->err, CV_ERR_UNSUPPORTED,
                          "%s: GGUF architecture '%.*s' is not supported (llama, mistral, qwen2, qwen3, gemma3)",
                          g->path, (int)(a.len > 60 ? 60 : a.len), a.p);
    if ((rc = check_arch_keys(g)) < 0) return rc;
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
    if ((rc = get_float(g, "attention.layer_norm_rms_epsilon", c->arch == CV_ARCH_GEMMA3 ? 1e-6 : 1e-5, &eps)) < 0 ||
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
    c->rope_layout = c->arch == CV_ARCH_LLAMA || c->arch == CV_ARCH_MISTRAL ? CV_ROPE_PAIRS : CV_ROPE_HALVES;
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
    if (cv_gguf_find_tensor(g->f, "rope_freqs.weight") && c->arch != CV_ARCH_LLAMA)
        return cv_set_err(g->err, CV_ERR_UNSUPPORTED,
                          "%s: tensor 'rope_freqs.weight' (per-frequency RoPE scaling) is supported for llama only",
                          g->path);
    if (c->arch == CV_ARCH_GEMMA3 && (rc = parse_gemma3(g, c)) < 0) return rc;

    /* vocabulary: <arch>.vocab_size, else the embedding's rows */
    const cv_gguf_tensor *emb = cv_gguf_find_tensor(g->f, "token_embd.weight");
    if (!emb) return cv_set_err(g->err, CV_ERR_FORMAT, "%s: tensor 'token_embd.weight' is missing", g->path);
    int64_t emb_rows = emb->n_dims == 2 ? emb->ne[1] : 0;
    if ((rc = get_size(g, "vocab_size", 0, emb_rows > 0 ? emb_rows : 1, big, &c->vocab_size)) < 0) return rc;
    c->tie_embeddings = cv_gguf_find_tensor(g->f, "output.weight") == NULL;
    c->qkv_bias = c->arch == CV_ARCH_QWEN2;
    c->qk_norm = c->arch == CV_ARCH_QWEN3 || c->arch == CV_ARCH_GEMMA3;
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
    "attn_q_norm.weight",
    "attn_k_norm.weight",
    "post_attention_norm.weight",
    "post_ffw_norm.weight",
};

static int bind_cb(void *loader, cv_tensor_view *out, const char *name, int64_t rows, int64_t cols, int required) {
    return bind((gguf_loader *)loader, out, name, rows, cols, required);
}

static int bind_all(gguf_loader *g, cv_checkpoint *ck) {
    const cv_model_config *c = &ck->cfg;
    int rc;
    if ((rc = bind(g, &ck->embed, "token_embd.weight", c->vocab_size, c->dim, 1)) < 0 ||
        (rc = bind(g, &ck->final_norm, "output_norm.weight", c->dim, -1, 1)) < 0 ||
        (rc = bind(g, &ck->lm_head, "output.weight", c->vocab_size, c->dim, 0)) < 0 ||
        (rc = bind(g, &ck->rope_freqs, "rope_freqs.weight", c->head_dim / 2, -1, 0)) < 0)
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
