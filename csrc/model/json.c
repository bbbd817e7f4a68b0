/* A small, strict JSON parser; see json.h. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* strtod_l, newlocale */
#endif
#include "json.h"

#include <locale.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- arena: every node, string and array of the tree lives here ---------- */

typedef struct arena_chunk {
    struct arena_chunk *next;
    size_t cap, used;     /* bytes of data[] */
    unsigned char *data;  /* [cap], right after the header */
} arena_chunk;

#define ARENA_ALIGN 16
#define ARENA_MIN_CHUNK ((size_t)64 * 1024)

static void *arena_alloc(arena_chunk **head, size_t n) {
    if (n == 0) n = 1;
    if (n > SIZE_MAX - 2 * ARENA_ALIGN) return NULL;
    n = (n + ARENA_ALIGN - 1) & ~(size_t)(ARENA_ALIGN - 1);
    arena_chunk *c = *head;
    if (!c || c->cap - c->used < n) {
        size_t cap = n > ARENA_MIN_CHUNK ? n : ARENA_MIN_CHUNK;
        size_t hdr = (sizeof(arena_chunk) + ARENA_ALIGN - 1) & ~(size_t)(ARENA_ALIGN - 1);
        if (cap > SIZE_MAX - hdr) return NULL;
        c = malloc(hdr + cap);
        if (!c) return NULL;
        c->next = *head;
        c->cap = cap;
        c->used = 0;
        c->data = (unsigned char *)c + hdr;
        *head = c;
    }
    void *p = c->data + c->used;
    c->used += n;
    return p;
}

static void arena_free(arena_chunk *c) {
    while (c) {
        arena_chunk *next = c->next;
        free(c);
        c = next;
    }
}

/* ---- locale-independent strtod ------------------------------------------- */

static pthread_once_t c_locale_once = PTHREAD_ONCE_INIT;
static locale_t c_locale = (locale_t)0;
static void make_c_locale(void) { c_locale = newlocale(LC_ALL_MASK, "C", (locale_t)0); }

static double strtod_c(const char *s, char **end) {
    pthread_once(&c_locale_once, make_c_locale);
    if (c_locale != (locale_t)0) return strtod_l(s, end, c_locale);
    return strtod(s, end); /* only if newlocale failed: a "C"-like locale is the default */
}

/* ---- parser --------------------------------------------------------------- */

typedef struct parser {
    const char *buf;      /* [len] */
    size_t len, pos;
    const char *label;
    cv_err *err;
    arena_chunk *arena;
    size_t n_values;      /* nodes made so far, at most CV_JSON_MAX_VALUES */
    int node_rc;          /* the error code of new_node's last failure */
    cv_json **stack;      /* children of the open containers [n_stack] */
    size_t n_stack, cap_stack;
} parser;

static int fail(parser *p, size_t at, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

static int fail(parser *p, size_t at, const char *fmt, ...) {
    char detail[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(detail, sizeof detail, fmt, ap);
    va_end(ap);
    return cv_set_err(p->err, CV_ERR_FORMAT, "%s: invalid JSON at byte %zu: %s", p->label, at, detail);
}

static int nomem(parser *p) {
    return cv_set_err(p->err, CV_ERR_NOMEM, "%s: out of memory while parsing JSON", p->label);
}

static void skip_ws(parser *p) {
    while (p->pos < p->len) {
        char c = p->buf[p->pos];
        if (c != ' ' && c != '\t' && c != '\n' && c != '\r') break;
        p->pos++;
    }
}

static int push(parser *p, cv_json *v) {
    if (p->n_stack == p->cap_stack) {
        size_t cap = p->cap_stack ? p->cap_stack * 2 : 64;
        if (cap > SIZE_MAX / sizeof(cv_json *)) return nomem(p);
        cv_json **s = realloc(p->stack, cap * sizeof(cv_json *));
        if (!s) return nomem(p);
        p->stack = s;
        p->cap_stack = cap;
    }
    p->stack[p->n_stack++] = v;
    return 0;
}

/* A zeroed node, or NULL with the error set (out of memory, or past the value cap). */
static cv_json *new_node(parser *p, cv_json_type t, size_t at) {
    if (p->n_values >= CV_JSON_MAX_VALUES) {
        p->node_rc = fail(p, at, "more than %zu values (a model file's JSON has far fewer)", CV_JSON_MAX_VALUES);
        return NULL;
    }
    cv_json *v = arena_alloc(&p->arena, sizeof *v);
    if (!v) {
        p->node_rc = nomem(p);
        return NULL;
    }
    p->n_values++;
    memset(v, 0, sizeof *v);
    v->type = t;
    v->offset = at;
    return v;
}

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* Reads 4 hex digits at buf[i..i+3] (i + 4 <= end checked by caller). */
static long hex4(const char *s) {
    long v = 0;
    for (int k = 0; k < 4; k++) {
        int h = hexval(s[k]);
        if (h < 0) return -1;
        v = v * 16 + h;
    }
    return v;
}

static size_t put_utf8(char *out, unsigned long cp) {
    if (cp < 0x80) { out[0] = (char)cp; return 1; }
    if (cp < 0x800) {
        out[0] = (char)(0xC0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (char)(0xE0 | (cp >> 12));
        out[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (char)(0xF0 | (cp >> 18));
    out[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    out[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    out[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

/* Length of the valid UTF-8 sequence at s[0..n-1] (n >= 1, s[0] >= 0x80), or 0. */
static size_t utf8_seq(const unsigned char *s, size_t n) {
    unsigned char c = s[0];
    size_t need;
    unsigned long cp, min;
    if (c >= 0xC2 && c <= 0xDF) { need = 2; cp = c & 0x1F; min = 0x80; }
    else if (c >= 0xE0 && c <= 0xEF) { need = 3; cp = c & 0x0F; min = 0x800; }
    else if (c >= 0xF0 && c <= 0xF4) { need = 4; cp = c & 0x07; min = 0x10000; }
    else return 0;
    if (n < need) return 0;
    for (size_t k = 1; k < need; k++) {
        if ((s[k] & 0xC0) != 0x80) return 0;
        cp = (cp << 6) | (s[k] & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
    return need;
}

/* Parses the string starting at the opening quote p->buf[p->pos]. */
static int parse_string(parser *p, const char **out, size_t *out_len) {
    size_t start = p->pos;
    size_t i = start + 1;
    /* first find the closing quote, to size the decoded copy */
    while (i < p->len) {
        char c = p->buf[i];
        if (c == '"') break;
        i += (c == '\\') ? 2 : 1;
    }
    if (i >= p->len) return fail(p, start, "unterminated string");
    size_t end = i; /* index of the closing quote */
    char *dst = arena_alloc(&p->arena, end - start); /* decoded <= raw bytes, + NUL */
    if (!dst) return nomem(p);
    size_t n = 0;
    i = start + 1;
    while (i < end) {
        unsigned char c = (unsigned char)p->buf[i];
        if (c < 0x20) return fail(p, i, "control character 0x%02x in string", c);
        if (c == '\\') {
            if (i + 1 >= end) return fail(p, i, "truncated escape");
            char e = p->buf[i + 1];
            switch (e) {
            case '"': dst[n++] = '"'; i += 2; continue;
            case '\\': dst[n++] = '\\'; i += 2; continue;
            case '/': dst[n++] = '/'; i += 2; continue;
            case 'b': dst[n++] = '\b'; i += 2; continue;
            case 'f': dst[n++] = '\f'; i += 2; continue;
            case 'n': dst[n++] = '\n'; i += 2; continue;
            case 'r': dst[n++] = '\r'; i += 2; continue;
            case 't': dst[n++] = '\t'; i += 2; continue;
            case 'u': break;
            default:
                if ((unsigned char)e < 0x20 || (unsigned char)e >= 0x7f)
                    return fail(p, i, "invalid escape");
                return fail(p, i, "invalid escape '\\%c'", e);
            }
            if (end - i < 6) return fail(p, i, "truncated \\u escape");
            long u = hex4(p->buf + i + 2);
            if (u < 0) return fail(p, i, "\\u needs 4 hex digits");
            unsigned long cp = (unsigned long)u;
            size_t at = i;
            i += 6;
            if (cp >= 0xDC00 && cp <= 0xDFFF) return fail(p, at, "unpaired low surrogate \\u%04lx", cp);
            if (cp >= 0xD800 && cp <= 0xDBFF) {
                if (end - i < 6 || p->buf[i] != '\\' || p->buf[i + 1] != 'u')
                    return fail(p, at, "high surrogate \\u%04lx not followed by a low surrogate", cp);
                long lo = hex4(p->buf + i + 2);
                if (lo < 0) return fail(p, i, "\\u needs 4 hex digits");
                if (lo < 0xDC00 || lo > 0xDFFF)
                    return fail(p, at, "high surrogate \\u%04lx not followed by a low surrogate", cp);
                cp = 0x10000 + ((cp - 0xD800) << 10) + ((unsigned long)lo - 0xDC00);
                i += 6;
            }
            n += put_utf8(dst + n, cp);
            continue;
        }
        if (c < 0x80) {
            dst[n++] = (char)c;
            i++;
            continue;
        }
        size_t k = utf8_seq((const unsigned char *)p->buf + i, end - i);
        if (k == 0) return fail(p, i, "invalid UTF-8 in string");
        memcpy(dst + n, p->buf + i, k);
        n += k;
        i += k;
    }
    dst[n] = '\0';
    p->pos = end + 1;
    *out = dst;
    *out_len = n;
    return 0;
}

static int parse_number(parser *p, cv_json **out) {
    size_t start = p->pos, i = p->pos;
    const char *b = p->buf;
    int neg = 0, integral = 1;
    if (i < p->len && b[i] == '-') { neg = 1; i++; }
    if (i >= p->len || b[i] < '0' || b[i] > '9') return fail(p, start, "invalid number");
    if (b[i] == '0') {
        i++;
        if (i < p->len && b[i] >= '0' && b[i] <= '9') return fail(p, start, "number with a leading zero");
    } else {
        while (i < p->len && b[i] >= '0' && b[i] <= '9') i++;
    }
    size_t int_end = i;
    if (i < p->len && b[i] == '.') {
        integral = 0;
        i++;
        if (i >= p->len || b[i] < '0' || b[i] > '9') return fail(p, start, "number needs digits after '.'");
        while (i < p->len && b[i] >= '0' && b[i] <= '9') i++;
    }
    if (i < p->len && (b[i] == 'e' || b[i] == 'E')) {
        integral = 0;
        i++;
        if (i < p->len && (b[i] == '+' || b[i] == '-')) i++;
        if (i >= p->len || b[i] < '0' || b[i] > '9') return fail(p, start, "number needs digits in its exponent");
        while (i < p->len && b[i] >= '0' && b[i] <= '9') i++;
    }
    cv_json *v = new_node(p, CV_JSON_NUMBER, start);
    if (!v) return p->node_rc;
    if (integral) {
        /* exact int64 when it fits: accumulate toward the sign to reach INT64_MIN */
        int64_t acc = 0;
        int fits = 1;
        for (size_t k = start + (size_t)neg; k < int_end; k++) {
            int d = b[k] - '0';
            if (neg) {
                if (acc < (INT64_MIN + d) / 10) { fits = 0; break; }
                acc = acc * 10 - d;
            } else {
                if (acc > (INT64_MAX - d) / 10) { fits = 0; break; }
                acc = acc * 10 + d;
            }
        }
        if (fits) {
            v->is_int = 1;
            v->integer = acc;
        }
    }
    /* strtod needs a NUL-terminated copy: the input is not terminated */
    size_t tlen = i - start;
    char small[64];
    char *tmp = small;
    if (tlen >= sizeof small) {
        tmp = malloc(tlen + 1);
        if (!tmp) return nomem(p);
    }
    memcpy(tmp, b + start, tlen);
    tmp[tlen] = '\0';
    char *endp = NULL;
    double d = strtod_c(tmp, &endp);
    int parsed_all = endp == tmp + tlen;
    if (tmp != small) free(tmp);
    if (!parsed_all) return fail(p, start, "invalid number");
    if (!isfinite(d)) return fail(p, start, "number out of range");
    v->number = d;
    p->pos = i;
    *out = v;
    return 0;
}

static int cmp_key(const char *a, size_t al, const char *b, size_t bl) {
    size_t m = al < bl ? al : bl;
    int c = m ? memcmp(a, b, m) : 0;
    if (c) return c;
    return (al > bl) - (al < bl);
}

static int cmp_members(const void *x, const void *y) {
    const cv_json *a = *(cv_json *const *)x;
    const cv_json *b = *(cv_json *const *)y;
    return cmp_key(a->key, a->key_len, b->key, b->key_len);
}

static int parse_value(parser *p, int depth, cv_json **out);

/* Moves the children pushed since base into an arena array of v. */
static int take_children(parser *p, cv_json *v, size_t base) {
    size_t n = p->n_stack - base;
    v->len = n;
    if (n == 0) return 0;
    if (n > SIZE_MAX / sizeof(cv_json *)) return nomem(p);
    v->items = arena_alloc(&p->arena, n * sizeof(cv_json *));
    if (!v->items) return nomem(p);
    memcpy(v->items, p->stack + base, n * sizeof(cv_json *));
    p->n_stack = base;
    return 0;
}

static int parse_container(parser *p, int depth, cv_json **out, int is_object) {
    size_t start = p->pos;
    if (depth >= CV_JSON_MAX_DEPTH) return fail(p, start, "nesting deeper than %d levels", CV_JSON_MAX_DEPTH);
    cv_json *v = new_node(p, is_object ? CV_JSON_OBJECT : CV_JSON_ARRAY, start);
    if (!v) return p->node_rc;
    char close = is_object ? '}' : ']';
    size_t base = p->n_stack;
    int rc;
    p->pos++;
    skip_ws(p);
    if (p->pos < p->len && p->buf[p->pos] == close) {
        p->pos++;
        *out = v;
        return 0;
    }
    for (;;) {
        const char *key = NULL;
        size_t key_len = 0;
        skip_ws(p);
        if (is_object) {
            if (p->pos >= p->len) return fail(p, p->pos, "unexpected end of input in object");
            if (p->buf[p->pos] != '"') return fail(p, p->pos, "expected a string key");
            if ((rc = parse_string(p, &key, &key_len)) < 0) return rc;
            skip_ws(p);
            if (p->pos >= p->len || p->buf[p->pos] != ':') return fail(p, p->pos, "expected ':' after a key");
            p->pos++;
        }
        cv_json *child = NULL;
        if ((rc = parse_value(p, depth + 1, &child)) < 0) return rc;
        child->key = key;
        child->key_len = key_len;
        if ((rc = push(p, child)) < 0) return rc;
        skip_ws(p);
        if (p->pos >= p->len)
            return fail(p, p->pos, "unexpected end of input in %s", is_object ? "object" : "array");
        char c = p->buf[p->pos];
        if (c == ',') { p->pos++; continue; }
        if (c == close) { p->pos++; break; }
        return fail(p, p->pos, "expected ',' or '%c'", close);
    }
    if ((rc = take_children(p, v, base)) < 0) return rc;
    if (is_object) {
        v->sorted = arena_alloc(&p->arena, v->len * sizeof(cv_json *));
        if (!v->sorted) return nomem(p);
        memcpy(v->sorted, v->items, v->len * sizeof(cv_json *));
        qsort(v->sorted, v->len, sizeof(cv_json *), cmp_members);
        for (size_t k = 1; k < v->len; k++) {
            if (cmp_members(&v->sorted[k - 1], &v->sorted[k]) == 0) {
                const cv_json *a = v->sorted[k - 1], *b = v->sorted[k];
                const cv_json *later = a->offset > b->offset ? a : b;
                return fail(p, later->offset, "duplicate key \"%.100s\"", later->key);
            }
        }
    }
    *out = v;
    return 0;
}

static int parse_literal(parser *p, const char *word, cv_json_type t, int bval, cv_json **out) {
    size_t n = strlen(word);
    if (p->len - p->pos < n || memcmp(p->buf + p->pos, word, n) != 0)
        return fail(p, p->pos, "invalid literal (expected %s)", word);
    cv_json *v = new_node(p, t, p->pos);
    if (!v) return p->node_rc;
    v->boolean = bval;
    p->pos += n;
    *out = v;
    return 0;
}

static int parse_value(parser *p, int depth, cv_json **out) {
    skip_ws(p);
    if (p->pos >= p->len) return fail(p, p->pos, "unexpected end of input");
    unsigned char c = (unsigned char)p->buf[p->pos];
    switch (c) {
    case '{': return parse_container(p, depth, out, 1);
    case '[': return parse_container(p, depth, out, 0);
    case '"': {
        cv_json *v = new_node(p, CV_JSON_STRING, p->pos);
        if (!v) return p->node_rc;
        int rc = parse_string(p, &v->str, &v->len);
        if (rc < 0) return rc;
        *out = v;
        return 0;
    }
    case 't': return parse_literal(p, "true", CV_JSON_BOOL, 1, out);
    case 'f': return parse_literal(p, "false", CV_JSON_BOOL, 0, out);
    case 'n': return parse_literal(p, "null", CV_JSON_NULL, 0, out);
    default:
        if (c == '-' || (c >= '0' && c <= '9')) return parse_number(p, out);
        if (c >= 0x20 && c < 0x7f) return fail(p, p->pos, "unexpected character '%c'", c);
        return fail(p, p->pos, "unexpected byte 0x%02x", c);
    }
}

int cv_json_parse(cv_json_doc *doc, const char *buf, size_t len, const char *label, cv_err *err) {
    parser p;
    int rc;
    memset(&p, 0, sizeof p);
    memset(doc, 0, sizeof *doc);
    p.buf = buf;
    p.len = buf ? len : 0;
    p.label = label ? label : "JSON";
    p.err = err;
    cv_json *root = NULL;
    skip_ws(&p);
    if (p.pos >= p.len) {
        rc = cv_set_err(err, CV_ERR_FORMAT, "%s: is empty (no JSON value)", p.label);
        goto done;
    }
    if ((rc = parse_value(&p, 0, &root)) < 0) goto done;
    skip_ws(&p);
    if (p.pos != p.len) {
        rc = fail(&p, p.pos, "unexpected data after the JSON value");
        goto done;
    }
    doc->root = root;
    doc->arena = p.arena;
    p.arena = NULL;
    rc = 0;
done:
    arena_free(p.arena);
    free(p.stack);
    return rc;
}

void cv_json_free(cv_json_doc *doc) {
    if (!doc) return;
    arena_free(doc->arena);
    doc->arena = NULL;
    doc->root = NULL;
}

const cv_json *cv_json_getn(const cv_json *obj, const char *key, size_t key_len) {
    if (!obj || obj->type != CV_JSON_OBJECT || !key) return NULL;
    size_t lo = 0, hi = obj->len;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        const cv_json *m = obj->sorted[mid];
        int c = cmp_key(m->key, m->key_len, key, key_len);
        if (c == 0) return m;
        if (c < 0) lo = mid + 1;
        else hi = mid;
    }
    return NULL;
}

const cv_json *cv_json_get(const cv_json *obj, const char *key) {
    return key ? cv_json_getn(obj, key, strlen(key)) : NULL;
}

const char *cv_json_type_name(cv_json_type t) {
    switch (t) {
    case CV_JSON_NULL: return "null";
    case CV_JSON_BOOL: return "bool";
    case CV_JSON_NUMBER: return "number";
    case CV_JSON_STRING: return "string";
    case CV_JSON_ARRAY: return "array";
    case CV_JSON_OBJECT: return "object";
    default: return "?";
    }
}
