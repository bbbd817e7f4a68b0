/* GGUF parsing: see gguf.h. Reads go through a bounds-checked cursor; every
 * count is checked against the bytes left before anything is allocated for it. */
#include "gguf.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../base/quant_format.h"
#include "mapped_file.h"

#define GGUF_DEFAULT_ALIGNMENT 32
#define GGUF_MIN_ALIGNMENT 8 /* the spec: a multiple of 8 (and, as ggml reads it, a power of two) */
#define GGUF_MAX_ALIGNMENT (1u << 20)

typedef struct cursor {
    const unsigned char *buf;
    size_t len, pos;
    const char *label;
    cv_err *err;
} cursor;

static uint64_t rd_le(const unsigned char *p, int n) {
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

static size_t left(const cursor *c) { return c->len - c->pos; }

/* Takes n bytes; CV_ERR_FORMAT naming `what` when fewer are left. */
static int take(cursor *c, size_t n, const char *what, const unsigned char **out) {
    if (n > left(c))
        return cv_set_err(c->err, CV_ERR_FORMAT, "%s: truncated: %s needs %zu bytes at offset %zu, %zu left",
                          c->label, what, n, c->pos, left(c));
    if (out) *out = c->buf + c->pos;
    c->pos += n;
    return 0;
}

static int rd_u32(cursor *c, const char *what, uint32_t *out) {
    const unsigned char *p = NULL;
    int rc = take(c, 4, what, &p);
    if (rc < 0) return rc;
    *out = (uint32_t)rd_le(p, 4);
    return 0;
}

static int rd_u64(cursor *c, const char *what, uint64_t *out) {
    const unsigned char *p = NULL;
    int rc = take(c, 8, what, &p);
    if (rc < 0) return rc;
    *out = rd_le(p, 8);
    return 0;
}

static int rd_str(cursor *c, const char *what, cv_gguf_str *out) {
    uint64_t n;
    int rc = rd_u64(c, what, &n);
    if (rc < 0) return rc;
    if (n > left(c))
        return cv_set_err(c->err, CV_ERR_FORMAT,
                          "%s: %s at offset %zu claims %llu bytes, only %zu are left in the file", c->label, what,
                          c->pos - 8, (unsigned long long)n, left(c));
    const unsigned char *p = NULL;
    take(c, (size_t)n, what, &p);
    out->p = (const char *)p;
    out->len = (size_t)n;
    return 0;
}

size_t cv_gguf_scalar_size(cv_gguf_type t) {
    switch (t) {
    case CV_GGUF_U8: case CV_GGUF_I8: case CV_GGUF_BOOL: return 1;
    case CV_GGUF_U16: case CV_GGUF_I16: return 2;
    case CV_GGUF_U32: case CV_GGUF_I32: case CV_GGUF_F32: return 4;
    case CV_GGUF_U64: case CV_GGUF_I64: case CV_GGUF_F64: return 8;
    default: return 0;
    }
}

const char *cv_gguf_ggml_type_name(uint32_t t) {
    static const char *const names[] = {
        "F32", "F16", "Q4_0", "Q4_1", "Q4_2", "Q4_3", "Q5_0", "Q5_1", "Q8_0", "Q8_1", "Q2_K", "Q3_K",
        "Q4_K", "Q5_K", "Q6_K", "Q8_K", "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ4_NL", "IQ3_S",
        "IQ2_S", "IQ4_XS", "I8", "I16", "I32", "I64", "F64", "IQ1_M", "BF16"};
    return t < sizeof names / sizeof names[0] ? names[t] : NULL;
}

static cv_dtype ggml_dtype(uint32_t t) {
    switch (t) {
    case 0: return CV_F32;
    case 1: return CV_F16;
    case 2: return CV_Q4_0;
    case 3: return CV_Q4_1;
    case 6: return CV_Q5_0;
    case 7: return CV_Q5_1;
    case 8: return CV_Q8_0;
    case 10: return CV_Q2_K;
    case 11: return CV_Q3_K;
    case 12: return CV_Q4_K;
    case 13: return CV_Q5_K;
    case 14: return CV_Q6_K;
    case 30: return CV_BF16;
    default: return CV_DTYPE_INVALID;
    }
}

/* What a value of key is called in errors: "the string value of 'KEY'" or
 * "the value of 'KEY'" (made once per key, not per element of an array). */
static void value_name(char *what, size_t size, cv_gguf_type t, const cv_gguf_str *key) {
    snprintf(what, size, t == CV_GGUF_STRING ? "the string value of '%.*s'" : "the value of '%.*s'",
             (int)(key->len > 100 ? 100 : key->len), key->p);
}

/* Skips one value of type t (not an array), named what in errors; strings are checked. */
static int skip_scalar(cursor *c, cv_gguf_type t, const char *what) {
    if (t == CV_GGUF_STRING) {
        cv_gguf_str s;
        return rd_str(c, what, &s);
    }
    return take(c, cv_gguf_scalar_size(t), what, NULL);
}

static int parse_kv(cursor *c, cv_gguf_kv *kv, uint64_t index) {
    char what[64];
    snprintf(what, sizeof what, "metadata key #%llu", (unsigned long long)index);
    int rc = rd_str(c, what, &kv->key);
    if (rc < 0) return rc;
    const int kl = (int)(kv->key.len > 100 ? 100 : kv->key.len);
    if (kv->key.len == 0)
        return cv_set_err(c->err, CV_ERR_FORMAT, "%s: metadata key #%llu is empty", c->label,
                          (unsigned long long)index);
    uint32_t t;
    if ((rc = rd_u32(c, "a metadata value type", &t)) < 0) return rc;
    if (t > CV_GGUF_F64)
        return cv_set_err(c->err, CV_ERR_FORMAT, "%s: metadata '%.*s' has unknown value type %u", c->label, kl,
                          kv->key.p, t);
    kv->type = (cv_gguf_type)t;
    kv->count = 1;
    char value_what[160];
    if (t != CV_GGUF_ARRAY) {
        kv->value = c->buf + c->pos;
        value_name(value_what, sizeof value_what, kv->type, &kv->key);
        return skip_scalar(c, kv->type, value_what);
    }
    uint32_t et;
    uint64_t n;
    if ((rc = rd_u32(c, "an array element type", &et)) < 0 || (rc = rd_u64(c, "an array length", &n)) < 0)
        return rc;
    if (et > CV_GGUF_F64)
        return cv_set_err(c->err, CV_ERR_FORMAT, "%s: metadata array '%.*s' has unknown element type %u", c->label,
                          kl, kv->key.p, et);
    if (et == CV_GGUF_ARRAY)
        return cv_set_err(c->err, CV_ERR_UNSUPPORTED, "%s: metadata '%.*s' is an array of arrays (not supported)",
                          c->label, kl, kv->key.p);
    kv->elem_type = (cv_gguf_type)et;
    kv->count = n;
    kv->value = c->buf + c->pos;
    if (et == CV_GGUF_STRING) {
        if (n > left(c) / 8)
            return cv_set_err(c->err, CV_ERR_FORMAT,
                              "%s: metadata array '%.*s' claims %llu strings, more than the %zu bytes left hold",
                              c->label, kl, kv->key.p, (unsigned long long)n, left(c));
        value_name(value_what, sizeof value_what, CV_GGUF_STRING, &kv->key);
        for (uint64_t i = 0; i < n; i++)
            if ((rc = skip_scalar(c, CV_GGUF_STRING, value_what)) < 0) return rc;
        return 0;
    }
    size_t es = cv_gguf_scalar_size(kv->elem_type);
    if (n > left(c) / es)
        return cv_set_err(c->err, CV_ERR_FORMAT,
                          "%s: metadata array '%.*s' claims %llu elements of %zu bytes, only %zu bytes are left",
                          c->label, kl, kv->key.p, (unsigned long long)n, es, left(c));
    return take(c, (size_t)n * es, "an array", NULL);
}

static int cmp_str(const cv_gguf_str *a, const cv_gguf_str *b) {
    size_t n = a->len < b->len ? a->len : b->len;
    int r = memcmp(a->p, b->p, n);
    if (r) return r;
    return a->len < b->len ? -1 : a->len > b->len;
}

static int cmp_kv(const void *x, const void *y) {
    return cmp_str(&((const cv_gguf_kv *)x)->key, &((const cv_gguf_kv *)y)->key);
}

static int cmp_tensor(const void *x, const void *y) {
    return cmp_str(&((const cv_gguf_tensor *)x)->name, &((const cv_gguf_tensor *)y)->name);
}

static int parse_tensor_info(cursor *c, cv_gguf_tensor *t, uint64_t index) {
    char what[64];
    snprintf(what, sizeof what, "the name of tensor #%llu", (unsigned long long)index);
    int rc = rd_str(c, what, &t->name);
    if (rc < 0) return rc;
    const int nl = (int)(t->name.len > 100 ? 100 : t->name.len);
    uint32_t nd;
    if ((rc = rd_u32(c, "a tensor's dimension count", &nd)) < 0) return rc;
    if (nd < 1 || nd > CV_GGUF_MAX_DIMS)
        return cv_set_err(c->err, CV_ERR_FORMAT, "%s: tensor '%.*s' has %u dimensions (1 to %d are valid)",
                          c->label, nl, t->name.p, nd, CV_GGUF_MAX_DIMS);
    t->n_dims = (int)nd;
    uint64_t numel = 1;
    for (uint32_t i = 0; i < nd; i++) {
        uint64_t ne;
        if ((rc = rd_u64(c, "a tensor dimension", &ne)) < 0) return rc;
        if (ne == 0 || ne > (uint64_t)INT64_MAX || numel > (uint64_t)INT64_MAX / ne)
            return cv_set_err(c->err, CV_ERR_FORMAT, "%s: tensor '%.*s' has a bad dimension %llu", c->label, nl,
                              t->name.p, (unsigned long long)ne);
        t->ne[i] = (int64_t)ne;
        numel *= ne;
    }
    if ((rc = rd_u32(c, "a tensor type", &t->ggml_type)) < 0) return rc;
    t->dtype = ggml_dtype(t->ggml_type);
    if (t->dtype == CV_DTYPE_INVALID) {
        const char *tn = cv_gguf_ggml_type_name(t->ggml_type);
        if (tn)
            return cv_set_err(c->err, CV_ERR_UNSUPPORTED,
                              "%s: tensor '%.*s' has type %s, which is not supported (F32, F16, BF16, Q8_0, "
                              "Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K)", c->label, nl, t->name.p, tn);
        return cv_set_err(c->err, CV_ERR_FORMAT, "%s: tensor '%.*s' has unknown tensor type %u", c->label, nl,
                          t->name.p, t->ggml_type);
    }
    if (cv_dtype_is_quant(t->dtype) && t->ne[0] % (int64_t)cv_quant_block_elems(t->dtype) != 0)
        return cv_set_err(c->err, CV_ERR_FORMAT,
                          "%s: tensor '%.*s' of type %s has rows of %lld elements, not a multiple of the "
                          "block size %zu", c->label, nl, t->name.p, cv_gguf_ggml_type_name(t->ggml_type),
                          (long long)t->ne[0], cv_quant_block_elems(t->dtype));
    t->nbytes = cv_dtype_bytes(t->dtype, (size_t)numel);
    if (t->nbytes == 0 || numel > SIZE_MAX)
        return cv_set_err(c->err, CV_ERR_FORMAT, "%s: tensor '%.*s' is too large", c->label, nl, t->name.p);
    return rd_u64(c, "a tensor offset", &t->offset);
}

int cv_gguf_is_gguf(const void *buf, size_t len) { return buf && len >= 4 && memcmp(buf, "GGUF", 4) == 0; }

int cv_gguf_parse(cv_gguf_file *f, const void *buf, size_t len, const char *label, cv_err *err) {
    memset(f, 0, sizeof *f);
    f->label = label;
    cursor c = {buf, len, 0, label, err};
    int rc;
    if (!cv_gguf_is_gguf(buf, len))
        return cv_set_err(err, CV_ERR_FORMAT, "%s: not a GGUF file (bad magic; expected \"GGUF\")", label);
    c.pos = 4;
    uint64_t n_tensors, n_kvs;
    if ((rc = rd_u32(&c, "the version", &f->version)) < 0) goto fail;
    if (f->version != 2 && f->version != 3) {
        if (f->version == 0x02000000u || f->version == 0x03000000u)
            rc = cv_set_err(err, CV_ERR_FORMAT, "%s: big-endian GGUF files are not supported", label);
        else
            rc = cv_set_err(err, CV_ERR_FORMAT, "%s: unknown GGUF version %u is not supported (versions 2 and 3)",
                            label, f->version);
        goto fail;
    }
    if ((rc = rd_u64(&c, "the tensor count", &n_tensors)) < 0 || (rc = rd_u64(&c, "the metadata count", &n_kvs)) < 0)
        goto fail;
    /* a key is at least 8 + 1 + 4 bytes, a tensor info at least 8 + 1 + 4 + 8 + 4 + 8 */
    if (n_kvs > left(&c) / 13 || n_tensors > left(&c) / 33) {
        rc = cv_set_err(err, CV_ERR_FORMAT, "%s: header claims %llu metadata entries and %llu tensors, more than "
                        "the %zu bytes left can hold", label, (unsigned long long)n_kvs,
                        (unsigned long long)n_tensors, left(&c));
        goto fail;
    }
    f->kvs = calloc(n_kvs ? (size_t)n_kvs : 1, sizeof *f->kvs);
    f->tensors = calloc(n_tensors ? (size_t)n_tensors : 1, sizeof *f->tensors);
    if (!f->kvs || !f->tensors) { rc = cv_set_err(err, CV_ERR_NOMEM, "%s: out of memory", label); goto fail; }
    for (uint64_t i = 0; i < n_kvs; i++) {
        if ((rc = parse_kv(&c, &f->kvs[i], i)) < 0) goto fail;
        f->kvs[i].index = (size_t)i;
        f->n_kvs = (size_t)i + 1;
    }
    qsort(f->kvs, f->n_kvs, sizeof *f->kvs, cmp_kv);
    for (size_t i = 1; i < f->n_kvs; i++)
        if (cmp_kv(&f->kvs[i - 1], &f->kvs[i]) == 0) {
            rc = cv_set_err(err, CV_ERR_FORMAT, "%s: metadata key '%.*s' appears twice", label,
                            (int)(f->kvs[i].key.len > 100 ? 100 : f->kvs[i].key.len), f->kvs[i].key.p);
            goto fail;
        }
    f->alignment = GGUF_DEFAULT_ALIGNMENT;
    const cv_gguf_kv *al = cv_gguf_find_kv(f, "general.alignment");
    if (al) {
        int64_t a;
        if (al->type != CV_GGUF_U32 || !cv_gguf_kv_int(al, &a) || a < GGUF_MIN_ALIGNMENT || (a & (a - 1)) != 0 ||
            a > GGUF_MAX_ALIGNMENT) {
            rc = cv_set_err(err, CV_ERR_FORMAT, "%s: general.alignment must be a uint32 power of two in [%u, %u]",
                            label, GGUF_MIN_ALIGNMENT, GGUF_MAX_ALIGNMENT);
            goto fail;
        }
        f->alignment = (uint64_t)a;
    }
    for (uint64_t i = 0; i < n_tensors; i++) {
        if ((rc = parse_tensor_info(&c, &f->tensors[i], i)) < 0) goto fail;
        f->n_tensors = (size_t)i + 1;
    }
    size_t data_start = c.pos + (size_t)((f->alignment - c.pos % f->alignment) % f->alignment);
    if (f->n_tensors && data_start > len) {
        rc = cv_set_err(err, CV_ERR_FORMAT, "%s: truncated: the data section would start at %zu, past the end "
                        "of the %zu-byte file", label, data_start, len);
        goto fail;
    }
    f->data_start = data_start;
    const size_t data_len = data_start <= len ? len - data_start : 0;
    for (size_t i = 0; i < f->n_tensors; i++) {
        cv_gguf_tensor *t = &f->tensors[i];
        const int nl = (int)(t->name.len > 100 ? 100 : t->name.len);
        if (t->offset % f->alignment != 0) {
            rc = cv_set_err(err, CV_ERR_FORMAT, "%s: tensor '%.*s' data offset %llu is not a multiple of the "
                            "alignment %llu", label, nl, t->name.p, (unsigned long long)t->offset,
                            (unsigned long long)f->alignment);
            goto fail;
        }
        if (t->offset > data_len || t->nbytes > data_len - t->offset) {
            rc = cv_set_err(err, CV_ERR_FORMAT, "%s: tensor '%.*s' data [%llu, +%zu) runs past the end of the "
                            "file (data section holds %zu bytes; truncated?)", label, nl, t->name.p,
                            (unsigned long long)t->offset, t->nbytes, data_len);
            goto fail;
        }
        t->data = (const unsigned char *)buf + data_start + t->offset;
    }
    qsort(f->tensors, f->n_tensors, sizeof *f->tensors, cmp_tensor);
    for (size_t i = 1; i < f->n_tensors; i++)
        if (cmp_tensor(&f->tensors[i - 1], &f->tensors[i]) == 0) {
            rc = cv_set_err(err, CV_ERR_FORMAT, "%s: tensor '%.*s' appears twice", label,
                            (int)(f->tensors[i].name.len > 100 ? 100 : f->tensors[i].name.len),
                            f->tensors[i].name.p);
            goto fail;
        }
    return 0;
fail:
    cv_gguf_close(f);
    return rc;
}

int cv_gguf_open(cv_gguf_file *f, const char *path, const char *label, cv_err *err) {
    void *map = NULL;
    size_t len = 0;
    memset(f, 0, sizeof *f);
    int rc = cv_map_file(&map, &len, path, err);
    if (rc < 0) return rc;
    rc = cv_gguf_parse(f, map, len, label, err);
    if (rc < 0) {
        cv_unmap_file(map, len);
        return rc;
    }
    f->map = map;
    f->map_len = len;
    return 0;
}

void cv_gguf_release_map(cv_gguf_file *f, void **map, size_t *map_len) {
    *map = f->map;
    *map_len = f->map_len;
    f->map = NULL;
    f->map_len = 0;
}

void cv_gguf_close(cv_gguf_file *f) {
    if (!f) return;
    free(f->kvs);
    free(f->tensors);
    if (f->map) cv_unmap_file(f->map, f->map_len);
    memset(f, 0, sizeof *f);
}

const cv_gguf_kv *cv_gguf_find_kv(const cv_gguf_file *f, const char *key) {
    cv_gguf_kv probe;
    memset(&probe, 0, sizeof probe);
    probe.key.p = key;
    probe.key.len = strlen(key);
    if (!f->n_kvs) return NULL;
    return bsearch(&probe, f->kvs, f->n_kvs, sizeof *f->kvs, cmp_kv);
}

const cv_gguf_tensor *cv_gguf_find_tensor(const cv_gguf_file *f, const char *name) {
    cv_gguf_tensor probe;
    memset(&probe, 0, sizeof probe);
    probe.name.p = name;
    probe.name.len = strlen(name);
    if (!f->n_tensors) return NULL;
    return bsearch(&probe, f->tensors, f->n_tensors, sizeof *f->tensors, cmp_tensor);
}

/* One scalar of type t at p as int64 (unsigned 64-bit values above INT64_MAX fail). */
static int scalar_int(cv_gguf_type t, const unsigned char *p, int64_t *out) {
    switch (t) {
    case CV_GGUF_U8: *out = p[0]; return 1;
    case CV_GGUF_I8: *out = (int8_t)p[0]; return 1;
    case CV_GGUF_U16: *out = (int64_t)rd_le(p, 2); return 1;
    case CV_GGUF_I16: *out = (int16_t)rd_le(p, 2); return 1;
    case CV_GGUF_U32: *out = (int64_t)rd_le(p, 4); return 1;
    case CV_GGUF_I32: *out = (int32_t)(uint32_t)rd_le(p, 4); return 1;
    case CV_GGUF_U64: {
        uint64_t v = rd_le(p, 8);
        if (v > (uint64_t)INT64_MAX) return 0;
        *out = (int64_t)v;
        return 1;
    }
    case CV_GGUF_I64: *out = (int64_t)rd_le(p, 8); return 1;
    default: return 0;
    }
}

static int scalar_float(cv_gguf_type t, const unsigned char *p, double *out) {
    if (t == CV_GGUF_F32) {
        uint32_t u = (uint32_t)rd_le(p, 4);
        float f;
        memcpy(&f, &u, 4);
        *out = f;
        return 1;
    }
    if (t == CV_GGUF_F64) {
        uint64_t u = rd_le(p, 8);
        memcpy(out, &u, 8);
        return 1;
    }
    return 0;
}

int cv_gguf_kv_int(const cv_gguf_kv *kv, int64_t *out) { return scalar_int(kv->type, kv->value, out); }
int cv_gguf_kv_float(const cv_gguf_kv *kv, double *out) { return scalar_float(kv->type, kv->value, out); }

int cv_gguf_kv_bool(const cv_gguf_kv *kv, int *out) {
    if (kv->type != CV_GGUF_BOOL) return 0;
    *out = kv->value[0] != 0;
    return 1;
}

cv_gguf_str cv_gguf_next_string(const unsigned char **cursor) {
    cv_gguf_str s;
    s.len = (size_t)rd_le(*cursor, 8);
    s.p = (const char *)*cursor + 8;
    *cursor += 8 + s.len;
    return s;
}

int cv_gguf_kv_string(const cv_gguf_kv *kv, cv_gguf_str *out) {
    if (kv->type != CV_GGUF_STRING) return 0;
    const unsigned char *p = kv->value;
    *out = cv_gguf_next_string(&p);
    return 1;
}

int cv_gguf_array_int(const cv_gguf_kv *kv, uint64_t i, int64_t *out) {
    if (kv->type != CV_GGUF_ARRAY || i >= kv->count || kv->elem_type == CV_GGUF_STRING) return 0;
    return scalar_int(kv->elem_type, kv->value + i * cv_gguf_scalar_size(kv->elem_type), out);
}

int cv_gguf_array_float(const cv_gguf_kv *kv, uint64_t i, double *out) {
    if (kv->type != CV_GGUF_ARRAY || i >= kv->count || kv->elem_type == CV_GGUF_STRING) return 0;
    return scalar_float(kv->elem_type, kv->value + i * cv_gguf_scalar_size(kv->elem_type), out);
}
