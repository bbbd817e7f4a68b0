/* Reading .safetensors files; see safetensors.h. */
#include "safetensors.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mapped_file.h"

static const struct {
    const char *name;
    size_t size;
    cv_dtype dtype;
} st_dtypes[] = {
    {"F32", 4, CV_F32},   {"F16", 2, CV_F16},   {"BF16", 2, CV_BF16},  {"F64", 8, CV_F64},
    {"I32", 4, CV_I32},   {"I64", 8, CV_I64},   {"BOOL", 1, CV_DTYPE_INVALID},
    {"U8", 1, CV_DTYPE_INVALID},  {"I8", 1, CV_DTYPE_INVALID},  {"I16", 2, CV_DTYPE_INVALID},
    {"U16", 2, CV_DTYPE_INVALID}, {"U32", 4, CV_DTYPE_INVALID}, {"U64", 8, CV_DTYPE_INVALID},
    {"F8_E5M2", 1, CV_DTYPE_INVALID}, {"F8_E4M3", 1, CV_DTYPE_INVALID},
    {"F8_E8M0", 1, CV_DTYPE_INVALID},
};

void cv_st_shape_str(char *buf, size_t n, const int64_t *shape, int ndim) {
    size_t used = 0;
    if (n == 0) return;
    buf[0] = '\0';
    for (int d = 0; d <= ndim && used < n; d++) {
        int w;
        if (d == ndim) w = snprintf(buf + used, n - used, "]");
        else w = snprintf(buf + used, n - used, "%s%lld", d ? ", " : "[", (long long)shape[d]);
        if (w < 0) return;
        used += (size_t)w;
    }
    if (ndim == 0 && used < n) snprintf(buf, n, "[]");
}

size_t cv_st_dtype_size(const char *name, cv_dtype *dtype) {
    for (size_t i = 0; i < sizeof st_dtypes / sizeof st_dtypes[0]; i++) {
        if (strcmp(name, st_dtypes[i].name) == 0) {
            if (dtype) *dtype = st_dtypes[i].dtype;
            return st_dtypes[i].size;
        }
    }
    if (dtype) *dtype = CV_DTYPE_INVALID;
    return 0;
}

/* A non-negative JSON integer, or -1. */
static int64_t json_uint(const cv_json *v) {
    if (!v || v->type != CV_JSON_NUMBER || !v->is_int || v->integer < 0) return -1;
    return v->integer;
}

static int parse_entry(cv_st_file *f, cv_st_tensor *t, const cv_json *e, cv_err *err) {
    const char *L = f->label, *N = t->name;
    if (e->type != CV_JSON_OBJECT)
        return cv_set_err(err, CV_ERR_FORMAT, "%s: tensor '%s': header entry is a %s, expected an object", L, N,
                          cv_json_type_name(e->type));
    const cv_json *dt = cv_json_get(e, "dtype");
    const cv_json *sh = cv_json_get(e, "shape");
    const cv_json *off = cv_json_get(e, "data_offsets");
    if (!dt || dt->type != CV_JSON_STRING)
        return cv_set_err(err, CV_ERR_FORMAT, "%s: tensor '%s': \"dtype\" %s", L, N,
                          dt ? "is not a string" : "is missing");
    if (!sh || sh->type != CV_JSON_ARRAY)
        return cv_set_err(err, CV_ERR_FORMAT, "%s: tensor '%s': \"shape\" %s", L, N,
                          sh ? "is not an array" : "is missing");
    if (!off || off->type != CV_JSON_ARRAY || off->len != 2)
        return cv_set_err(err, CV_ERR_FORMAT, "%s: tensor '%s': \"data_offsets\" %s", L, N,
                          off ? "is not an array [begin, end]" : "is missing");
    t->dtype_name = dt->str;
    t->elem_size = cv_st_dtype_size(dt->str, &t->dtype);
    if (sh->len > CV_ST_MAX_DIMS)
        return cv_set_err(err, CV_ERR_FORMAT, "%s: tensor '%s': shape has %zu dimensions (at most %d)", L, N,
                          sh->len, CV_ST_MAX_DIMS);
    t->ndim = (int)sh->len;
    size_t count = 1;
    int overflow = 0;
    for (size_t d = 0; d < sh->len; d++) {
        int64_t v = json_uint(sh->items[d]);
        if (v < 0)
            return cv_set_err(err, CV_ERR_FORMAT, "%s: tensor '%s': shape[%zu] is not a non-negative integer", L,
                              N, d);
        t->shape[d] = v;
        if ((uint64_t)v > SIZE_MAX || !cv_mul_size(count, (size_t)v, &count)) overflow = 1;
    }
    int64_t b = json_uint(off->items[0]), en = json_uint(off->items[1]);
    if (b < 0 || en < 0)
        return cv_set_err(err, CV_ERR_FORMAT, "%s: tensor '%s': data_offsets must be non-negative integers", L, N);
    if (b > en)
        return cv_set_err(err, CV_ERR_FORMAT, "%s: tensor '%s': data_offsets [%lld, %lld] has begin > end", L, N,
                          (long long)b, (long long)en);
    if ((uint64_t)en > f->data_len)
        return cv_set_err(err, CV_ERR_FORMAT,
                          "%s: tensor '%s': data_offsets [%lld, %lld] run past the data section (%zu bytes)", L,
                          N, (long long)b, (long long)en, f->data_len);
    t->begin = (uint64_t)b;
    t->end = (uint64_t)en;
    t->data = f->data + t->begin;
    if (t->elem_size) {
        size_t bytes = 0;
        char shs[160];
        cv_st_shape_str(shs, sizeof shs, t->shape, t->ndim);
        if (overflow || !cv_mul_size(count, t->elem_size, &bytes))
            return cv_set_err(err, CV_ERR_FORMAT, "%s: tensor '%s': shape %s of %s overflows the size range", L,
                              N, shs, t->dtype_name);
        if ((uint64_t)bytes != t->end - t->begin)
            return cv_set_err(err, CV_ERR_FORMAT,
                              "%s: tensor '%s': shape %s of %s needs %zu bytes but data_offsets [%llu, %llu] hold %llu",
                              L, N, shs, t->dtype_name, bytes, (unsigned long long)t->begin,
                              (unsigned long long)t->end, (unsigned long long)(t->end - t->begin));
    }
    return 0;
}

static int cmp_begin(const void *x, const void *y) {
    const cv_st_tensor *a = *(const cv_st_tensor *const *)x;
    const cv_st_tensor *b = *(const cv_st_tensor *const *)y;
    if (a->begin != b->begin) return a->begin < b->begin ? -1 : 1;
    return (a->end > b->end) - (a->end < b->end);
}

int cv_st_parse(cv_st_file *f, const void *buf, size_t len, const char *label, cv_err *err) {
    int rc = 0;
    cv_st_tensor **by_begin = NULL; /* [n_tensors] */
    memset(f, 0, sizeof *f);
    f->label = label ? label : "safetensors";
    const char *L = f->label;
    const unsigned char *bytes = buf;
    if (!bytes || len < 8) {
        rc = cv_set_err(err, CV_ERR_FORMAT, "%s: file is %zu bytes, too short for the 8-byte header length", L,
                        bytes ? len : 0);
        goto done;
    }
    uint64_t n = 0;
    for (int k = 7; k >= 0; k--) n = (n << 8) | bytes[k];
    if (n > (uint64_t)(len - 8)) {
        rc = cv_set_err(err, CV_ERR_FORMAT,
                        "%s: header length %llu goes past the end of the file (%zu bytes after the length field)",
                        L, (unsigned long long)n, len - 8);
        goto done;
    }
    if (n > CV_ST_MAX_HEADER) {
        rc = cv_set_err(err, CV_ERR_FORMAT, "%s: header length %llu is over the %llu-byte limit", L,
                        (unsigned long long)n, (unsigned long long)CV_ST_MAX_HEADER);
        goto done;
    }
    f->data = bytes + 8 + n;
    f->data_len = len - 8 - (size_t)n;
    if ((rc = cv_json_parse(&f->header, (const char *)bytes + 8, (size_t)n, L, err)) < 0) goto done;
    const cv_json *root = f->header.root;
    if (root->type != CV_JSON_OBJECT) {
        rc = cv_set_err(err, CV_ERR_FORMAT, "%s: header is a JSON %s, expected an object", L,
                        cv_json_type_name(root->type));
        goto done;
    }
    if (root->len > 0) {
        f->tensors = calloc(root->len, sizeof *f->tensors);
        if (!f->tensors) {
            rc = cv_set_err(err, CV_ERR_NOMEM, "%s: out of memory for %zu tensor entries", L, root->len);
            goto done;
        }
    }
    /* walk members in key order so that tensors[] comes out sorted by name */
    for (size_t i = 0; i < root->len; i++) {
        const cv_json *e = root->sorted[i];
        if (e->key_len == 12 && memcmp(e->key, "__metadata__", 12) == 0) {
            if (e->type != CV_JSON_OBJECT) {
                rc = cv_set_err(err, CV_ERR_FORMAT, "%s: \"__metadata__\" is a %s, expected an object", L,
                                cv_json_type_name(e->type));
                goto done;
            }
            continue;
        }
        cv_st_tensor *t = &f->tensors[f->n_tensors];
        t->name = e->key;
        t->name_len = e->key_len;
        if ((rc = parse_entry(f, t, e, err)) < 0) goto done;
        f->n_tensors++;
    }
    /* no two non-empty tensors may share bytes */
    if (f->n_tensors > 1) {
        by_begin = malloc(f->n_tensors * sizeof *by_begin);
        if (!by_begin) {
            rc = cv_set_err(err, CV_ERR_NOMEM, "%s: out of memory", L);
            goto done;
        }
        size_t m = 0;
        for (size_t i = 0; i < f->n_tensors; i++)
            if (f->tensors[i].end > f->tensors[i].begin) by_begin[m++] = &f->tensors[i];
        qsort(by_begin, m, sizeof *by_begin, cmp_begin);
        for (size_t i = 1; i < m; i++) {
            const cv_st_tensor *a = by_begin[i - 1], *b = by_begin[i];
            if (b->begin < a->end) {
                rc = cv_set_err(err, CV_ERR_FORMAT,
                                "%s: tensors '%s' [%llu, %llu] and '%s' [%llu, %llu] overlap in the data section",
                                L, a->name, (unsigned long long)a->begin, (unsigned long long)a->end, b->name,
                                (unsigned long long)b->begin, (unsigned long long)b->end);
                goto done;
            }
        }
    }
    rc = 0;
done:
    free(by_begin);
    if (rc < 0) {
        cv_json_free(&f->header);
        free(f->tensors);
        f->tensors = NULL;
        f->n_tensors = 0;
    }
    return rc;
}

int cv_st_open(cv_st_file *f, const char *path, const char *label, cv_err *err) {
    void *map = NULL;
    size_t len = 0;
    memset(f, 0, sizeof *f);
    int rc = cv_map_file(&map, &len, path, err);
    if (rc < 0) return rc;
    rc = cv_st_parse(f, map, len, label ? label : path, err);
    if (rc < 0) {
        cv_unmap_file(map, len);
        return rc;
    }
    f->map = map;
    f->map_len = len;
    return 0;
}

const cv_st_tensor *cv_st_find(const cv_st_file *f, const char *name) {
    size_t lo = 0, hi = f->n_tensors, nl = strlen(name);
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        const cv_st_tensor *t = &f->tensors[mid];
        size_t m = t->name_len < nl ? t->name_len : nl;
        int c = m ? memcmp(t->name, name, m) : 0;
        if (c == 0) c = (t->name_len > nl) - (t->name_len < nl);
        if (c == 0) return t;
        if (c < 0) lo = mid + 1;
        else hi = mid;
    }
    return NULL;
}

void cv_st_release_map(cv_st_file *f, void **map, size_t *map_len) {
    *map = f->map;
    *map_len = f->map_len;
    f->map = NULL;
    f->map_len = 0;
}

void cv_st_close(cv_st_file *f) {
    if (!f) return;
    cv_json_free(&f->header);
    free(f->tensors);
    if (f->map) cv_unmap_file(f->map, f->map_len);
    memset(f, 0, sizeof *f);
}
