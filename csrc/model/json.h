/* A small, strict JSON parser (RFC 8259) for config.json, safetensors
 * headers and shard indexes.
 *
 * The whole document is parsed into a tree that lives in one arena, freed by
 * cv_json_free. Strict means: UTF-8 is validated, control characters inside
 * strings, trailing commas, comments, NaN/Infinity, leading zeros and
 * duplicate object keys are errors, and nesting deeper than
 * CV_JSON_MAX_DEPTH or more than CV_JSON_MAX_VALUES values is an error. The parser never reads outside
 * buf[0 .. len-1] and does not need a terminating NUL. */
#ifndef CV_MODEL_JSON_H
#define CV_MODEL_JSON_H

#include <stddef.h>
#include <stdint.h>
#include "../../base/common.h"

#define CV_JSON_MAX_DEPTH 64
/* The caps every model-file JSON is parsed under (safetensors headers, shard
 * indexes): at most CV_JSON_MAX_BYTES of text and CV_JSON_MAX_VALUES values,
 * so that the tree (about 100 bytes a value) stays near 100 MiB whatever the
 * text holds. Real files are far below both. */
#define CV_JSON_MAX_BYTES ((size_t)16 << 20)
#define CV_JSON_MAX_VALUES ((size_t)1 << 20)

typedef enum cv_json_type {
    CV_JSON_NULL = 0,
    CV_JSON_BOOL,
    CV_JSON_NUMBER,
    CV_JSON_STRING,
    CV_JSON_ARRAY,
    CV_JSON_OBJECT
} cv_json_type;

typedef struct cv_json cv_json;
struct cv_json {
    cv_json_type type;
    size_t offset;        /* byte offset of the value in the input */
    int boolean;          /* BOOL */
    double number;        /* NUMBER */
    int is_int;           /* NUMBER written without fraction/exponent and fitting int64 */
    int64_t integer;      /* NUMBER, valid when is_int */
    const char *str;      /* STRING: decoded UTF-8, NUL-terminated (may hold \u0000) [len] */
    size_t len;           /* STRING: bytes; ARRAY/OBJECT: number of elements */
    const char *key;      /* set on object members: decoded key, NUL-terminated [key_len] */
    size_t key_len;
    cv_json **items;      /* ARRAY/OBJECT: elements in document order [len] */
    cv_json **sorted;     /* OBJECT: members sorted by key bytes [len] */
};

typedef struct cv_json_doc {
    cv_json *root;
    void *arena;          /* owned chunk list */
} cv_json_doc;

/* Parses buf[0..len-1]. label names the input in error messages
 * ("<label>: invalid JSON at byte N: ..."). On error returns CV_ERR_FORMAT
 * (or CV_ERR_NOMEM) and leaves doc empty. */
int cv_json_parse(cv_json_doc *doc, const char *buf, size_t len, const char *label, cv_err *err);
/* Frees the tree; safe on a zeroed doc. */
void cv_json_free(cv_json_doc *doc);

/* The member of object obj named key, or NULL (also when obj is not an object). */
const cv_json *cv_json_get(const cv_json *obj, const char *key);
/* Same with an explicit key length (keys may contain NUL). */
const cv_json *cv_json_getn(const cv_json *obj, const char *key, size_t key_len);

/* "null", "bool", "number", "string", "array", "object". */
const char *cv_json_type_name(cv_json_type t);

#endif
