/* HF checkpoint directories: config.json + model.safetensors, or
 * model.safetensors.index.json naming shard files.
 *
 * Llama, Mistral and Qwen2 share one tensor layout (Qwen2 adds q/k/v biases);
 * every tensor the model needs is looked up by its HF name and checked for
 * dtype, shape (from the config) and alignment before its view is made. */
#include "checkpoint.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "json.h"
#include "safetensors.h"

#define CV_MAX_LAYERS 65536
/* JSON files are parsed whole, within json.h's caps: far above real files
 * (config.json: a few kB; the shard index of a 671B model: ~9 MB). */
#define CV_MAX_CONFIG_JSON_BYTES ((size_t)1 << 20)
#define CV_MAX_INDEX_JSON_BYTES CV_JSON_MAX_BYTES

/* ---- config.json ---------------------------------------------------------- */

typedef struct cfg_reader {
    const cv_json *root;
    const char *path;
    cv_err *err;
} cfg_reader;

static const cv_json *get_set(const cfg_reader *r, const char *key) {
    const cv_json *v = cv_json_get(r->root, key);
    return (v && v->type != CV_JSON_NULL) ? v : NULL; /* null means "use the default" */
}

/* An integral JSON number (integer literal, or a float with no fraction). */
static int as_int(const cv_json *v, int64_t *out) {
    if (v->type != CV_JSON_NUMBER) return 0;
    if (v->is_int) { *out = v->integer; return 1; }
    if (v->number >= -9007199254740992.0 && v->number <= 9007199254740992.0 && floor(v->number) == v->number) {
        *out = (int64_t)v->number;
        return 1;
    }
    return 0;
}

/* Reads an integer field; absent or null gives def, or an error when required. */
static int get_int(const cfg_reader *r, const char *key, int required, int64_t def, int64_t *out) {
    const cv_json *v = get_set(r, key);
    if (!v) {
        if (required) return cv_set_err(r->err, CV_ERR_FORMAT, "%s: missing required key \"%s\"", r->path, key);
        *out = def;
        return 0;
    }
    if (!as_int(v, out))
        return cv_set_err(r->err, CV_ERR_FORMAT, "%s: \"%s\" must be an integer, got a %s", r->path, key,
                          v->type == CV_JSON_NUMBER ? "non-integral number" : cv_json_type_name(v->type));
    return 0;
}

/* A size field: an integer in [1, max]. */
static int get_size(const cfg_reader *r, const char *key, int required, int64_t def, int64_t max, int64_t *out) {
    int rc = get_int(r, key, required, def, out);
    if (rc < 0) return rc;
    if (*out <= 0 || *out > max)
        return cv_set_err(r->err, CV_ERR_FORMAT, "%s: \"%s\" is %lld, must be a positive integer up to %lld",
                          r->path, key, (long long)*out, (long long)max);
    return 0;
}

/* A number field of obj; prefix ("rope_scaling." or "") completes its name in messages. */
static int get_num(const cfg_reader *r, const cv_json *obj, const char *prefix, const char *key, int required,
                   double def, double *out) {
    const cv_json *v = cv_json_get(obj, key);
    if (!v || v->type == CV_JSON_NULL) {
        if (required)
            return cv_set_err(r->err, CV_ERR_FORMAT, "%s: missing required key \"%s%s\"", r->path, prefix, key);
        *out = def;
        return 0;
    }
    if (v->type != CV_JSON_NUMBER)
        return cv_set_err(r->err, CV_ERR_FORMAT, "%s: \"%s%s\" must be a number, got a %s", r->path, prefix, key,
                          cv_json_type_name(v->type));
    *out = v->number;
    return 0;
}

static int get_bool(const cfg_reader *r, const char *key, int def, int *out) {
    const cv_json *v = get_set(r, key);
    if (!v) { *out = def; return 0; }
    if (v->type != CV_JSON_BOOL)
        return cv_set_err(r->err, CV_ERR_FORMAT, "%s: \"%s\" must be true or false, got a %s", r->path, key,
                          cv_json_type_name(v->type));
    *out = v->boolean;
    return 0;
}

static int token_id(const cfg_reader *r, const char *key, const cv_json *v, int32_t *out) {
    int64_t x;
    if (!as_int(v, &x) || x < 0 || x > INT32_MAX)
        return cv_set_err(r->err, CV_ERR_FORMAT, "%s: \"%s\" must hold non-negative integer token ids", r->path,
                          key);
    *out = (int32_t)x;
    return 0;
}

static int parse_arch(const cfg_reader *r, cv_arch *arch) {
    static const struct { const char *arch, *model_type; cv_arch id; } known[] = {
        {"LlamaForCausalLM", "llama", CV_ARCH_LLAMA},
        {"MistralForCausalLM", "mistral", CV_ARCH_MISTRAL},
        {"Qwen2ForCausalLM", "qwen2", CV_ARCH_QWEN2},
    };
    const size_t n_known = sizeof known / sizeof known[0];
    const cv_json *a = get_set(r, "architectures");
    if (a) {
        if (a->type != CV_JSON_ARRAY || a->len == 0)
            return cv_set_err(r->err, CV_ERR_FORMAT, "%s: \"architectures\" must be a non-empty list of names",
                              r->path);
        for (size_t i = 0; i < a->len; i++) {
            if (a->items[i]->type != CV_JSON_STRING)
                return cv_set_err(r->err, CV_ERR_FORMAT, "%s: \"architectures\" must be a list of strings", r->path);
            for (size_t k = 0; k < n_known; k++)
                if (strcmp(a->items[i]->str, known[k].arch) == 0) { *arch = known[k].id; return 0; }
        }
        return cv_set_err(r->err, CV_ERR_UNSUPPORTED,
                          "%s: architecture \"%.100s\" is not supported (supported: LlamaForCausalLM, "
                          "MistralForCausalLM, Qwen2ForCausalLM)", r->path, a->items[0]->str);
    }
    const cv_json *mt = get_set(r, "model_type");
    if (!mt)
        return cv_set_err(r->err, CV_ERR_FORMAT, "%s: missing required key \"architectures\" (or \"model_type\")",
                          r->path);
    if (mt->type != CV_JSON_STRING)
        return cv_set_err(r->err, CV_ERR_FORMAT, "%s: \"model_type\" must be a string", r->path);
    for (size_t k = 0; k < n_known; k++)
        if (strcmp(mt->str, known[k].model_type) == 0) { *arch = known[k].id; return 0; }
    return cv_set_err(r->err, CV_ERR_UNSUPPORTED,
                      "%s: model_type \"%.100s\" is not supported (supported: llama, mistral, qwen2)", r->path,
                      mt->str);
}

static int parse_rope_scaling(const cfg_reader *r, cv_model_config *c) {
    const cv_json *s = get_set(r, "rope_scaling");
    if (!s) return 0;
    if (s->type != CV_JSON_OBJECT)
        return cv_set_err(r->err, CV_ERR_FORMAT, "%s: \"rope_scaling\" must be an object or null, got a %s", r->path,
                          cv_json_type_name(s->type));
    const cv_json *t = cv_json_get(s, "rope_type");
    if (!t || t->type == CV_JSON_NULL) t = cv_json_get(s, "type");
    if (!t || t->type != CV_JSON_STRING)
        return cv_set_err(r->err, CV_ERR_FORMAT, "%s: \"rope_scaling\" needs a string \"rope_type\" (or \"type\")",
                          r->path);
    if (strcmp(t->str, "default") == 0) return 0;
    if (strcmp(t->str, "llama3") != 0)
        return cv_set_err(r->err, CV_ERR_UNSUPPORTED,
                          "%s: rope_scaling type \"%.60s\" is not supported (supported: llama3, default)", r->path,
                          t->str);
    double factor = 0, lo = 0, hi = 0, orig = 0;
    int rc;
    if ((rc = get_num(r, s, "rope_scaling.", "factor", 1, 0, &factor)) < 0 || (rc = get_num(r, s, "rope_scaling.", "low_freq_factor", 1, 0, &lo)) < 0 ||
        (rc = get_num(r, s, "rope_scaling.", "high_freq_factor", 1, 0, &hi)) < 0 ||
        (rc = get_num(r, s, "rope_scaling.", "original_max_position_embeddings", 1, 0, &orig)) < 0)
        return rc;
    /* judged as the floats they are stored as (lo and hi must stay apart: the model divides by hi - lo) */
    if (!((float)factor > 0) || !((float)lo > 0) || !((float)hi > (float)lo) || factor > 1e6 || hi > 1e6)
        return cv_set_err(r->err, CV_ERR_FORMAT,
                          "%s: rope_scaling llama3 needs factor > 0 and 0 < low_freq_factor < high_freq_factor "
                          "(got factor=%g, low_freq_factor=%g, high_freq_factor=%g)", r->path, factor, lo, hi);
    if (!(orig >= 1) || orig > INT32_MAX || floor(orig) != orig)
        return cv_set_err(r->err, CV_ERR_FORMAT,
                          "%s: rope_scaling original_max_position_embeddings must be a positive integer", r->path);
    c->rope_llama3 = 1;
    c->rope_factor = (float)factor;
    c->rope_low_freq_factor = (float)lo;
    c->rope_high_freq_factor = (float)hi;
    c->rope_original_max_pos = (int64_t)orig;
    return 0;
}

static int parse_eos(const cfg_reader *r, cv_model_config *c, int has_default) {
    const cv_json *v = cv_json_get(r->root, "eos_token_id");
    c->n_eos = 0;
    if (!v) {
        if (has_default) { c->eos_ids[0] = 2; c->n_eos = 1; }
        return 0;
    }
    if (v->type == CV_JSON_NULL) return 0;
    if (v->type == CV_JSON_ARRAY) {
        if (v->len > CV_MAX_EOS)
            return cv_set_err(r->err, CV_ERR_FORMAT, "%s: \"eos_token_id\" lists %zu ids, at most %d are supported",
                              r->path, v->len, CV_MAX_EOS);
        for (size_t i = 0; i < v->len; i++) {
            int rc = token_id(r, "eos_token_id", v->items[i], &c->eos_ids[c->n_eos]);
            if (rc < 0) return rc;
            c->n_eos++;
        }
        return 0;
    }
    int rc = token_id(r, "eos_token_id", v, &c->eos_ids[0]);
    if (rc < 0) return rc;
    c->n_eos = 1;
    return 0;
}

int cv_hf_config_parse(cv_model_config *cfg, const char *text, size_t len, const char *path, cv_err *err) {
    cv_json_doc doc;
    cv_model_config c;
    int rc;
    memset(&c, 0, sizeof c);
    memset(cfg, 0, sizeof *cfg);
    if ((rc = cv_json_parse(&doc, text, len, path, err)) < 0) return rc;
    cfg_reader r = {doc.root, path, err};
    if (doc.root->type != CV_JSON_OBJECT) {
        rc = cv_set_err(err, CV_ERR_FORMAT, "%s: top level is a JSON %s, expected an object", path,
                        cv_json_type_name(doc.root->type));
        goto done;
    }
    if ((rc = parse_arch(&r, &c.arch)) < 0) goto done;
    if (get_set(&r, "quantization_config")) {
        rc = cv_set_err(err, CV_ERR_UNSUPPORTED, "%s: quantized checkpoints (\"quantization_config\") are not supported",
                        path);
        goto done;
    }
    const int64_t big = INT32_MAX;
    if ((rc = get_size(&r, "hidden_size", 1, 0, big, &c.dim)) < 0) goto done;
    if ((rc = get_size(&r, "intermediate_size", 1, 0, big, &c.hidden_dim)) < 0) goto done;
    if ((rc = get_size(&r, "num_hidden_layers", 1, 0, CV_MAX_LAYERS, &c.n_layers)) < 0) goto done;
    if ((rc = get_size(&r, "num_attention_heads", 1, 0, big, &c.n_heads)) < 0) goto done;
    if ((rc = get_size(&r, "vocab_size", 1, 0, big, &c.vocab_size)) < 0) goto done;
    if ((rc = get_size(&r, "num_key_value_heads", 0, c.n_heads, big, &c.n_kv_heads)) < 0) goto done;
    if (c.n_kv_heads > c.n_heads || c.n_heads % c.n_kv_heads != 0) {
        rc = cv_set_err(err, CV_ERR_FORMAT,
                        "%s: \"num_attention_heads\" (%lld) is not a multiple of \"num_key_value_heads\" (%lld)", path,
                        (long long)c.n_heads, (long long)c.n_kv_heads);
        goto done;
    }
    if (!get_set(&r, "head_dim") && c.dim % c.n_heads != 0) {
        rc = cv_set_err(err, CV_ERR_FORMAT,
                        "%s: \"hidden_size\" (%lld) is not a multiple of \"num_attention_heads\" (%lld) and no "
                        "\"head_dim\" is given", path, (long long)c.dim, (long long)c.n_heads);
        goto done;
    }
    if ((rc = get_size(&r, "head_dim", 0, c.dim / c.n_heads, big, &c.head_dim)) < 0) goto done;
    if (c.head_dim % 2 != 0) {
        rc = cv_set_err(err, CV_ERR_FORMAT, "%s: \"head_dim\" (%lld) must be even for RoPE", path,
                        (long long)c.head_dim);
        goto done;
    }
    if (c.n_heads > big / c.head_dim) {
        rc = cv_set_err(err, CV_ERR_FORMAT, "%s: \"num_attention_heads\" * \"head_dim\" is too large", path);
        goto done;
    }
    int64_t def_max_pos = c.arch == CV_ARCH_LLAMA ? 2048 : c.arch == CV_ARCH_MISTRAL ? 131072 : 32768;
    if ((rc = get_size(&r, "max_position_embeddings", 0, def_max_pos, big, &c.max_pos)) < 0) goto done;

    double eps = 0, theta = 0;
    const cv_json *root = doc.root;
    if ((rc = get_num(&r, root, "", "rms_norm_eps", 0, 1e-6, &eps)) < 0) goto done;
    /* judged as the float it is stored as: 1e-85 passes as a double but is 0 as a float */
    if (!(eps > 0) || eps >= 1 || !((float)eps > 0)) {
        rc = cv_set_err(err, CV_ERR_FORMAT, "%s: \"rms_norm_eps\" (%g) must be in (0, 1)", path, eps);
        goto done;
    }
    if ((rc = get_num(&r, root, "", "rope_theta", 0, 10000.0, &theta)) < 0) goto done;
    if (!(theta > 0) || theta > 1e30 || !((float)theta > 0)) {
        rc = cv_set_err(err, CV_ERR_FORMAT, "%s: \"rope_theta\" (%g) must be a positive number", path, theta);
        goto done;
    }
    c.rms_eps = (float)eps;
    c.rope_theta = (float)theta;
    c.rope_layout = CV_ROPE_HALVES;
    if ((rc = parse_rope_scaling(&r, &c)) < 0) goto done;
    if ((rc = get_bool(&r, "tie_word_embeddings", 0, &c.tie_embeddings)) < 0) goto done;
    c.qkv_bias = c.arch == CV_ARCH_QWEN2;

    /* features of these families that Conveyor does not implement */
    const cv_json *act = get_set(&r, "hidden_act");
    if (act && (act->type != CV_JSON_STRING || strcmp(act->str, "silu") != 0)) {
        rc = cv_set_err(err, CV_ERR_UNSUPPORTED, "%s: \"hidden_act\" %s%.40s%s is not supported (only \"silu\")", path,
                        act->type == CV_JSON_STRING ? "\"" : "",
                        act->type == CV_JSON_STRING ? act->str : cv_json_type_name(act->type),
                        act->type == CV_JSON_STRING ? "\"" : "");
        goto done;
    }
    int flag = 0;
    if ((rc = get_bool(&r, "attention_bias", 0, &flag)) < 0) goto done;
    if (flag && c.arch != CV_ARCH_QWEN2) {
        rc = cv_set_err(err, CV_ERR_UNSUPPORTED, "%s: \"attention_bias\": true is not supported", path);
        goto done;
    }
    if ((rc = get_bool(&r, "mlp_bias", 0, &flag)) < 0) goto done;
    if (flag) {
        rc = cv_set_err(err, CV_ERR_UNSUPPORTED, "%s: \"mlp_bias\": true is not supported", path);
        goto done;
    }
    /* sliding-window attention is not implemented: full attention is exact
     * only up to the window, so the usable context stops there */
    int use_sw = c.arch == CV_ARCH_MISTRAL;
    if (c.arch == CV_ARCH_QWEN2 && (rc = get_bool(&r, "use_sliding_window", 0, &use_sw)) < 0) goto done;
    if (use_sw && get_set(&r, "sliding_window")) {
        int64_t sw;
        if ((rc = get_size(&r, "sliding_window", 0, 0, big, &sw)) < 0) goto done;
        if (sw < c.max_pos) c.max_pos = sw;
    }

    const cv_json *bos = cv_json_get(root, "bos_token_id");
    c.bos_id = -1;
    if (!bos) {
        if (c.arch != CV_ARCH_QWEN2) c.bos_id = 1;
    } else if (bos->type != CV_JSON_NULL) {
        if ((rc = token_id(&r, "bos_token_id", bos, &c.bos_id)) < 0) goto done;
    }
    if ((rc = parse_eos(&r, &c, c.arch != CV_ARCH_QWEN2)) < 0) goto done;

    const cv_json *dt = get_set(&r, "torch_dtype");
    const char *dt_key = "torch_dtype";
    if (!dt) { dt = get_set(&r, "dtype"); dt_key = "dtype"; } /* newer transformers */
    c.torch_dtype = CV_DTYPE_INVALID; /* filled from the weights when absent */
    if (dt) {
        if (dt->type != CV_JSON_STRING) {
            rc = cv_set_err(err, CV_ERR_FORMAT, "%s: \"%s\" must be a string", path, dt_key);
            goto done;
        }
        if (strcmp(dt->str, "float32") == 0) c.torch_dtype = CV_F32;
        else if (strcmp(dt->str, "float16") == 0) c.torch_dtype = CV_F16;
        else if (strcmp(dt->str, "bfloat16") == 0) c.torch_dtype = CV_BF16;
        else {
            rc = cv_set_err(err, CV_ERR_UNSUPPORTED,
                            "%s: \"%s\" \"%.40s\" is not supported (float32, float16 or bfloat16)", path, dt_key,
                            dt->str);
            goto done;
        }
    }
    *cfg = c;
    rc = 0;
done:
    cv_json_free(&doc);
    return rc;
}

/* ---- weights --------------------------------------------------------------- */

typedef struct hf_loader {
    const char *dir;
    cv_err *err;
    cv_st_file *files;     /* [n_files] */
    char **labels;         /* full path of each file [n_labels] */
    int n_labels;
    int n_files;           /* files opened so far */
    cv_json_doc index;     /* model.safetensors.index.json, when sharded */
    char *index_path;
    const cv_json *weight_map; /* NULL for a single file */
    const char **shards;   /* distinct shard names, sorted [n_files] */
} hf_loader;

static char *join(const char *dir, const char *name) {
    size_t a = strlen(dir), b = strlen(name);
    int slash = a > 0 && dir[a - 1] == '/';
    char *p = malloc(a + b + 2);
    if (!p) return NULL;
    memcpy(p, dir, a);
    if (!slash) p[a++] = '/';
    memcpy(p + a, name, b + 1);
    return p;
}

static int file_exists(const char *path) {
    struct stat st;
    return stat(path, &st) == 0;
}

static int cmp_str(const void *x, const void *y) {
    return strcmp(*(const char *const *)x, *(const char *const *)y);
}

/* Reads the shard index and opens every distinct shard once. */
static int open_shards(hf_loader *h) {
    int rc = 0;
    void *map = NULL;
    size_t len = 0;
    cv_err *err = h->err;
    if ((rc = cv_map_file(&map, &len, h->index_path, err)) < 0) goto done;
    if (len > CV_MAX_INDEX_JSON_BYTES) {
        rc = cv_set_err(err, CV_ERR_FORMAT, "%s: %zu bytes, more than the %zu a shard index may have", h->index_path,
                        len, CV_MAX_INDEX_JSON_BYTES);
        goto done;
    }
    if ((rc = cv_json_parse(&h->index, map, len, h->index_path, err)) < 0) goto done;
    const cv_json *root = h->index.root;
    const cv_json *wm = cv_json_get(root, "weight_map");
    if (root->type != CV_JSON_OBJECT || !wm || wm->type != CV_JSON_OBJECT) {
        rc = cv_set_err(err, CV_ERR_FORMAT, "%s: %s", h->index_path,
                        root->type != CV_JSON_OBJECT ? "top level is not a JSON object"
                        : !wm ? "missing required key \"weight_map\"" : "\"weight_map\" is not an object");
        goto done;
    }
    if (wm->len == 0) {
        rc = cv_set_err(err, CV_ERR_FORMAT, "%s: \"weight_map\" is empty", h->index_path);
        goto done;
    }
    h->weight_map = wm;
    h->shards = malloc(wm->len * sizeof *h->shards);
    if (!h->shards) { rc = cv_set_err(err, CV_ERR_NOMEM, "%s: out of memory", h->index_path); goto done; }
    for (size_t i = 0; i < wm->len; i++) {
        const cv_json *v = wm->items[i];
        if (v->type != CV_JSON_STRING || v->len == 0 || v->len > 255 /* NAME_MAX */ || strlen(v->str) != v->len ||
            strchr(v->str, '/') || strcmp(v->str, ".") == 0 || strcmp(v->str, "..") == 0) {
            rc = cv_set_err(err, CV_ERR_FORMAT,
                            "%s: weight_map entry for '%.200s' must be a plain file name (at most 255 bytes) in "
                            "the same directory", h->index_path, v->key);
            goto done;
        }
        h->shards[i] = v->str;
    }
    qsort(h->shards, wm->len, sizeof *h->shards, cmp_str);
    size_t n = 0;
    for (size_t i = 0; i < wm->len; i++)
        if (n == 0 || strcmp(h->shards[n - 1], h->shards[i]) != 0) h->shards[n++] = h->shards[i];
    if (n > CV_MAX_MAPS) {
        rc = cv_set_err(err, CV_ERR_UNSUPPORTED, "%s: %zu shard files, at most %d are supported", h->index_path, n,
                        CV_MAX_MAPS);
        goto done;
    }
    h->files = calloc(n, sizeof *h->files);
    h->labels = calloc(n, sizeof *h->labels);
    if (!h->files || !h->labels) {
        rc = cv_set_err(err, CV_ERR_NOMEM, "%s: out of memory", h->index_path);
        goto done;
    }
    h->n_labels = (int)n;
    for (size_t i = 0; i < n; i++) {
        h->labels[i] = join(h->dir, h->shards[i]);
        if (!h->labels[i]) { rc = cv_set_err(err, CV_ERR_NOMEM, "%s: out of memory", h->index_path); goto done; }
        rc = cv_st_open(&h->files[i], h->labels[i], h->labels[i], err);
        if (rc < 0) {
            if (rc == CV_ERR_NOTFOUND)
                cv_set_err(err, CV_ERR_NOTFOUND, "%s: weight_map names shard '%.200s', which does not exist (%s)",
                           h->index_path, h->shards[i], h->labels[i]);
            goto done;
        }
        h->n_files = (int)i + 1;
    }
    rc = 0;
done:
    cv_unmap_file(map, len);
    return rc;
}

static int open_single(hf_loader *h, const char *path) {
    h->files = calloc(1, sizeof *h->files);
    h->labels = calloc(1, sizeof *h->labels);
    if (!h->files || !h->labels) return cv_set_err(h->err, CV_ERR_NOMEM, "%s: out of memory", path);
    h->n_labels = 1;
    h->labels[0] = malloc(strlen(path) + 1);
    if (!h->labels[0]) return cv_set_err(h->err, CV_ERR_NOMEM, "%s: out of memory", path);
    strcpy(h->labels[0], path);
    int rc = cv_st_open(&h->files[0], h->labels[0], h->labels[0], h->err);
    if (rc < 0) return rc;
    h->n_files = 1;
    return 0;
}

/* Finds tensor name and makes a view of it after checking dtype, shape and
 * alignment. cols < 0 means a vector [rows]. Missing is an error only when
 * required (out stays absent otherwise). */
static int bind(hf_loader *h, cv_tensor_view *out, const char *name, int64_t rows, int64_t cols, int required) {
    const cv_st_file *f = NULL;
    const char *where = NULL;
    if (h->weight_map) {
        const cv_json *e = cv_json_get(h->weight_map, name);
        if (!e) {
            if (!required) return 0;
            return cv_set_err(h->err, CV_ERR_FORMAT, "%s: weight_map has no entry for tensor '%s'", h->index_path,
                              name);
        }
        size_t lo = 0, hi = (size_t)h->n_files;
        while (lo < hi) { /* shards[] is sorted and unique */
            size_t mid = lo + (hi - lo) / 2;
            int c = strcmp(h->shards[mid], e->str);
            if (c == 0) { f = &h->files[mid]; where = h->labels[mid]; break; }
            if (c < 0) lo = mid + 1;
            else hi = mid;
        }
        if (!f) return cv_set_err(h->err, CV_ERR_FORMAT, "%s: shard '%s' was not opened", h->index_path, e->str);
    } else {
        f = &h->files[0];
        where = h->labels[0];
    }
    const cv_st_tensor *t = cv_st_find(f, name);
    if (!t) {
        if (!required && !h->weight_map) return 0;
        if (h->weight_map)
            return cv_set_err(h->err, CV_ERR_FORMAT, "%s: tensor '%s' is missing (the index lists it in this shard)",
                              where, name);
        return cv_set_err(h->err, CV_ERR_FORMAT, "%s: tensor '%s' is missing", where, name);
    }
    if (t->dtype != CV_F32 && t->dtype != CV_F16 && t->dtype != CV_BF16)
        return cv_set_err(h->err, CV_ERR_UNSUPPORTED,
                          "%s: tensor '%s' has dtype %s; Conveyor loads F32, F16 and BF16 weights", where, name,
                          t->dtype_name);
    int ndim = cols < 0 ? 1 : 2;
    int64_t want[2] = {rows, cols};
    if (t->ndim != ndim || t->shape[0] != rows || (ndim == 2 && t->shape[1] != cols)) {
        char got[160], exp[64];
        cv_st_shape_str(got, sizeof got, t->shape, t->ndim);
        cv_st_shape_str(exp, sizeof exp, want, ndim);
        return cv_set_err(h->err, CV_ERR_FORMAT, "%s: tensor '%s' has shape %s, config.json implies %s", where, name,
                          got, exp);
    }
    if ((uintptr_t)t->data % t->elem_size != 0)
        return cv_set_err(h->err, CV_ERR_UNSUPPORTED,
                          "%s: tensor '%s' data is not aligned to its %zu-byte elements (header padding?)", where,
                          name, t->elem_size);
    out->data = t->data;
    out->dtype = t->dtype;
    out->ndim = ndim;
    out->shape[0] = rows;
    out->shape[1] = ndim == 2 ? cols : 0;
    return 0;
}

/* Layer tensor names in cv_layer_slot_at's order. */
static const char *const LAYER_NAMES[CV_LAYER_TENSORS] = {
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_proj.bias",
    "self_attn.k_proj.bias",
    "self_attn.v_proj.bias",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
};

static int bind_cb(void *loader, cv_tensor_view *out, const char *name, int64_t rows, int64_t cols, int required) {
    return bind((hf_loader *)loader, out, name, rows, cols, required);
}

static int bind_all(hf_loader *h, cv_checkpoint *ck) {
    const cv_model_config *c = &ck->cfg;
    int rc;
    if ((rc = bind(h, &ck->embed, "model.embed_tokens.weight", c->vocab_size, c->dim, 1)) < 0) return rc;
    if ((rc = bind(h, &ck->final_norm, "model.norm.weight", c->dim, -1, 1)) < 0) return rc;
    if (!c->tie_embeddings) {
        if ((rc = bind(h, &ck->lm_head, "lm_head.weight", c->vocab_size, c->dim, 1)) < 0) return rc;
    }
    return cv_checkpoint_bind_layers(ck, "model.layers.", LAYER_NAMES, bind_cb, h);
}

int cv_checkpoint_open_hf(cv_checkpoint *ck, const char *dir, cv_err *err) {
    hf_loader h;
    int rc = 0;
    char *cfg_path = NULL, *single_path = NULL;
    void *cfg_map = NULL;
    size_t cfg_len = 0;
    memset(&h, 0, sizeof h);
    memset(ck, 0, sizeof *ck);
    h.dir = dir;
    h.err = err;
    ck->format = CV_FMT_HF;

    cfg_path = join(dir, "config.json");
    single_path = join(dir, "model.safetensors");
    h.index_path = join(dir, "model.safetensors.index.json");
    if (!cfg_path || !single_path || !h.index_path) {
        rc = cv_set_err(err, CV_ERR_NOMEM, "%s: out of memory", dir);
        goto done;
    }
    if ((rc = cv_map_file(&cfg_map, &cfg_len, cfg_path, err)) < 0) {
        if (rc == CV_ERR_NOTFOUND)
            cv_set_err(err, CV_ERR_NOTFOUND, "%s: no config.json in this directory (not a HF checkpoint?)", cfg_path);
        goto done;
    }
    if (cfg_len > CV_MAX_CONFIG_JSON_BYTES) {
        rc = cv_set_err(err, CV_ERR_FORMAT, "%s: %zu bytes, more than the %zu a config.json may have", cfg_path,
                        cfg_len, CV_MAX_CONFIG_JSON_BYTES);
        goto done;
    }
    if ((rc = cv_hf_config_parse(&ck->cfg, cfg_map, cfg_len, cfg_path, err)) < 0) goto done;

    if (file_exists(single_path)) {
        if ((rc = open_single(&h, single_path)) < 0) goto done;
    } else if (file_exists(h.index_path)) {
        if ((rc = open_shards(&h)) < 0) goto done;
    } else {
        char *bin = join(dir, "pytorch_model.bin");
        int has_bin = bin && file_exists(bin);
        free(bin);
        rc = cv_set_err(err, has_bin ? CV_ERR_UNSUPPORTED : CV_ERR_NOTFOUND,
                        "%s: no model.safetensors or model.safetensors.index.json%s", dir,
                        has_bin ? " (PyTorch .bin weights are not supported; convert them to safetensors)" : "");
        goto done;
    }

    ck->layers = calloc((size_t)ck->cfg.n_layers, sizeof *ck->layers);
    if (!ck->layers) {
        rc = cv_set_err(err, CV_ERR_NOMEM, "%s: out of memory for %lld layers", dir, (long long)ck->cfg.n_layers);
        goto done;
    }
    if ((rc = bind_all(&h, ck)) < 0) goto done;
    if (ck->cfg.torch_dtype == CV_DTYPE_INVALID) ck->cfg.torch_dtype = ck->embed.dtype;

    /* the views point into the mappings: hand them to the checkpoint */
    for (int i = 0; i < h.n_files; i++) {
        cv_st_release_map(&h.files[i], &ck->maps[i], &ck->map_lens[i]);
        ck->n_maps = i + 1;
    }
    rc = 0;
done:
    for (int i = 0; i < h.n_files; i++) cv_st_close(&h.files[i]);
    for (int i = 0; h.labels && i < h.n_labels; i++) free(h.labels[i]);
    free(h.labels);
    free(h.files);
    free(h.shards);
    cv_json_free(&h.index);
    free(h.index_path);
    free(cfg_path);
    free(single_path);
    cv_unmap_file(cfg_map, cfg_len);
    if (rc < 0) cv_checkpoint_close(ck);
    return rc;
}
